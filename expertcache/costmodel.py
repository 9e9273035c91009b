"""Hardware cost models: estimated time per token from a replay's counts.

time/token = dense + layers * top_k * expert + (synchronous fetches/token) * fetch / parallel
             + (background and prefetch fetches/token) * fetch / parallel, unless they overlap compute
             + (expert-compute batches/token) * segment + (calls with a substitution/token) * decision
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
    segment_s: float = 0.0  # one expert-compute batch (engine overhead per batch)
    decision_s: float = 0.0  # one MoE call with a substitution (the policy's own work)

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
        t += per_token(s.segments) * self.segment_s + per_token(s.substituted_calls) * self.decision_s
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
    (expert compute included, so expert_s is 0). Three runs at a 25% cache (fetch-every-miss,
    the 0.15 rule, substitute-every-miss) give, by least squares, the extra time per
    synchronous fetch, per expert-compute batch and per substituting call. The raw O_DIRECT
    read time is reported in `source`."""
    import statistics
    import time

    import numpy as np
    import torch

    from .cache import CacheConfig
    from .engine import Engine, EngineConfig
    from .perplexity import EVAL_TEXT

    def run(fraction: float, policy: str) -> tuple[float, np.ndarray, Engine]:
        eng = Engine(model, EngineConfig(store=store, cache=CacheConfig(fraction=fraction), policy=policy))
        ids = eng.encode(EVAL_TEXT.read_text(encoding="utf-8")[:20000])
        times, counts = [], []
        for _ in range(3):
            eng.reset()
            s = eng.stats
            if mode == "decode":
                eng.forward(torch.tensor(ids[:32]), 0)
                before, t = (s.sync_fetches, s.segments, s.substituted_calls, s.moe_calls), time.perf_counter()
                for pos in range(32, 96):
                    eng.forward(torch.tensor(ids[pos:pos + 1]), pos)
            else:
                before, t = (0, 0, 0, 0), time.perf_counter()
                for start in range(0, 1024, 256):
                    eng.forward(torch.tensor(ids[start:start + 256]), 0)
            elapsed = time.perf_counter() - t
            tokens = (s.moe_calls - before[3]) / eng.args.num_layers
            times.append(elapsed / tokens)
            counts.append(np.array([s.sync_fetches - before[0], s.segments - before[1],
                                    s.substituted_calls - before[2]]) / tokens)
        return statistics.median(times), np.median(counts, axis=0), eng

    floor, floor_counts, eng = run(1.0, "fetch-all")
    a, st = eng.args, eng.store
    rng = np.random.default_rng(0)
    w13, w2 = torch.empty(st.shape.w13), torch.empty(st.shape.w2)
    reads = []
    for _ in range(repeats):
        t = time.perf_counter()
        st.read_into(int(rng.integers(a.num_layers)), int(rng.integers(a.num_experts)), w13, w2)
        reads.append(time.perf_counter() - t)
    eng.close()
    rows, extra = [], []
    for policy in ("fetch-all", "threshold:tau=0.15", "substitute-all"):
        t, counts, e = run(0.25, policy)
        e.close()
        rows.append(counts - np.array([0, floor_counts[1], 0]))
        extra.append(t - floor)
    (fetch_s, segment_s, decision_s), *_ = np.linalg.lstsq(np.array(rows), np.array(extra), rcond=None)
    return HardwareProfile(f"this-machine-{store}-{mode}", fetch_latency_s=max(0.0, float(fetch_s)),
                           fetch_bandwidth=float("inf"), parallel_fetches=1.0, expert_s=0.0,
                           dense_s=floor - floor_counts[1] * max(0.0, float(segment_s)), overlap=True,
                           expert_bytes=st.expert_bytes, layers=a.num_layers, top_k=a.top_k,
                           source=f"measured by calibrate-hw ({store} store, {mode}); one O_DIRECT read alone: "
                                  f"{1e6 * statistics.median(reads):.0f} us",
                           segment_s=max(0.0, float(segment_s)), decision_s=max(0.0, float(decision_s)))
