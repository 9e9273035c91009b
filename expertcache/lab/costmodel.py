"""Hardware cost models: estimated time per token from a replay's counts.

time/token = dense + (expert runs/token) * expert_run + (flushed entries/token) * flushed
             + (calls that wait for fetches/token) * fetch_latency
             + (synchronous fetches/token) * bytes / bandwidth
             + (low-precision fetches/token) * lowbit_fetch (their read and decode; bytes / bandwidth
               when not measured)
             + (admissions and prefetches/token) * bytes / bandwidth, unless they overlap compute
             + (admissions/token) * admission + (prefetches/token) * prefetch
             + (exposed prefetches/token) * exposed_prefetch
               (a lowbit policy's upgrades of small copies are admissions: full copies read in the background)
             + (predictions/token) * prediction + (calls with a substitution/token) * decision
A call's synchronous fetches are issued together and waited for once: the latency is paid per
waiting call, the transfer per fetch. An expert run is one expert applied to one batch of
tokens (its weights read once): k per token and layer in decode, fewer per token when a
window's tokens share experts. A flushed entry is one token of a window run through one expert
early, because a later token's fetch is about to overwrite that expert's slot (the engine runs
a few such tokens one at a time, so their cost is per token, not per run). A prediction is a
prefetch predictor's forecast of the next layer's experts for one token: its compute, which the
engine times (a profile takes the calibration runs' mean rather than fitting it), and the routing
and Python around it, fitted. An exposed prefetch is one issued by a call that has no fetch of its
own to wait for: its submission and landing are not hidden behind a wait (on the 2-core machine of
benchmarks/RESULTS.md an exposed one costs 43 us, a hidden one nothing measurable). Counts per
token are counts per MoE call times the profile's layers, so a datasheet profile applies a
trace's per-layer rates to the profiled model's depth. Every count is one the engine (RunStats)
and the replay both keep (the replay's predictions are recorded ones:
lab/prediction.prediction_routes). Profiles are measured on this machine by `expertcache
calibrate-hw` (per store and mode) or written from datasheet figures.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..atomic import write_text
from ..engine.stats import RunStats

if TYPE_CHECKING:
    from ..engine.cache import CacheConfig

DECODE_PROMPT = 32  # tokens a timed decode feeds in one forward before timing the rest one a forward
PROFILE_VERSION = 6  # 1: no lowbit_fetch_s, prefetch_s, prediction_s, unfitted; 2: no exposed_prefetch_s;
# 3: no flushed_s, and expert runs counted a window's every split; 4: no prediction_compute_s (older versions
# load with those terms unmeasured); 5: no slot_dtype, mode (older versions load with them unrecorded)


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
    lowbit_fetch_s: float | None = None  # one low-precision fetch (read and decode); None: its bytes / bandwidth
    prefetch_s: float = 0.0  # what a prefetch costs the critical path even when it overlaps
    prediction_s: float = 0.0  # one token's next-layer prediction: the predictor's compute, routing it, the rest
    prediction_compute_s: float = 0.0  # of which the compute, as the engine timed its calibration runs' predictors
    exposed_prefetch_s: float = 0.0  # a prefetch's cost beyond prefetch_s when no wait of its call hides it
    flushed_s: float = 0.0  # one entry a window runs before its slot changes hands (one token through one expert)
    unfitted: tuple = ()  # terms the calibration runs did not vary (folded into dense or left at 0)
    slot_dtype: str = ""  # the format of its runs' slots (float16, int4, ...); "": not recorded (a datasheet)
    mode: str = ""  # what its runs timed: decode or forced; "": not recorded
    version: int = PROFILE_VERSION

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
        lowbit = per_token(s.lowbit_bytes) / self.fetch_bandwidth if self.lowbit_fetch_s is None \
            else per_token(s.lowbit_fetches) * self.lowbit_fetch_s
        return {"dense": self.dense_s,
                "experts": per_token(s.expert_runs) * self.expert_run_s,
                "flushed entries": per_token(s.flushed) * self.flushed_s,
                "fetch waits": per_token(s.fetch_waits) * self.fetch_latency_s,
                "fetches": per_token(s.sync_fetches) * self.transfer_s,
                "lowbit fetches": lowbit,
                "background": 0.0 if self.overlap else
                per_token(s.background_fetches + s.prefetch_fetches) * self.transfer_s,
                "admissions": per_token(s.background_fetches) * self.admission_s,
                "prefetches": per_token(s.prefetch_fetches) * self.prefetch_s,
                "exposed prefetches": per_token(s.exposed_prefetches) * self.exposed_prefetch_s,
                "predictions": per_token(s.predictions) * self.prediction_s,
                "decisions": per_token(s.substituted_calls) * self.decision_s}

    def ms_per_token(self, s: RunStats) -> float:
        """Estimated milliseconds per token for a run's counters."""
        return 1000 * sum(self.terms(s).values())

    def save(self, path: Path) -> None:
        """Write the profile as JSON, after the check `load` makes (`invalid_field`): a profile that its own
        reader would refuse is refused here with BadInput, and nothing is written."""
        from ..errors import BadInput
        data = asdict(self)
        if (problem := self.invalid_field(data)) is not None:
            raise BadInput(f"not writing {path}: the measured hardware profile has {problem} (the fit found no "
                           "cost for that term: a machine under load, or runs too short); measure again with "
                           "`expertcache calibrate-hw` on a quieter machine or with more --repeats")
        write_text(path, json.dumps(data, indent=1))

    @classmethod
    def invalid_field(cls, data: dict) -> str | None:
        """The first cost term or size of a profile's fields `data` that is not a finite number (> 0 for the
        bandwidth and the sizes, >= 0 otherwise), described; None when all are. What `save` and `load` check."""
        numeric = [f.name for f in fields(cls) if f.type in ("float", "int", "float | None") and f.name != "version"]
        for name in numeric:  # every cost term and size (the version is checked apart)
            v, positive = data.get(name, 0.0), name in ("fetch_bandwidth", "expert_bytes", "layers", "top_k")
            if v is None and name == "lowbit_fetch_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf if positive
                                                                                else 0 <= v < math.inf):
                return f"{name}={v!r}, which must be a finite number {'> 0' if positive else '>= 0'}"
        for name in ("expert_bytes", "layers", "top_k"):  # counts: 6.5 layers priced half a layer more
            if not isinstance(data.get(name), int):
                return f"{name}={data.get(name)!r}, which must be a whole number"
        if not isinstance(data.get("overlap", True), bool):  # "no" read as true: transfers priced as hidden
            return f"overlap={data['overlap']!r}, which must be true or false"
        for name in ("calibration", "unfitted"):
            if not isinstance(data.get(name, ()), (list, tuple)):
                return f"{name}={data[name]!r}, which must be a list"
        for name in ("slot_dtype", "mode"):
            if not isinstance(data.get(name, ""), str):
                return f"{name}={data[name]!r}, which must be a string"
        return None

    @classmethod
    def load(cls, path: Path) -> "HardwareProfile":
        """Read a profile written by `save`, this version or an older one (version 1 was written before
        the version field; an older version's newer terms load as unmeasured); BadInput for anything else."""
        from ..errors import BadInput
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:  # not UTF-8, not JSON, or an integer of thousands of digits
            raise BadInput(f"{path}: not a readable hardware profile ({e}); write one with `expertcache "
                           "calibrate-hw --out FILE`") from None
        if not isinstance(data, dict):
            raise BadInput(f"{path}: not a hardware profile (a JSON object); write one with `expertcache "
                           "calibrate-hw --out FILE`")
        version = data.setdefault("version", 1)
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        unknown = sorted(set(data) - known)
        problem = (f"of version {version!r} (this expertcache reads 1 to {PROFILE_VERSION})"
                   if type(version) is not int or version not in range(1, PROFILE_VERSION + 1)  # true is no 1
                   else f"with unknown fields {unknown}" if unknown
                   else f"without {', '.join(missing)}" if missing else "")
        if problem:
            raise BadInput(f"{path}: hardware profile {problem}; measure it again with `expertcache calibrate-hw "
                           "--out FILE`")
        if (problem := cls.invalid_field(data)) is not None:
            raise BadInput(f"{path}: hardware profile has {problem}; measure it again with `expertcache "
                           "calibrate-hw --out FILE`")
        data["calibration"], data["unfitted"] = tuple(data.get("calibration", ())), tuple(data.get("unfitted", ()))
        return cls(**data)


