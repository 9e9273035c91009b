"""Hardware cost models: estimated time per token from a replay's counts.

time/token = dense + (expert runs/token) * expert_run
             + (calls that wait for fetches/token) * fetch_latency
             + (synchronous fetches/token) * bytes / bandwidth
             + (admissions and prefetches/token) * bytes / bandwidth, unless they overlap compute
             + (admissions/token) * admission + (calls with a substitution/token) * decision
A call's synchronous fetches are issued together and waited for once: the latency is paid per
waiting call, the transfer per fetch. An expert run is one expert applied to one batch of
tokens (its weights read once): k per token and layer in decode, fewer per token when a
window's tokens share experts. Counts per token are counts per MoE call times the profile's
layers, so a datasheet profile applies a trace's per-layer rates to the profiled model's
depth. Profiles are measured on this machine by `expertcache calibrate-hw` (per store and
mode) or written from datasheet figures.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..engine.stats import RunStats


@dataclass(frozen=True)
class HardwareProfile:
    """The cost of each term of the time-per-token model on one machine, slow tier and model depth."""
    name: str
    fetch_latency_s: float  # a call's wait for its synchronous fetches, beyond their transfer
    fetch_bandwidth: float  # bytes per second through the slow tier's link
    expert_run_s: float  # one expert over one batch of tokens
    dense_s: float  # everything but routed experts, per token
    overlap: bool  # admission and prefetch transfers hide behind compute
    expert_bytes: int
    layers: int
    top_k: int
    source: str = ""
    admission_s: float = 0.0  # what an admission costs the critical path even when it overlaps
    decision_s: float = 0.0  # one MoE call with a substitution (the policy's own work)
    calibration: tuple = ()  # measured runs behind a fitted profile: config, ms/token, counts/token, fit

    @property
    def transfer_s(self) -> float:
        """One expert's transfer through the slow tier's link, without latency."""
        return self.expert_bytes / self.fetch_bandwidth

    @property
    def fetch_s(self) -> float:
        """One fetch alone: latency and transfer."""
        return self.fetch_latency_s + self.transfer_s

    def terms(self, s: RunStats) -> dict[str, float]:
        """Seconds per token by term."""
        per_token = lambda n: n / s.moe_calls * self.layers  # noqa: E731
        return {"dense": self.dense_s,
                "experts": per_token(s.expert_runs) * self.expert_run_s,
                "fetch waits": per_token(s.fetch_waits) * self.fetch_latency_s,
                "fetches": per_token(s.sync_fetches) * self.transfer_s,
                "background": 0.0 if self.overlap else
                per_token(s.background_fetches + s.prefetch_fetches) * self.transfer_s,
                "admissions": per_token(s.background_fetches) * self.admission_s,
                "decisions": per_token(s.substituted_calls) * self.decision_s}

    def ms_per_token(self, s: RunStats) -> float:
        """Estimated milliseconds per token for a run's counters."""
        return 1000 * sum(self.terms(s).values())

    def save(self, path: Path) -> None:
        """Write the profile as JSON."""
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "HardwareProfile":
        """Read a profile written by `save`."""
        return cls(**json.loads(Path(path).read_text()))


def _datasheet(name, pcie_gbs, mem_gbs, expert_bytes, dense_bytes, layers, top_k, source):
    # Decode is bandwidth-bound: an expert run is reading its weights from VRAM.
    return HardwareProfile(name, fetch_latency_s=10e-6, fetch_bandwidth=pcie_gbs * 1e9,
                           expert_run_s=expert_bytes / (mem_gbs * 1e9), dense_s=dense_bytes / (mem_gbs * 1e9),
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
    """A datasheet profile by name, or a profile file from `expertcache calibrate-hw`."""
    if name_or_path in DATASHEET:
        return DATASHEET[name_or_path]
    from ..errors import UnknownName
    if not Path(name_or_path).exists():
        raise UnknownName(f"unknown hardware profile {name_or_path!r}; give a file from `expertcache calibrate-hw` "
                          f"or one of {', '.join(DATASHEET)}")
    return HardwareProfile.load(Path(name_or_path))


# calibration runs: (cache fraction, policy); together they vary every term of the model
CALIBRATION = ((1.0, "fetch-all"), (0.125, "fetch-all"), (0.25, "fetch-all"), (0.5, "fetch-all"),
               (0.25, "threshold:tau=0.15"), (0.5, "threshold:tau=0.15"), (0.25, "first-choice"),
               (0.25, "first-choice:beta=0.3"), (0.25, "quality-first"), (0.25, "substitute-all"))
TERMS = ("dense", "expert_runs", "fetch_waits", "sync_fetches", "background_fetches", "substituted_calls")


def fit_terms(counts: np.ndarray, seconds: np.ndarray, names: tuple[str, ...]) -> dict[str, float]:
    """Least squares of the relative error, seconds ~ counts @ cost, with every cost >= 0:
    the term whose cost comes out most negative is dropped (cost 0) and the rest refitted."""
    keep = list(range(len(names)))
    scaled = counts / seconds[:, None]
    while True:
        cost, *_ = np.linalg.lstsq(scaled[:, keep], np.ones(len(seconds)), rcond=None)
        if (cost >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(cost)))
    fitted = dict.fromkeys(names, 0.0)
    fitted.update({names[i]: max(0.0, float(c)) for i, c in zip(keep, cost)})
    return fitted


