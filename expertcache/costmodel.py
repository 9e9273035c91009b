"""Hardware cost models: estimated time per token from a replay's counts.

time/token = dense + layers * top_k * expert + (synchronous fetches/token) * fetch / parallel
             + (background and prefetch fetches/token) * fetch / parallel, unless they overlap compute
(fetches/token: fetches per MoE call of the replay times the profile's layers)
with fetch = latency + bytes / bandwidth. Profiles are measured on this machine by
`expertcache calibrate-hw` (per store and mode) or written from datasheet figures.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .stats import RunStats


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    fetch_latency_s: float  # fixed cost of one fetch
    fetch_bandwidth: float  # bytes per second of one fetch
    parallel_fetches: float  # a token's misses in flight at once (effective)
    expert_s: float  # compute of one (token, expert)
    dense_s: float  # everything but routed experts, per token
    overlap: bool  # background and prefetch transfers hide behind compute
    expert_bytes: int
    layers: int
    top_k: int
    source: str = ""

    @property
    def fetch_s(self) -> float:
        return self.fetch_latency_s + self.expert_bytes / self.fetch_bandwidth

    def ms_per_token(self, s: RunStats) -> float:
        # Counts per MoE call times the profile's depth: a datasheet profile applies a trace's
        # per-layer miss rates to the profiled model's number of layers.
        per_token = lambda n: n / s.moe_calls * self.layers  # noqa: E731
        t = self.dense_s + self.layers * self.top_k * self.expert_s
        t += per_token(s.sync_fetches) * self.fetch_s / self.parallel_fetches
        if not self.overlap:
            t += per_token(s.background_fetches + s.prefetch_fetches) * self.fetch_s / self.parallel_fetches
        return 1000 * t

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "HardwareProfile":
        return cls(**json.loads(Path(path).read_text()))


def _datasheet(name, pcie_gbs, mem_gbs, expert_bytes, dense_bytes, layers, top_k, source):
    # Decode is bandwidth-bound: an expert's compute is reading its weights from VRAM.
    return HardwareProfile(name, fetch_latency_s=10e-6, fetch_bandwidth=pcie_gbs * 1e9, parallel_fetches=1.0,
                           expert_s=expert_bytes / (mem_gbs * 1e9), dense_s=dense_bytes / (mem_gbs * 1e9),
                           overlap=True, expert_bytes=expert_bytes, layers=layers, top_k=top_k, source=source)


# Qwen3-Next-80B-A3B: 48 layers, 512 experts of 3 x 2048 x 512 bf16 (6.3 MB), top-10, ~3 GB
# of non-expert weights; Qwen3-30B-A3B: 48 layers, 128 experts of 3 x 2048 x 768 bf16
# (9.4 MB), top-8, ~3 GB non-expert.
DATASHEET = {
    "rtx3090-qwen3-next": _datasheet("rtx3090-qwen3-next", 25.0, 936.0, 3 * 2048 * 512 * 2, 3.0e9, 48, 10,
                                     "RTX 3090: 936 GB/s GDDR6X, PCIe 4.0 x16 ~25 GB/s pinned host-to-device"),
    "a6000-qwen3-30b": _datasheet("a6000-qwen3-30b", 25.0, 768.0, 3 * 2048 * 768 * 2, 3.0e9, 48, 8,
                                  "RTX A6000: 768 GB/s GDDR6, PCIe 4.0 x16 ~25 GB/s pinned host-to-device"),
}


def load_profile(name_or_path: str) -> HardwareProfile:
    if name_or_path in DATASHEET:
        return DATASHEET[name_or_path]
    from .errors import UnknownName
    if not Path(name_or_path).exists():
        raise UnknownName(f"unknown hardware profile {name_or_path!r}; give a file from `expertcache calibrate-hw` "
                          f"or one of {', '.join(DATASHEET)}")
    return HardwareProfile.load(Path(name_or_path))


def measure_profile(model: Path | None, store: str = "disk", mode: str = "decode", repeats: int = 200) -> HardwareProfile:
    """Measure a profile on this machine with the engine itself. `mode`: decode (one token per
    forward) or forced (windows of 256). dense: the time per token with every expert resident
    (expert compute included, so expert_s is 0); fetch: the extra time per synchronous fetch of
    fetch-every-miss at a 25% cache, which holds the read, its hand-off and the engine's
    bookkeeping. The raw O_DIRECT read time is reported in `source`."""
    import statistics
    import time

    import numpy as np
    import torch

    from .cache import CacheConfig
    from .engine import Engine, EngineConfig
    from .perplexity import EVAL_TEXT

    def per_token(fraction: float) -> tuple[float, float, Engine]:
        eng = Engine(model, EngineConfig(store=store, cache=CacheConfig(fraction=fraction)))
        ids = eng.encode(EVAL_TEXT.read_text(encoding="utf-8")[:20000])
        times, fetches = [], []
        for _ in range(3):
            eng.reset()
            if mode == "decode":
                eng.forward(torch.tensor(ids[:32]), 0)
                f0, t = eng.stats.sync_fetches, time.perf_counter()
                for pos in range(32, 96):
                    eng.forward(torch.tensor(ids[pos:pos + 1]), pos)
                n = 64
            else:
                f0, t = eng.stats.sync_fetches, time.perf_counter()
                for s in range(0, 1024, 256):
                    eng.forward(torch.tensor(ids[s:s + 256]), 0)
                n = 1024
            times.append((time.perf_counter() - t) / n)
            fetches.append((eng.stats.sync_fetches - f0) / n)
        return statistics.median(times), statistics.median(fetches), eng

    floor, _, eng = per_token(1.0)
    a, st = eng.args, eng.store
    rng = np.random.default_rng(0)
    w13, w2 = torch.empty(st.shape.w13), torch.empty(st.shape.w2)
    reads = []
    for _ in range(repeats):
        t = time.perf_counter()
        st.read_into(int(rng.integers(a.num_layers)), int(rng.integers(a.num_experts)), w13, w2)
        reads.append(time.perf_counter() - t)
    eng.close()
    slow, fetches, eng = per_token(0.25)
    eng.close()
    fetch_s = max(0.0, slow - floor) / fetches if fetches else 0.0
    return HardwareProfile(f"this-machine-{store}-{mode}", fetch_latency_s=fetch_s, fetch_bandwidth=float("inf"),
                           parallel_fetches=1.0, expert_s=0.0, dense_s=floor, overlap=True,
                           expert_bytes=st.expert_bytes, layers=a.num_layers, top_k=a.top_k,
                           source=f"measured by calibrate-hw ({store} store, {mode}); one O_DIRECT read alone: "
                                  f"{1e6 * statistics.median(reads):.0f} us")