def _datasheet(name, pcie_gbs, mem_gbs, expert_bytes, dense_bytes, layers, top_k, source):
    # Decode is bandwidth-bound: an expert run is reading its weights from VRAM, as is a flushed entry's.
    run_s = expert_bytes / (mem_gbs * 1e9)
    return HardwareProfile(name, fetch_latency_s=10e-6, fetch_bandwidth=pcie_gbs * 1e9,
                           expert_run_s=run_s, flushed_s=run_s, dense_s=dense_bytes / (mem_gbs * 1e9),
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


def load_profile(name_or_path: str, model: tuple[int, int, int | None, str] | None = None) -> HardwareProfile:
    """A datasheet profile by name, or a profile file from `expertcache calibrate-hw`; with `model` (MoE layers,
    top-k, parameters of an expert or None, what it is), checked to be able to price that model (`check_model`)."""
    if name_or_path in DATASHEET:
        return DATASHEET[name_or_path]
    from ..errors import UnknownName
    if not Path(name_or_path).exists():
        raise UnknownName(f"unknown hardware profile {name_or_path!r}; give a file from `expertcache calibrate-hw` "
                          f"or one of {', '.join(DATASHEET)}")
    if not Path(name_or_path).is_file():  # a FIFO's read waited for a writer forever
        raise UnknownName(f"hardware profile {name_or_path} is not a regular file; give a file from `expertcache "
                          f"calibrate-hw` or one of {', '.join(DATASHEET)}")
    profile = HardwareProfile.load(Path(name_or_path))
    if model is not None:
        check_model(profile, *model, name_or_path)
    return profile


# Bytes a stored expert parameter takes in any store format: int4 with its group scales (0.5-1) up to fp32 (4)
STORED_BYTES_PER_PARAM = (0.45, 4.5)


def check_model(profile: HardwareProfile, layers: int, top_k: int, expert_params: int | None, what: str,
                name: str | None = None) -> None:
    """BadInput when `profile` was measured (it keeps its calibration runs) on a model of other MoE layers, top-k or
    (given `expert_params`) expert size than `what` has: its dense time, expert costs and depth are that model's,
    and the estimates priced another model's routing as if it were that one, silently (a profile of the built-in
    model's 60 KiB experts priced a trace of 9 MiB ones at its reads' speed). A datasheet profile (no runs)
    projects any model's per-layer rates onto the model it describes, by design."""
    if not profile.calibration:
        return
    from ..errors import BadInput
    fix = ("measure one on that model with `expertcache calibrate-hw --model MODEL --out FILE` (or give a datasheet "
           f"profile, {', '.join(DATASHEET)}, to project onto the model it describes)")
    if (profile.layers, profile.top_k) != (layers, top_k):
        raise BadInput(f"hardware profile {name or profile.name} was measured on a model of {profile.layers} MoE "
                       f"layers, top-{profile.top_k}; {what} has {layers}, top-{top_k}: {fix}")
    low, high = STORED_BYTES_PER_PARAM
    page = 4096  # a blob is padded to whole pages: a small expert's bytes a parameter are more than its format's
    if expert_params is not None and not low * expert_params <= profile.expert_bytes < high * expert_params + page:
        raise BadInput(f"hardware profile {name or profile.name} was measured on experts of {profile.expert_bytes:,} "
                       f"bytes; {what}'s have {expert_params:,} parameters, which no store format holds in that "
                       f"size (a model of another expert size): {fix}")


# Calibration runs: (cache fraction, variant). Together they vary every term independently: cache
# size moves fetches and waits with no substitution; substituting rules at two sizes move
# substituting calls against fetches; admission betas and rules move admissions apart from
# substitution; lowbit moves low-precision fetches; two predictors move predictions and prefetches, and
# three prefetch runs from mostly waiting calls (fetch-all at 1/8) to mostly not (the 0.15 rule) move the
# exposed prefetches apart from the rest; a fourth, predicting at every layer but prefetching little (only
# first choices), moves predictions apart from prefetches.
CALIBRATION = ((1.0, "fetch-all"), (0.125, "fetch-all"), (0.25, "fetch-all"), (0.5, "fetch-all"),
               (0.75, "fetch-all"), (0.25, "threshold:tau=0.15"), (0.5, "threshold:tau=0.15"),
               (0.25, "first-choice"), (0.25, "first-choice:beta=0.3"), (0.5, "threshold:tau=0.1,beta=1"),
               (0.25, "substitute-all"), (0.25, "lowbit:tau=0.15"), (0.125, "lowbit:tau=0.3"),
               (0.5, "fetch-all+prefetch/router-ahead"), (0.25, "threshold:tau=0.15+prefetch/quasi-hidden"),
               (0.125, "fetch-all+prefetch/quasi-hidden"), (0.25, "first-choice+prefetch/quasi-hidden:fetched=1"))
# RunStats counters, one cost each; "dense" (1 per token) first
TERMS = ("dense", "expert_runs", "flushed", "fetch_waits", "sync_fetches", "lowbit_fetches", "background_fetches",
         "prefetch_fetches", "exposed_prefetches", "predictions", "substituted_calls")
# the profile field each term's fitted cost goes to (sync_fetches: a time, turned into a bandwidth)
FIELD = {"dense": "dense_s", "expert_runs": "expert_run_s", "flushed": "flushed_s", "fetch_waits": "fetch_latency_s",
         "lowbit_fetches": "lowbit_fetch_s", "background_fetches": "admission_s", "prefetch_fetches": "prefetch_s",
         "exposed_prefetches": "exposed_prefetch_s", "predictions": "prediction_s", "substituted_calls": "decision_s"}


def fit_terms(counts: np.ndarray, seconds: np.ndarray, names: tuple[str, ...]) -> dict[str, float]:
    """Non-negative least squares of the relative error: the costs c >= 0 minimising
    sum_i ((counts_i @ c) / seconds_i - 1)^2 (scipy.optimize.nnls), so that a fast run's
    error weighs as much as a slow one's. counts [runs, terms], seconds [runs]."""
    from scipy.optimize import nnls
    assert counts.shape == (len(seconds), len(names)), (counts.shape, len(seconds), names)
    cost, _ = nnls(counts / seconds[:, None], np.ones(len(seconds)))
    return {n: float(c) for n, c in zip(names, cost)}


def identifiable(counts: np.ndarray, names: tuple[str, ...], spread: float = 0.02) -> tuple[list[str], list[str]]:
    """(terms to fit, terms the runs leave unidentified) of counts [runs, terms] (names[0] the
    constant dense term): a term that never occurs, or varies by less than `spread` of its mean
    across the runs (expert runs in decode: k per token and layer always), cannot be told apart
    from dense; its cost is folded into dense (or stays 0 where it never occurs)."""
    keep, dropped = [names[0]], []
    for j, name in enumerate(names[1:], 1):
        col = counts[:, j]
        varies = col.max() > 0 and (col.max() - col.min()) > spread * max(col.mean(), 1e-12)
        (keep if varies else dropped).append(name)
    return keep, dropped


def difference(after: RunStats, before: RunStats) -> RunStats:
    """The counters of the part of a run between two snapshots (labels such as read_mode: the later one's)."""
    a, b = asdict(after), asdict(before)
    return RunStats(**{k: v - b[k] if isinstance(v, (int, float)) else v for k, v in a.items()})


def term_counts(s: RunStats, layers: int) -> np.ndarray:
    """[len(TERMS)] counts per token (1 for dense) of a run's counters on a model of `layers` MoE layers."""
    tokens = s.moe_calls / layers
    return np.array([1.0, *(getattr(s, t) / tokens for t in TERMS[1:])])


@dataclass
class TimedRun:
    """One (cache fraction, variant) timed on the engine: median seconds per token and the
    counters of the median repetition. variant: a policy spec, optionally '+prefetch/predictor'."""
    cache: float | CacheConfig
    variant: str
    seconds: float
    stats: RunStats
    slots: str = ""  # the engine's slot format (float16, int4, ...)


def time_runs(model: Path | None, runs, ids: list[int], mode: str = "decode", repeats: int = 5,
              store: str = "disk", device: str = "cpu", store_dir: Path | None = None, prompt: int = DECODE_PROMPT,
              context: int = 256, progress: Callable[[str], None] | None = None,
              run_ids: list[list[int]] | None = None, options: dict | None = None,
              fitting: bool = False) -> list[TimedRun]:
    """Time each (cache fraction, variant) of `runs` on the engine over the same tokens (or over
    `run_ids[i]` for run i; a CacheConfig in place of the fraction sizes the cache as it says), repetitions
    interleaved round-robin after a warm-up (so drift hits all alike). decode: `prompt` tokens in one
    forward, then every later token alone (one token per forward), timed; forced: the tokens teacher-forced
    in windows of `context`. `progress(label)` after each run. `options`: more EngineConfig fields for every
    run (read_mode, store_format, slot_dtype, ...), and `io` for its CacheConfig.

    The runs of one cache share an engine, which switches between their variants as `bench` does. The engines
    stay open together where they fit in memory with a tenth of it to spare; else each round opens them one at a
    time (at a real expert size a full cache and a half one do not fit beside each other). A run whose engine
    does not fit even alone raises NotEnoughMemory, or with `fitting` is left out of the list returned (its
    TimedRun names each run)."""
    if mode not in ("decode", "forced"):
        from ..errors import UnknownName
        raise UnknownName(f"unknown mode {mode!r}; choose decode or forced")
    from ..policies import make_policy
    from .bench import parse_variant
    for _, variant in runs:  # a misspelt variant fails here, before any engine is opened or run is timed
        make_policy(parse_variant(variant)[0])
    options = dict(options or {})
    io = options.pop("io", "auto")
    held = []
    try:
        return _time_engines(held, model, runs, ids, mode, repeats, store, device, store_dir, prompt, context,
                             progress, run_ids, options, io, fitting)
    finally:  # every engine still open, also when one fails to open or a run fails
        for eng in held:
            eng.close()


def _time_engines(held, model, runs, ids, mode, repeats, store, device, store_dir, prompt, context, progress,
                  run_ids, options, io, fitting) -> list[TimedRun]:
    """time_runs' body: the engines open at any moment are in `held`, for the caller to close."""
    import time

    import torch

    from ..engine.budget import available_memory
    from ..engine.cache import CacheConfig
    from ..engine.engine import Engine, EngineConfig
    from ..engine.perplexity import teacher_forced
    from ..errors import NotEnoughMemory
    from .bench import parse_variant
    caches = [replace(f, io=io) if isinstance(f, CacheConfig) else CacheConfig(fraction=f, io=io) for f, _ in runs]
    groups: dict[CacheConfig, list[int]] = {}  # each cache's runs, in the order given
    for i, cache in enumerate(caches):
        groups.setdefault(cache, []).append(i)
    labels = [f"{v} @{f'{c.bytes} bytes' if c.bytes else f'{c.fraction:g}'}" for (_, v), c in zip(runs, caches)]

    def open_engine(cache: CacheConfig) -> Engine:
        policy, prefetch = parse_variant(runs[groups[cache][0]][1])
        eng = Engine(model, EngineConfig(device=device, store=store, cache=cache, policy=policy, prefetch=prefetch,
                                         store_dir=store_dir, **options))
        held.append(eng)
        return eng

    def close(eng: Engine) -> None:
        held.remove(eng)
        eng.close()

    def run(eng: Engine, i: int) -> tuple[float, RunStats]:
        policy, prefetch = parse_variant(runs[i][1])
        eng.set_policy(policy)  # each starts a new run: the cache as it starts
        eng.set_prefetch(prefetch)
        ids_i = run_ids[i] if run_ids is not None else ids
        if mode == "decode":
            eng.forward(torch.tensor(ids_i[:prompt]), 0)
            before, t = replace(eng.stats), time.perf_counter()
            for pos in range(prompt, len(ids_i)):
                eng.forward(torch.tensor(ids_i[pos:pos + 1]), pos)
        else:
            before, t = RunStats(), time.perf_counter()
            for _ in teacher_forced(lambda x: eng.forward(x, 0), ids_i, context):
                pass
        elapsed = time.perf_counter() - t
        s = difference(eng.stats, before)
        return elapsed / (s.moe_calls / eng.args.num_moe_layers), s

    kept: dict[CacheConfig, Engine] = {}
    free = available_memory()
    try:
        for cache in groups:
            kept[cache] = open_engine(cache)
        if free is not None and available_memory() < free / 10:  # the runs' predictors and temporaries need room
            raise NotEnoughMemory("the engines together leave too little memory free")
    except NotEnoughMemory:  # not all at once: one at a time, each round
        for eng in kept.values():
            close(eng)
        kept = {}
    samples: dict[int, list] = {i: [] for i in range(len(runs))}
    slots: dict[int, str] = {}
    for rep in range(repeats + 1):  # repetition 0 warms up
        for cache, members in list(groups.items()):
            if cache in kept:
                eng = kept[cache]
            else:
                try:
                    eng = open_engine(cache)
                except NotEnoughMemory:
                    if not fitting or rep or len(groups) == 1:  # the last of them: nothing would be timed
                        raise
                    del groups[cache]  # too large for this machine even alone: left out
                    if progress:  # every step its runs would have taken, so the bar still ends
                        for i in members * (repeats + 1):
                            progress(f"left out {labels[i]}: it does not fit in memory")
                    continue
            for i in members:
                sample = run(eng, i)
                slots[i] = eng.slot_format.dtype
                if rep:
                    samples[i].append(sample)
                if progress:
                    progress(f"{f'rep {rep}' if rep else 'warm-up'} {labels[i]}")
            if cache not in kept:
                close(eng)
                eng = None  # its memory goes before the next one loads
    out = []
    for i, ((fraction, variant), reps) in enumerate(zip(runs, samples.values())):
        if reps:
            reps.sort(key=lambda r: r[0])
            seconds, stats = reps[len(reps) // 2]
            out.append(TimedRun(fraction, variant, seconds, stats, slots[i]))
    return out


def fit_profile(timed: list[TimedRun], store, layers: int, top_k: int, mode: str, label: str = "",
                read_s: float | None = None) -> HardwareProfile:
    """The profile whose costs fit `timed` best: fit_terms over the TERMS the runs identify (see
    `identifiable`; the others are listed in `unfitted`). `store`: the runs' slow tier (its
    expert_bytes); `read_s`: one raw read's time, reported in `source`. The runs' slot format is recorded (with
    `mode`), so that `tune` can refuse a profile given for other slots. The condition number of the
    scaled count matrix goes into `source`: large means the runs barely separate two terms."""
    counts = np.array([term_counts(r.stats, layers) for r in timed])
    seconds = np.array([r.seconds for r in timed])
    # a prediction's compute is timed by the engine itself (RunStats.predict_s): measured, not fitted, and
    # taken off each run's time; the fit prices the rest of a prediction (routing it, the Python around it)
    made = sum(r.stats.predictions for r in timed)
    compute_s = sum(r.stats.predict_s for r in timed) / made if made else 0.0
    rest = seconds - counts[:, TERMS.index("predictions")] * compute_s
    terms, unfitted = identifiable(counts, TERMS)
    cols = [TERMS.index(t) for t in terms]
    cost = fit_terms(counts[:, cols], rest, tuple(terms))
    if made:
        cost["predictions"] = cost.get("predictions", 0.0) + compute_s
    scaled = counts[:, cols] / rest[:, None]
    cond = float(np.linalg.cond(scaled / np.linalg.norm(scaled, axis=0)))
    fitted = counts @ np.array([cost.get(t, 0.0) for t in TERMS])
    calibration = tuple({"cache": r.cache, "policy": r.variant, "ms_per_token": 1000 * r.seconds,
                         "fitted_ms_per_token": 1000 * e, "per_token": dict(zip(TERMS[1:], c[1:].tolist()))}
                        for r, e, c in zip(timed, fitted, counts))
    # The slow tier's transfer per fetch is fitted as a time: bandwidth = bytes / that time.
    transfer = cost.get("sync_fetches", 0.0)
    read = f"; one {store.read_mode} read alone: {1e6 * read_s:.0f} us" if read_s is not None else ""
    costs = {FIELD[t]: cost.get(t, 0.0) for t in FIELD}
    if "lowbit_fetches" not in cost:  # never measured: the bytes over the bandwidth
        costs["lowbit_fetch_s"] = None
    return HardwareProfile(f"this-machine-{label or 'store'}-{mode}", **costs, prediction_compute_s=compute_s,
                           fetch_bandwidth=store.expert_bytes / transfer if transfer else float("inf"),
                           overlap=True, expert_bytes=store.expert_bytes, layers=layers, top_k=top_k,
                           slot_dtype=timed[0].slots if timed else "", mode=mode,
                           source=f"measured by calibrate-hw ({label} store, {mode}, {len(timed)} runs, condition "
                                  f"number {cond:.0f}){read}", calibration=calibration, unfitted=tuple(unfitted))


def calibration_ids(model: Path | None, mode: str, tokens: int | None = None, text: str | None = None) -> list[int]:
    """The tokens calibrate-hw times: the start of `text` (default: the evaluation text), 96 tokens
    in decode (a 32-token prompt, 64 decoded) and 1,025 teacher-forced, unless `tokens` says."""
    from ..engine.engine import BUILTIN_MODEL
    from ..engine.perplexity import EVAL_TEXT
    from .calibrate import encode_text
    tokens = tokens or (DECODE_PROMPT + 64 if mode == "decode" else 1025)
    text = text if text is not None else EVAL_TEXT.read_text(encoding="utf-8")
    ids = encode_text(model or BUILTIN_MODEL, text[:16 * tokens], tokens)  # tokens average ~3.4 characters
    if len(ids) < min(tokens, 40):
        from ..errors import BadInput
        raise BadInput(f"the calibration text gives {len(ids)} tokens, fewer than the {tokens} needed; "
                       "give a longer text")
    return ids


def runs_for_slots(runs, slot_dtype: str) -> list:
    """The (cache fraction, variant) runs that slots of `slot_dtype` can take: quantized slots take no
    low-precision copies, so runs of lowbit policies are left out."""
    from ..policies import make_policy
    from .bench import parse_variant
    if slot_dtype not in ("int8", "int4"):
        return list(runs)
    return [r for r in runs if not make_policy(parse_variant(r[1])[0]).fetches_small]


def runs_within(runs, top_k: int, num_experts: int) -> list:
    """The (cache fraction, variant) runs with each fraction raised to the least that holds top-k experts a
    layer (a model of few experts cannot take the 1/8 cache of one with 128), repeats dropped."""
    least = top_k / num_experts
    return list(dict.fromkeys((max(f, least), v) for f, v in runs))


def measure_profile(model: Path | None, store: str = "disk", mode: str = "decode", repeats: int = 5,
                    reads: int = 200, device: str = "cpu", store_dir: Path | None = None,
                    runs=CALIBRATION, ids: list[int] | None = None,
                    progress: Callable[[str], None] | None = None, options: dict | None = None) -> HardwareProfile:
    """Measure a profile on this machine with the engine itself. `mode`: decode (one token per
    forward) or forced (windows of 256 tokens). Every run of `runs` (cache fraction, variant) is
    timed `repeats` times over `ids` (default: calibration_ids) by `time_runs`, with the store and
    slot `options` it takes (runs of low-precision copies are left out for quantized slots, which
    cannot take them), and a non-negative least-squares fit of the relative error gives the cost of
    each term. The raw read time, in the store's format and read mode, is reported in `source`."""
    import statistics
    import time

    import torch

    from ..engine.checkpoint import open_checkpoint
    from ..engine.engine import BUILTIN_MODEL
    from ..engine.stores import open_store
    from ..models import model_args

    options = options or {}
    ckpt = open_checkpoint(Path(model or BUILTIN_MODEL))
    a = model_args(ckpt.config)
    runs = runs_within(runs_for_slots(runs, options.get("slot_dtype", "auto")), a.top_k, a.num_experts)
    ids = ids if ids is not None else calibration_ids(model, mode)
    timed = time_runs(model, runs, ids, mode, repeats, store, device, store_dir, progress=progress, options=options,
                      fitting=True)
    st = open_store(store, ckpt, a, store_dir, torch.float32, options.get("store_format"),
                    options.get("read_mode", "auto"))
    rng = np.random.default_rng(0)
    slot = [torch.empty(part) for part in st.shape.parts]  # w13, w2 and the biases of families with them
    read_s = []
    for _ in range(reads):
        start = time.perf_counter()
        st.read_into(int(rng.integers(a.num_moe_layers)), int(rng.integers(a.num_experts)), *slot)
        read_s.append(time.perf_counter() - start)
    if hasattr(st, "close"):
        st.close()
    profile = fit_profile(timed, st, a.num_moe_layers, a.top_k, mode, store, statistics.median(read_s))
    done = {(t.cache, t.variant) for t in timed}
    left = [f"{v} @{f:g}" for f, v in runs if (f, v) not in done]
    return replace(profile, source=f"{profile.source}; left out, as they do not fit in this machine's memory: "
                                   f"{', '.join(left)}") if left else profile