def measure_profile(model: Path | None, store: str = "disk", mode: str = "decode", repeats: int = 5,
                    reads: int = 200, device: str = "cpu", store_dir: Path | None = None) -> HardwareProfile:
    """Measure a profile on this machine with the engine itself. `mode`: decode (one token per
    forward) or forced (windows of 256 tokens). Every CALIBRATION run is timed `repeats`
    times, interleaved round-robin after a warm-up (so drift hits all alike), and its counts
    per token recorded; a non-negative least-squares fit of the relative error gives the cost
    of each term. In decode every token runs k experts per layer, so expert runs are part of
    `dense` there. The raw O_DIRECT read time is reported in `source`."""
    import statistics
    import time

    import torch

    from ..engine.cache import CacheConfig
    from ..engine.engine import Engine, EngineConfig
    from ..engine.perplexity import EVAL_TEXT, teacher_forced

    engines = [Engine(model, EngineConfig(device=device, store=store, cache=CacheConfig(fraction=f), policy=p,
                                                 store_dir=store_dir))
               for f, p in CALIBRATION]
    ids = engines[0].encode(EVAL_TEXT.read_text(encoding="utf-8")[:20000])
    fields = ("moe_calls",) + TERMS[1:]

    def run(eng: Engine) -> tuple[float, np.ndarray]:
        eng.reset()
        s = eng.stats
        if mode == "decode":
            eng.forward(torch.tensor(ids[:32]), 0)
            before, t = [getattr(s, f) for f in fields], time.perf_counter()
            for pos in range(32, 96):
                eng.forward(torch.tensor(ids[pos:pos + 1]), pos)
        else:
            before, t = [0] * len(fields), time.perf_counter()
            for _ in teacher_forced(lambda x: eng.forward(x, 0), ids[:1025], 256):
                pass
        elapsed = time.perf_counter() - t
        calls, *counts = (getattr(s, f) - b for f, b in zip(fields, before))
        tokens = calls / eng.args.num_moe_layers
        return elapsed / tokens, np.array([1.0, *counts]) / np.array([1.0] + [tokens] * len(counts))

    samples = [[] for _ in engines]
    for rep in range(repeats + 1):  # repetition 0 warms up
        for i, eng in enumerate(engines):
            t, counts = run(eng)
            if rep:
                samples[i].append((t, counts))
    seconds = np.array([statistics.median(t for t, _ in runs) for runs in samples])
    counts = np.array([np.median([c for _, c in runs], axis=0) for runs in samples])
    a, st = engines[0].args, engines[0].store
    rng = np.random.default_rng(0)
    w13, w2 = torch.empty(st.shape.w13), torch.empty(st.shape.w2)
    read_s = []
    for _ in range(reads):
        start = time.perf_counter()
        st.read_into(int(rng.integers(a.num_moe_layers)), int(rng.integers(a.num_experts)), w13, w2)
        read_s.append(time.perf_counter() - start)
    for eng in engines:
        eng.close()
    terms = TERMS if mode == "forced" else tuple(t for t in TERMS if t != "expert_runs")
    cost = fit_terms(counts[:, [TERMS.index(t) for t in terms]], seconds, terms)
    fitted = counts @ np.array([cost.get(t, 0.0) for t in TERMS])
    calibration = tuple({"cache": f, "policy": p, "ms_per_token": 1000 * t, "fitted_ms_per_token": 1000 * e,
                         "per_token": dict(zip(TERMS[1:], c[1:].tolist()))}
                        for (f, p), t, e, c in zip(CALIBRATION, seconds, fitted, counts))
    # The slow tier's transfer per fetch is fitted as a time: bandwidth = bytes / that time.
    transfer = cost["sync_fetches"]
    return HardwareProfile(f"this-machine-{store}-{mode}", fetch_latency_s=cost["fetch_waits"],
                           fetch_bandwidth=st.expert_bytes / transfer if transfer else float("inf"),
                           expert_run_s=cost.get("expert_runs", 0.0), dense_s=cost["dense"], overlap=True,
                           expert_bytes=st.expert_bytes, layers=a.num_moe_layers, top_k=a.top_k,
                           source=f"measured by calibrate-hw ({store} store, {mode}); one O_DIRECT read alone: "
                                  f"{1e6 * statistics.median(read_s):.0f} us",
                           admission_s=cost["background_fetches"], decision_s=cost["substituted_calls"],
                           calibration=calibration)
