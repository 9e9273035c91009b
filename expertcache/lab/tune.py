"""Tune: the fastest miss policy within a perplexity budget, for one model, cache size and
machine.

1. Trace the calibration text once (router logits of the exact model).
2. Replay every candidate of the search space on the trace (the decision kernel on a virtual
   cache, decode order by default) and estimate its ms/token with a hardware profile. In decode,
   replay the frontier's policies again with each predictor's prefetch, on the routes each
   predictor forecasts over the calibration text (recorded as decode computes them), a
   prediction priced by its predictor's cost measured in place. A window prefetches nothing, so
   a prefetching candidate's perplexity below is its policy's.
3. Take the Pareto frontier of (estimated ms/token, substituted gate mass per call) and score
   its points exactly: teacher-forced perplexity on the calibration text with the exact `ram`
   store and a warm cache, against fetch-every-miss on the same tokens.
   With quantized fast tiers in the search (`slot_dtypes`), each format is replayed on its own slots
   and priced by its own profile, and scored on a `ram` engine emulating it, against the exact model.
4. The winner is the fastest finalist whose perplexity increase is within the budget. Where the
   profile was measured on this machine, it is also timed on the engine against fetch-every-miss and,
   where it prefetches, against the fastest within budget that does not (`timed_choice`): the fastest
   measured wins.
5. Validate it, with the presets for comparison, on held-out text: paired bootstrap CI of the
   increase over windows.
Returns data; the verb prints and plots it.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..engine.cache import CacheConfig
from ..engine.checkpoint import open_checkpoint
from ..engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from ..engine.perplexity import perplexity
from ..engine.stores import ExpertShape
from ..errors import BadInput, NotEnoughMemory
from ..models import model_args
from ..policies import make_policy
from .bench import parse_variant
from .costmodel import HardwareProfile, check_model
from .plots import pareto_front
from .simulator import replay, route_trace
from .study import BASELINE, exact_engine, paired_increase
from .trace import record_trace

TAUS = (0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3)
BETAS = (0.0, 0.5, 1.0)  # background admission (policies that substitute)
EVICTIONS = ("lru", "freq", "demand")
# The search space, one line per policy family. Every spec is tried with each eviction order,
# and with each admission beta when its policy takes one.
RULES = (
    BASELINE,
    *(f"threshold:tau={t:g}" for t in TAUS),  # fetch a first choice or a miss of weight >= tau
    "first-choice",  # fetch only a missed first choice
    *(f"band:lo=0,hi={h:g}" for h in (0.05, 0.1)),  # substitute only light misses, whatever their rank
    *(f"conditional:j={j},m=16" for j in (2, 4, 6)),  # cache-conditional routing
    "substitute-all",
)
# Per-layer tau: a small family, not a free search over layers. tau_l = tau * 2^(tilt * z_l), z_l
# the layer's mean router entropy on the calibration trace as a z-score over layers (the layers'
# entropies differ by a few percent: their ratio would leave tau nearly flat): tilt 1 fetches
# less where the router is flattest (its misses' weights are small anyway), tilt -1 the reverse.
PER_LAYER_TAUS = (0.05, 0.07, 0.1, 0.15)
TILTS = (-1.0, 1.0)
PER_LAYER_BETAS = (0.0, 0.5)
# The low-precision miss option: a light miss fetches its int4 copy (lo=0: never substitutes), or
# three ways, substituting below lo; and with upgrade=1, a heavy hit on a small copy reads the full
# one in the background. No admission: lo=0 substitutes nothing to account.
LOWBIT_RULES = (*(f"lowbit:tau={t:g}" for t in (0.07, 0.1, 0.15, 0.3)),
                *(f"lowbit:tau={t:g},lo={lo:g}" for t, lo in ((0.15, 0.05), (0.3, 0.05), (0.3, 0.1))),
                *(f"lowbit:tau={t:g},upgrade=1" for t in (0.15, 0.3)), "lowbit:tau=0.3,lo=0.05,upgrade=1")
QUANTIZED_SLOTS = ("int8", "int4")  # slot formats that keep encoded blobs (no low-precision copies)
PRESETS = ("quality-first", "speed-first", "threshold:tau=0.15", "first-choice")  # validated beside the winner
# The quick profile measured when none is given: enough runs to separate dense, wait, fetch, low-precision
# fetch, admission and substitution costs.
QUICK_RUNS = ((1.0, BASELINE), (0.125, BASELINE), (0.5, BASELINE), (0.25, "first-choice"), (0.25, "quality-first"),
              (0.5, "threshold:tau=0.1,beta=1"), (0.25, "substitute-all"), (0.25, "lowbit:tau=0.15"))
# ... and, where prefetching is searched, what separates prefetches, exposed prefetches and predictions
# (as calibrate-hw's runs do: a fetch-all run that mostly waits, a substituting one that mostly does not,
# and one that predicts at every layer but prefetches only first choices)
QUICK_PREFETCH_RUNS = ((0.125, f"{BASELINE}+prefetch/quasi-hidden"), (0.25, "threshold:tau=0.15+prefetch/quasi-hidden"),
                       (0.25, "first-choice+prefetch/quasi-hidden:fetched=1"))
# Prefetching (decode only): each frontier point of the first replay, again with each predictor the model
# has, at its top-k, at half of it, only its sure predictions, and for a policy that substitutes, also only
# what it would fetch
PREFETCH_PREDICTORS = ("quasi-hidden", "estimator", "lookahead")
PREDICTION_TOKENS = 48  # decode tokens each predictor's in-place cost is measured over
TIMED_TOKENS, TIMED_REPEATS = 128, 3  # a prefetching winner's timing against its fallback: decode tokens, repeats
SURE = 0.1  # a prediction's gate weight above which it is nearly always right (benchmarks/RESULTS.md, "Confidence")


def search_space(rules=RULES, betas=BETAS, evictions=EVICTIONS) -> list[str]:
    """Candidate policy specs: each rule with each eviction order, and each admission beta where it takes one."""
    out = []
    for rule in rules:
        takes_beta = "beta" in make_policy(rule).parameters
        sep = "," if ":" in rule else ":"
        for beta in betas if takes_beta else (None,):
            spec = rule if not beta else f"{rule}{sep}beta={beta:g}"
            sep2 = "," if ":" in spec else ":"
            out += [f"{spec}{sep2}eviction={e}" for e in evictions]
    return list(dict.fromkeys(out))


def layer_entropy(trace, chunk: int = 1024) -> np.ndarray:
    """[L] each MoE layer's mean entropy (nats) of the router's softmax over the trace's tokens."""
    logits = np.asarray(trace.logits)
    total = np.zeros(logits.shape[1])
    for i in range(0, len(logits), chunk):
        x = logits[i:i + chunk].astype(np.float64)
        x -= x.max(-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(-1, keepdims=True)
        total += -(p * np.log(np.maximum(p, 1e-30))).sum(-1).sum(0)
    return total / len(logits)


def per_layer_specs(scale: np.ndarray, taus=PER_LAYER_TAUS, tilts=TILTS, betas=PER_LAYER_BETAS,
                    evictions=EVICTIONS) -> list[str]:
    """Threshold specs with one tau per layer: tau * 2^(tilt * z), z the z-score of `scale` over
    the layers (0 where it is flat), within [0, 1] and to 3 significant digits, each with each
    admission beta and eviction order."""
    scale = np.asarray(scale, float)
    z = (scale - scale.mean()) / scale.std() if scale.std() > 0 else np.zeros_like(scale)
    rules = [f"threshold:tau={'/'.join(f'{v:.3g}' for v in np.clip(t * 2.0 ** (tilt * z), 0, 1))}"
             for t in taus for tilt in tilts]
    return search_space(list(dict.fromkeys(rules)), betas, evictions)


@dataclass(frozen=True)
class TuneConfig:
    """What the search runs: budget, cache, tokens, windows, search space and statistics."""
    budget_pct: float = 1.0  # allowed perplexity increase over fetch-every-miss, percent
    cache: CacheConfig = field(default_factory=CacheConfig)
    calib_tokens: int = 4096
    tokens: int = 8192  # held-out validation tokens
    context: int = 512
    mode: str = "decode"  # replay order for the time estimate: decode (one token at a time) or forced
    finalists: int = 16  # most frontier points scored exactly
    candidates: tuple[str, ...] = ()  # default: search_space(), plus the two below
    per_layer: bool = True  # add per-layer taus (per_layer_specs) to the default candidates
    lowbit: bool = True  # add the low-precision miss option (LOWBIT_RULES) to the default candidates
    lowbit_finalists: int = 4  # most lowbit frontier points scored exactly, beyond `finalists`
    presets: tuple[str, ...] = PRESETS
    bootstrap: int = 2000
    seed: int = 0
    # fast-tier formats searched besides auto's (the exact reference): quantized slots hold more experts
    # in the bytes of a `--cache-bytes` cache; their own quantization error counts against the budget
    slot_dtypes: tuple[str, ...] = ("auto",)
    slot_finalists: int = 8  # most frontier points of each quantized slot format scored exactly
    prefetch: tuple[str, ...] = PREFETCH_PREDICTORS  # predictors searched in decode (where the model has them)


@dataclass
class TuneResult:
    """The whole search: every candidate's replay, the finalists' exact scores, the winner and its validation."""
    config: dict
    profile: dict
    candidates: list[dict]
    finalists: dict  # spec -> {pct, ci, ppl} on calibration text
    winner: str | None
    validation: dict  # spec -> {pct, ci, ppl, estimated_ms, estimated_speedup} on held-out text
    baseline_ms: float  # fetch-every-miss, estimated
    timed: dict = field(default_factory=dict)  # the winner timed against fetch-all and its fallback (`timed_choice`)

    def to_dict(self) -> dict:
        """The search as JSON-ready values."""
        return self.__dict__.copy()


def label(spec: str, slots: str = "auto") -> str:
    """How a candidate is named in the results: its spec, and the slot format unless it is auto's."""
    return spec if slots == "auto" else f"{spec} @{slots}"


def unlabel(name: str) -> tuple[str, str]:
    """(spec, slot format) of a candidate's `label`."""
    spec, _, slots = name.partition(" @")
    return spec, slots or "auto"


def without_prefetch(name: str) -> str:
    """A candidate's label without its '+prefetch/...': a window prefetches nothing, so a prefetching
    candidate scores as its policy does, scored once."""
    spec, slots = unlabel(name)
    return label(parse_variant(spec)[0], slots)


def slot_store_format(slots: str):
    """The slow-tier format a slot format needs: quantized slots keep the blobs of a store of their own
    format (`convert --dtype` of the same name); None for float slots (the checkpoint's)."""
    from ..engine.quant import ExpertFormat
    return ExpertFormat.parse(slots) if slots in QUANTIZED_SLOTS else None


def priced(profile: HardwareProfile, spec: str, prediction_s: dict[str, float]) -> HardwareProfile:
    """The profile that prices `spec`: with '+prefetch/PREDICTOR', a prediction's compute is what
    `prediction_costs` measured for that predictor, in place of the profile's (its calibration runs'
    predictors'); the rest of a prediction's cost is the profile's."""
    pre = parse_variant(spec)[1]
    if pre is None or not prediction_s:
        return profile
    compute = prediction_s[pre.predictor]
    return replace(profile, prediction_s=max(profile.prediction_s - profile.prediction_compute_s, 0.0) + compute)


def replay_candidates(trace, specs: list[str], cache: CacheConfig, counts, profile: HardwareProfile,
                      window: int | None, progress: Callable[[str], None] | None = None,
                      engine: Engine | None = None, predictions: dict | None = None,
                      prediction_s: dict[str, float] | None = None) -> list[dict]:
    """Each spec replayed on `trace` with its estimated ms/token and substituted mass; `engine`: the
    slots (format, and so their number in a cache of bytes) and fetch bytes the replay takes from it;
    `predictions`, `prediction_s`: the prefetching specs' predicted routes over the trace and their
    predictors' costs (`priced`)."""
    routes = route_trace(trace)
    slots = engine.config.slot_dtype if engine is not None else "auto"
    sized = {} if engine is None else {"slot_format": engine.slot_format,
                                       "fetch_dtype_bytes": engine.store.dtype.itemsize}
    rows = []
    for spec in specs:
        s = replay(trace, spec, cache, None, counts, routes=routes, window=window, predictions=predictions,
                   **sized).stats
        rows.append({"spec": spec, "slots": slots, "label": label(spec, slots),
                     "estimated_ms": priced(profile, spec, prediction_s or {}).ms_per_token(s),
                     "mass_per_call": s.mass_per_call,
                     "fetches_per_token": s.fetches_per_token, "hit_rate": s.hit_rate,
                     "admissions_per_token": s.background_fetches / s.tokens,
                     "lowbit_per_token": s.lowbit_fetches / s.tokens,
                     "inexact_per_call": (s.substitutions + s.lowbit_uses) / s.moe_calls,
                     "prefetches_per_token": s.prefetch_fetches / s.tokens})
        if progress:
            progress(spec)
    return rows


def pick_finalists(rows: list[dict], n: int, n_lowbit: int = 0, n_slots: int = 0) -> list[str]:
    """The labels of the Pareto frontier of (estimated ms, mass per call), thinned evenly to at most `n`;
    lowbit specs apart (their error is in low-precision runs, not substituted mass): the frontier
    of (estimated ms, inexact experts per call), at most `n_lowbit` of it; each quantized slot
    format apart too (its error is in every expert), at most `n_slots` of its frontier."""
    def front(key: str, group: list[dict], most: int) -> list[str]:
        f = pareto_front({r["label"]: (r["estimated_ms"], r[key]) for r in group}) if group and most else []
        if len(f) > most:
            f = [f[i] for i in np.unique(np.linspace(0, len(f) - 1, most).round().astype(int))]
        return f
    plain = [r for r in rows if r.get("slots", "auto") == "auto"]
    small = lambda r: make_policy(parse_variant(r["spec"])[0]).fetches_small  # noqa: E731 (prefetch aside)
    lowbit = [r for r in plain if small(r)]
    rest = [r for r in plain if not small(r)]
    out = front("mass_per_call", rest, n) + front("inexact_per_call", lowbit, n_lowbit)
    for slots in dict.fromkeys(r["slots"] for r in rows if r.get("slots", "auto") != "auto"):
        out += front("mass_per_call", [r for r in rows if r["slots"] == slots], n_slots)
    return out


def score(engines: dict[str, Engine], labels, ids: list[int], context: int, cfg: TuneConfig,
          progress: Callable[..., None] | None = None, phase: str = "score", left_out: dict | None = None) -> dict:
    """Exact perplexity of each labelled candidate over `ids` (on the engine of its slot format) with the
    increase over fetch-every-miss on auto's slots, the exact model (paired bootstrap CI). `progress(phase, 0,
    total)` once, with the tokens it scores in all, then `progress(candidate, tokens)` as they are scored. A
    candidate whose policy does not fit in memory is not scored: it goes into `left_out`, with why."""
    left_out = {} if left_out is None else left_out
    results = {}
    names = list(dict.fromkeys([BASELINE, *labels]))
    policies = list(dict.fromkeys(map(without_prefetch, names)))
    if progress:
        progress(phase, 0, len(policies) * (len(ids) - 1))

    def increases() -> dict:
        base = results[BASELINE]
        increase = {name: {"ppl": r.ppl, **paired_increase(base.window_nll, r.window_nll, cfg.bootstrap, cfg.seed)}
                    for name, r in results.items()}
        return {name: increase[without_prefetch(name)] for name in names if without_prefetch(name) in increase}
    try:
        for name in policies:
            spec, slots = unlabel(name)
            engine = engines[slots]
            try:
                engine.set_policy(spec)
            except NotEnoughMemory as e:  # a lowbit policy's small copies, held beside the ram store's experts
                if name == BASELINE:
                    raise
                left_out[name] = str(e)
                if progress:
                    progress(name, len(ids) - 1)
                continue
            results[name] = perplexity(engine, ids, context,
                                       progress=(lambda n, s=name: progress(s, n)) if progress else None)
    except KeyboardInterrupt as e:  # Ctrl-C: the candidates scored whole go with it (`tune` reports them)
        e.scored = increases() if BASELINE in results else {}
        raise
    return increases()


def default_candidates(trace, cfg: TuneConfig, slots: str = "auto") -> list[str]:
    """search_space(), with per-layer taus scaled by the trace's router entropy and the lowbit
    rules where `cfg` asks for them (float slots only: quantized ones cannot take small copies)."""
    specs = search_space()
    if cfg.per_layer and trace.header["num_layers"] > 1:
        specs += per_layer_specs(layer_entropy(trace))
    if cfg.lowbit and slots not in QUANTIZED_SLOTS:
        specs += search_space(LOWBIT_RULES, (0.0,))
    return fitting(specs, trace)


def fitting(specs: list[str], trace) -> list[str]:
    """The specs a model of the trace's shape can take: conditional routing's window m within its experts,
    and no rule whose parameters its top-k rules out (j > top-k)."""
    h = trace.header
    k, E = h["top_k"], h["num_experts"]
    out = []
    for spec in dict.fromkeys(s.replace("m=16", f"m={min(16, E)}") for s in specs):
        try:
            make_policy(spec).fit(k, E, bool(h["norm_topk_prob"]))
        except BadInput:
            continue
        out.append(spec)
    return out


def prefetch_variants(spec: str, predictors, top_k: int) -> list[str]:
    """`spec` with each predictor's prefetch: its top-k, half of it, only the sure predictions, and where the
    policy substitutes, only what it would fetch."""
    budgets = [f":budget={top_k // 2}"] if top_k > 1 else []
    fetched = [":fetched=1"] if make_policy(spec).name != BASELINE else []
    options = ("", *budgets, f":confidence={SURE:g}", *fetched)
    return [f"{spec}+prefetch/{p}{option}" for p in predictors for option in options]


def usable_predictors(engine: Engine, names) -> dict[str, str]:
    """Each of `names` with '' where the model has what it needs (default vectors, nets), else why not
    (CheckpointError's one line)."""
    from ..engine.predictors import make_predictor
    from ..errors import CheckpointError
    out = {}
    for name in names:
        try:
            make_predictor(name, engine.model, engine.path)
            out[name] = ""
        except (CheckpointError, FileNotFoundError) as e:
            out[name] = str(e)
    return out


def prediction_costs(engine: Engine, predictors, ids: list[int], tokens: int = PREDICTION_TOKENS,
                     prompt: int = 16) -> dict[str, float]:
    """Seconds per prediction of each predictor in place: `engine` decodes `tokens` of `ids` one at a time after a
    `prompt` under fetch-every-miss with its prefetch, twice (the first warms up), and the second's predict time
    (RunStats.predict_s) is divided by its predictions. The engine is left without a prefetch."""
    import torch

    from ..engine.moe import PrefetchConfig
    x = torch.tensor(ids[:prompt + tokens])
    out = {}
    try:
        engine.set_policy(BASELINE)
        for name in predictors:
            engine.set_prefetch(PrefetchConfig(name))
            for _ in range(2):
                engine.reset()
                engine.forward(x[:prompt], 0)
                before = (engine.stats.predict_s, engine.stats.predictions)
                for pos in range(prompt, len(x)):
                    engine.forward(x[pos:pos + 1], pos)
            out[name] = (engine.stats.predict_s - before[0]) / max(engine.stats.predictions - before[1], 1)
    finally:
        engine.set_prefetch(None)
    return out


def slot_engine(model: Path | None, cfg: TuneConfig, slots: str) -> Engine:
    """The exact `ram` engine of one slot format, emulating the store it reads (`slot_store_format`); where the
    experts do not fit in memory, the `disk` store of that format, whose reads give the same weights."""
    return exact_engine(model, EngineConfig(store="ram", cache=cfg.cache, initial="auto", slot_dtype=slots,
                                            store_format=slot_store_format(slots),
                                            max_seq=max(EngineConfig.max_seq, cfg.context)))


def tune_ids(model: Path | None, calib_text: str, eval_text: str, cfg: TuneConfig) -> tuple[list[int], list[int]]:
    """The calibration and held-out tokens the search uses; BadInput when either text is shorter than two
    windows (checked before anything is measured)."""
    from .calibrate import encode_text
    path = model or BUILTIN_MODEL
    calib = encode_text(path, calib_text, cfg.calib_tokens + 1)
    held = encode_text(path, eval_text, cfg.tokens + 1)
    for name, ids, want in (("calibration", calib, cfg.calib_tokens), ("held-out", held, cfg.tokens)):
        if len(ids) < 2 * cfg.context + 1:
            raise BadInput(f"the {name} text gives {max(len(ids) - 1, 0)} tokens to predict, fewer than two windows "
                           f"of {cfg.context}; give a longer text or a smaller --context (asked for {want})")
    shared = min(len(calib), len(held))
    if calib[:shared] == held[:shared]:  # the same text (or one the start of the other): nothing held out
        raise BadInput("the held-out text begins with the calibration text's tokens (the same file?): the winner "
                       "would be validated on what it was tuned on; give another --text or --calib-text")
    return calib, held


def check_cache_size(model: Path | None, cfg: TuneConfig) -> None:
    """CacheTooSmall, before anything is measured, where `cfg`'s cache holds fewer than a token's experts a layer in
    one of the slot formats searched (a cache in bytes holds fewer float slots than quantized ones): the engines
    made after the quick profile found it minutes into a run at real size."""
    import torch

    from ..engine.cache import slots_per_layer
    from ..engine.quant import ExpertFormat
    from ..engine.slots import slot_bytes, slot_format
    from ..engine.weights import expert_dtype
    ckpt = open_checkpoint(model or BUILTIN_MODEL)
    args = model_args(ckpt.config)
    shape, stored = ExpertShape.of(args), ExpertFormat.of_dtype(expert_dtype(ckpt, args))
    for slots in cfg.slot_dtypes:
        fmt = slot_format(slots, torch.device("cpu"), slot_store_format(slots) or stored)
        slots_per_layer(cfg.cache, shape, slot_bytes(shape, fmt), args.top_k, quota_hint=False)  # tune has none


def check_profile_for(profile: HardwareProfile, slots: str, engine: Engine, mode: str) -> None:
    """BadInput when `profile` records that its runs had other slots than `engine` has for --slot-dtype `slots`
    (their format: auto's is the checkpoint's), or timed another mode than `mode` (a profile without the record, a
    datasheet's or an older one's, is taken)."""
    held = engine.slot_format.dtype
    for what, recorded, given in (("slots", profile.slot_dtype, held), ("mode", profile.mode, mode)):
        if recorded and recorded != given:
            raise BadInput(f"the hardware profile given for --slot-dtype {slots} ({held} slots), --mode {mode} was "
                           f"measured with {recorded} {what}: give the --profile files in the order auto, then "
                           f"--slot-dtypes, each measured by `expertcache calibrate-hw --mode {mode} --out FILE` "
                           "(for int8 or int4 slots S, with --slot-dtype S --store-dtype S)")


def tune(model: Path | None, ids: tuple[list[int], list[int]], profile: HardwareProfile | dict[str, HardwareProfile],
         cfg: TuneConfig, progress: Callable[..., None] | None = None,
         timer: Callable[[list[str]], dict[str, float]] | None = None) -> TuneResult:
    """Search the policy space for the fastest policy within `cfg.budget_pct` (see the module's steps); ids: the
    calibration and held-out tokens, as `tune_ids` gives them; `profile`: the cost model, or one per slot format
    of `cfg.slot_dtypes`. `progress(phase, 0, total)` starts each phase (trace, replay, score, validate) with its
    steps in all, `progress(label, steps)` reports steps done. `timer(labels)`: ms/token of each labelled
    candidate on this machine, as the profile was measured; given, the winner must also be faster there than
    fetch-every-miss, and one that prefetches than its fallback (`timed_choice`). A KeyboardInterrupt from the
    finalists' scoring on carries `result`, the TuneResult of what was done (`config["interrupted"]`: score, time
    or validate)."""
    calib, held = ids
    searched = list(dict.fromkeys(("auto", *cfg.slot_dtypes)))  # auto's slots: the exact reference, always
    profiles = profile if isinstance(profile, dict) else {s: profile for s in searched}
    missing = [s for s in searched if s not in profiles]
    if missing:
        raise BadInput(f"no cost profile for slots {', '.join(missing)}; give one profile per slot format")
    args = model_args(open_checkpoint(model or BUILTIN_MODEL).config)
    for p in profiles.values():  # before any engine loads: a profile measured on another model is refused
        check_model(p, args.num_moe_layers, args.top_k, ExpertShape.of(args).numel,
                    f"model {model or BUILTIN_MODEL}")
    engines: dict[str, Engine] = {}
    skipped: dict[str, str] = {}  # predictors left out of the search, and why
    left_out: dict[str, str] = {}  # finalists not scored, as their policy does not fit in memory, and why
    note = (lambda label, n=0, total=None: progress(label, n, total)) if progress else None
    rows, scored, winner, timed, checked = [], {}, None, {}, {}

    def result(interrupted: str | None = None) -> TuneResult:
        base_ms = est[BASELINE]
        validation = {s: {**v, "estimated_ms": est.get(s), "estimated_speedup": base_ms / est[s] if s in est else None,
                          "within_budget": v["pct"] <= cfg.budget_pct} for s, v in checked.items()}
        config = {**cfg.__dict__, "cache": cfg.cache.__dict__, "candidates": [r["label"] for r in rows],
                  "calib_tokens_used": len(calib) - 1, "tokens_used": len(held) - 1, "prefetch_skipped": skipped,
                  "not_scored": left_out, "store": {s: e.config.store for s, e in engines.items()}}
        if interrupted:
            config["interrupted"] = interrupted
        profile_out = {s: profiles[s].__dict__ for s in searched} if len(searched) > 1 else profiles["auto"].__dict__
        return TuneResult(config, profile_out, rows, scored, winner, validation, base_ms, timed)
    phase = "trace"
    try:
        for slots in searched:
            engines[slots] = slot_engine(model, cfg, slots)
            if isinstance(profile, dict):  # one of other slots or mode than it is given for (the files in another
                check_profile_for(profiles[slots], slots, engines[slots], cfg.mode)  # order) priced them silently
        if note:
            note("trace", 0, 1)
        with tempfile.TemporaryDirectory() as d:
            trace = record_trace(engines["auto"].path, calib, Path(d) / "calib.ectrace", cfg.context, "float32")
            window = 1 if cfg.mode == "decode" else None
            specs = {}
            for slots in searched:
                specs[slots] = list(dict.fromkeys([BASELINE, *(cfg.candidates or default_candidates(trace, cfg, slots)),
                                                   *(cfg.presets if slots == "auto" else ())]))
                if slots in QUANTIZED_SLOTS:
                    specs[slots] = [s for s in specs[slots] if not make_policy(s).fetches_small]
            if note:
                note("replay", 0, sum(map(len, specs.values())))
            for slots in searched:
                rows += replay_candidates(trace, specs[slots], cfg.cache, engines["auto"].routing_counts,
                                          profiles[slots], window, (lambda s: note("replay", 1)) if note else None,
                                          engines[slots])
            if cfg.mode == "decode" and cfg.prefetch:
                rows += replay_prefetching(trace, rows, engines, profiles, calib, cfg, skipped, note)
        est = {r["label"]: r["estimated_ms"] for r in rows}
        finalists = pick_finalists(rows, cfg.finalists, cfg.lowbit_finalists, cfg.slot_finalists)
        phase = "score"
        scored = score(engines, finalists, calib, cfg.context, cfg, progress, left_out=left_out)
        finalists = [s for s in finalists if s in scored]
        within = [s for s in finalists if scored[s]["pct"] <= cfg.budget_pct]
        winner = min(within, key=lambda s: est[s]) if within else None
        phase = "time"
        timed = timed_choice(winner, within, est, timer) if winner and timer else {}
        winner = timed.get("winner", winner)
        if winner and winner not in scored:  # its own policy, which scores as the prefetching winner did
            scored[winner] = scored[timed["estimated"]]
        phase = "validate"
        checked = score(engines, [s for s in [winner, *cfg.presets] if s], held, cfg.context, cfg, progress,
                        "validate", left_out)
    except KeyboardInterrupt as e:
        # Ctrl-C once the finalists are being scored: what was scored whole goes with it (the verb reports it); the
        # winner is kept only once chosen over every finalist, and is then not validated or only in part
        if phase in ("score", "time", "validate"):
            if phase == "score":
                scored = getattr(e, "scored", {})
            elif phase == "validate":
                checked = getattr(e, "scored", {})
            if phase != "score" or BASELINE in scored:
                e.result = result(phase)
        raise
    finally:
        for engine in engines.values():
            engine.close()
    return result()


def timed_choice(winner: str, within: list[str], est: dict[str, float],
                 timer: Callable[[list[str]], dict[str, float]]) -> dict:
    """The winner timed by `timer` on this machine against fetch-every-miss, which measures the speed-up the estimate
    claims, and, where it prefetches, against its fallback: the fastest by estimate of its own policy (which scores
    as it does) and the finalists within budget that do not prefetch, on its slots. The cost model prices runs from
    few calibration runs (on a busy machine unevenly: it put a winner at 2.5 ms/token that took 8) and has put
    prefetching winners ahead of policies that decode faster without them (benchmarks/RESULTS.md, "The bound by
    cache size"): the fastest measured of these, each within budget, is kept. {} where the winner is
    fetch-every-miss; else {"estimated": winner, "fallback": its fallback or None, "measured_ms": {label:
    ms/token}, "winner": the fastest measured, "speedup": fetch-every-miss's time over the winner's}."""
    if winner == BASELINE:
        return {}
    spec, slots = unlabel(winner)
    fallback = None
    if parse_variant(spec)[1] is not None:
        alone = [s for s in within if unlabel(s)[1] == slots and parse_variant(unlabel(s)[0])[1] is None]
        fallback = min([without_prefetch(winner), *alone], key=lambda s: est[s])
    # one timer call runs one slot format: fetch-every-miss on auto's slots beside the others where they share them
    labels = list(dict.fromkeys([winner, *([fallback] if fallback else []), *([BASELINE] if slots == "auto" else [])]))
    measured = timer(labels)
    if BASELINE not in measured:
        measured |= timer([BASELINE])
    best = min(measured, key=measured.get)
    return {"estimated": winner, "fallback": fallback, "measured_ms": measured, "winner": best,
            "speedup": measured[BASELINE] / measured[best]}


def replay_prefetching(trace, rows: list[dict], engines: dict[str, Engine], profiles: dict[str, HardwareProfile],
                       calib: list[int], cfg: TuneConfig, skipped: dict[str, str], note=None) -> list[dict]:
    """The prefetching candidates: each frontier point of `rows` (as pick_finalists draws them) with each of
    `cfg.prefetch`'s predictors that the model has (`prefetch_variants`), replayed in decode order on the
    predicted routes over the calibration tokens, a prediction priced by its predictor's cost in place
    (`prediction_costs`, `priced`). Predictors the model lacks go into `skipped`, with why."""
    from .prediction import prediction_routes
    auto = engines["auto"]
    have = usable_predictors(auto, cfg.prefetch)
    skipped.update({n: why for n, why in have.items() if why})
    predictors = [n for n in cfg.prefetch if not have[n]]
    if not predictors:
        return []
    bases = [unlabel(n) for n in pick_finalists(rows, cfg.finalists, cfg.lowbit_finalists, cfg.slot_finalists)]
    bases = list(dict.fromkeys([(BASELINE, "auto"), *bases]))
    if note:
        note("predict", 0, 1)
    predictions = prediction_routes(auto.path, calib, predictors, cfg.context)
    costs = prediction_costs(auto, predictors, calib)
    k = trace.header["top_k"]
    variants = {slots: [v for spec, s in bases if s == slots for v in prefetch_variants(spec, predictors, k)]
                for slots in dict.fromkeys(s for _, s in bases)}
    if note:
        note("replay prefetch", 0, sum(map(len, variants.values())))
    out = []
    for slots, specs in variants.items():
        out += replay_candidates(trace, specs, cfg.cache, auto.routing_counts, profiles[slots], 1,
                                 (lambda s: note("replay prefetch", 1)) if note else None, engines[slots],
                                 predictions, costs)
    for r in out:
        r["prediction_s"] = costs[parse_variant(r["spec"])[1].predictor]
    return out
