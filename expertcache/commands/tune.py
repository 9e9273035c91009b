"""expertcache tune: the fastest miss policy within a perplexity budget for a model, cache and machine."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..choices import CALIB_TEXT, EVAL_TEXT
from .options import (
    add_json_argument,
    add_model_argument,
    announce_compile,
    byte_size,
    cache_fraction,
    plot_path,
    positive_int,
    write_json,
)

HELP = "search miss policies for the fastest one within a perplexity budget, validated on held-out text"


def budget(text: str) -> float:
    """'1%' or '1' -> 1.0 (percent perplexity increase)."""
    try:
        v = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage; e.g. --budget 1%") from None
    if not 0 <= v < 1000:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: give a percentage from 0 up to (not "
                                         "including) 1000, e.g. --budget 1%")
    return v


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    p.add_argument("--budget", type=budget, default=1.0, help="allowed perplexity increase, e.g. 1%% (default 1%%)")
    p.add_argument("--cache", type=cache_fraction, default=0.25, help="cache size as a fraction of each layer's experts")
    p.add_argument("--cache-bytes", type=byte_size, default=None,
                   help="cache size in bytes, e.g. 32M (overrides --cache)")
    p.add_argument("--profile", nargs="+", default=None,
                   help="cost model: a calibrate-hw file, rtx3090-qwen3-next or a6000-qwen3-30b, one per slot format "
                        "in the order auto, then --slot-dtypes (default: a quick profile of each measured now with "
                        "the disk store, 8 runs, 11 where prefetching is searched, x 1 repetition; the winner is "
                        "then timed against fetch-every-miss, and one that prefetches against the fastest within "
                        "budget that does not: the fastest measured is the policy)")
    p.add_argument("--slot-dtypes", nargs="+", default=[], choices=["int8", "int4"],
                   help="also search fast tiers of these quantized slots (their `convert --dtype` store emulated); "
                        "with --cache-bytes they hold more experts in the same bytes, and their quantization error "
                        "counts against the budget")
    p.add_argument("--mode", default="decode", choices=["decode", "forced"],
                   help="what the time estimate is for: decode (default) or teacher-forced windows")
    p.add_argument("--text", type=Path, default=EVAL_TEXT, help="held-out text the winner is validated on")
    p.add_argument("--calib-text", type=Path, default=CALIB_TEXT, help="text the search is tuned on")
    p.add_argument("--calib-tokens", type=positive_int, default=4096, help="calibration tokens traced and scored")
    p.add_argument("--tokens", type=positive_int, default=8192, help="held-out tokens the winner is validated on")
    p.add_argument("--context", type=positive_int, default=512, help="window length in tokens")
    p.add_argument("--finalists", type=positive_int, default=16, help="most frontier points scored exactly")
    p.add_argument("--no-per-layer-tau", dest="per_layer", action="store_false",
                   help="leave out thresholds with one tau per layer (scaled by each layer's router entropy)")
    p.add_argument("--no-lowbit", dest="lowbit", action="store_false",
                   help="leave out the low-precision miss option (lowbit: int4 copies converted by the engine)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="leave out prefetching (in decode, the frontier's policies are also tried with each predictor "
                        "the model has: quasi-hidden, estimator, lookahead)")
    p.add_argument("--plot", type=plot_path, default=None, help="frontier PNG: ppl increase vs estimated ms/token")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    announce_compile("engine", "simulator")
    from ..engine.cache import CacheConfig
    from ..errors import BadInput
    from ..lab.costmodel import (
        DECODE_PROMPT,
        calibration_ids,
        load_profile,
        measure_profile,
        runs_for_slots,
        time_runs,
    )
    from ..lab.study import signed
    from ..lab.texts import read_text
    from ..lab.tune import (
        PREFETCH_PREDICTORS,
        QUICK_PREFETCH_RUNS,
        QUICK_RUNS,
        TIMED_REPEATS,
        TIMED_TOKENS,
        TuneConfig,
        check_cache_size,
        slot_store_format,
        tune,
        tune_ids,
        unlabel,
    )
    from ..progress import progress_bar

    calib_text, eval_text = read_text(a.calib_text), read_text(a.text)
    cfg = TuneConfig(budget_pct=a.budget, cache=CacheConfig(fraction=a.cache, bytes=a.cache_bytes),
                     calib_tokens=a.calib_tokens, tokens=a.tokens, context=a.context, mode=a.mode,
                     finalists=a.finalists, per_layer=a.per_layer, lowbit=a.lowbit,
                     slot_dtypes=("auto", *dict.fromkeys(a.slot_dtypes)),
                     prefetch=PREFETCH_PREDICTORS if a.prefetch and a.mode == "decode" else ())
    slots = cfg.slot_dtypes
    if a.profile and len(a.profile) != len(slots):
        raise BadInput(f"{len(a.profile)} --profile files for {len(slots)} slot formats ({', '.join(slots)}); "
                       "give one per format, in that order")
    ids = tune_ids(a.model, calib_text, eval_text, cfg)  # texts too short fail here, before any measuring
    check_cache_size(a.model, cfg)  # and so does a cache too small
    if a.profile:
        profile = {s: load_profile(f) for s, f in zip(slots, a.profile)}
        how = f"profile {', '.join(a.profile)}"
    else:
        quick = QUICK_RUNS + (QUICK_PREFETCH_RUNS if cfg.prefetch else ())
        runs = {s: runs_for_slots(quick, s) for s in slots}
        profile = {}
        with progress_bar(total=sum(2 * len(r) for r in runs.values()), unit="run", desc="quick profile") as bar:
            for s in slots:
                profile[s] = measure_profile(a.model, "disk", a.mode, repeats=1, runs=runs[s], reads=20,
                                             ids=calibration_ids(a.model, a.mode, text=calib_text),
                                             progress=lambda label: bar.update(),
                                             options={"slot_dtype": s, "store_format": slot_store_format(s)})
        how = (f"a quick {a.mode} profile per slot format measured now on the disk store (pass --profile for full "
               "calibrate-hw ones)")

    def timer(labels: list[str]) -> dict[str, float]:
        """ms/token of each labelled candidate (one slot format) decoding the calibration text on the disk store,
        as the quick profile timed its runs."""
        slots = unlabel(labels[0])[1]
        runs = [(CacheConfig(fraction=a.cache, bytes=a.cache_bytes), unlabel(name)[0]) for name in labels]
        with progress_bar(total=len(runs) * (TIMED_REPEATS + 1), unit="run", desc="timing the winner") as bar:
            tokens = calibration_ids(a.model, "decode", DECODE_PROMPT + TIMED_TOKENS, calib_text)
            timed = time_runs(a.model, runs, tokens, "decode", TIMED_REPEATS,
                              progress=lambda label: bar.update(),
                              options={"slot_dtype": slots, "store_format": slot_store_format(slots)})
        return {name: 1000 * t.seconds for name, t in zip(labels, timed)}

    with progress_bar(unit="step") as bar:
        def progress(label, n, total=None):
            if total is not None:  # a phase begins: its steps in all
                bar.reset(total=total)
            bar.set_description(label.split(":")[0])
            bar.update(n)
        # a profile given may be of another machine or store: only the quick one's winner is timed here
        try:
            res = tune(a.model, ids, profile, cfg, progress, None if a.profile else timer)
        except KeyboardInterrupt as e:  # past the search, what was scored is reported (lost before)
            if getattr(e, "result", None) is None:
                raise
            res = e.result
    interrupted = res.config.get("interrupted")
    for name, why in res.config["prefetch_skipped"].items():
        print(f"prefetch/{name} not searched: {why}")
    for name, why in res.config["not_scored"].items():
        print(f"{name} not scored: {why}")
    for slots, store in res.config["store"].items():
        if store != "ram":
            print(f"{slots} slots scored on the {store} store: the experts do not fit in memory")
    print(f"time estimates: {how}; replay in {a.mode} order on {res.config['calib_tokens_used']} tokens of "
          f"{a.calib_text.name}; {len(res.candidates)} candidates, {len(res.finalists) - 1} finalists scored "
          f"exactly; held-out: {res.config['tokens_used']} tokens of {a.text.name}\n")
    print("| finalist | est. ms/token | est. speed-up | calibration ppl increase | 95% CI |\n|---|---:|---:|---:|---|")
    est = {r["label"]: r["estimated_ms"] for r in res.candidates}
    for spec, f in sorted(res.finalists.items(), key=lambda kv: est[kv[0]]):
        mark = " **winner**" if spec == res.winner else ""
        print(f"| `{spec}`{mark} | {est[spec]:.2f} | {res.baseline_ms / est[spec]:.2f}x | {signed(f['pct'])}% | "
              f"[{signed(f['ci'][0])}, {signed(f['ci'][1])}] |")
    if res.timed:
        t, ms = res.timed, res.timed["measured_ms"]
        kept = "the winner is kept" if t["winner"] == t["estimated"] else \
            "the winner is the one without prefetching" if t["winner"] == t["fallback"] else \
            "fetch-every-miss is faster here: it is the policy"
        times = ", ".join(f"`{name}` {v:.2f}" for name, v in ms.items())
        print(f"\ntimed on this machine (disk store, {TIMED_TOKENS} decode tokens, median of {TIMED_REPEATS}), "
              f"ms/token: {times}; {kept}, {t['speedup']:.2f}x over fetch-every-miss")
        claimed = res.baseline_ms / est[t["winner"]] if t["winner"] in est else None
        if claimed is not None and not 1 / 1.5 <= t["speedup"] / claimed <= 1.5:  # the quick profile misjudged
            print(f"warning: the estimates claimed {claimed:.2f}x for it: the quick profile is off on this machine "
                  "(a busy machine times its few runs unevenly); the timed runs above decide the policy, and for "
                  "estimates to trust run `expertcache calibrate-hw --out FILE` on a quiet machine and pass "
                  "--profile FILE")
    validated = {spec: v for spec, v in res.validation.items() if spec != "fetch-all"}
    if validated:  # none where interrupted before
        print(f"\nheld-out validation ({a.text.name}):\n\n| policy | est. ms/token | est. speed-up | ppl increase | "
              f"95% CI | within {a.budget:g}% |\n|---|---:|---:|---:|---|---|")
    for spec, v in validated.items():
        print(f"| `{spec}` | {v['estimated_ms']:.2f} | {v['estimated_speedup']:.2f}x | {signed(v['pct'])}% | "
              f"[{signed(v['ci'][0])}, {signed(v['ci'][1])}] | {'yes' if v['within_budget'] else 'no'} |")
    if interrupted == "score":
        print(f"\ninterrupted while scoring the finalists: {len(res.finalists) - 1} scored (above), no policy chosen")
    elif res.winner is None:
        print(f"\nno finalist stays within {a.budget:g}% on the calibration text; fetch-all is the policy "
              "(raise --budget or the cache size)")
    elif res.winner not in res.validation:
        print(f"\npolicy: {res.winner} (interrupted before it was validated on held-out text)")
    else:
        v = res.validation[res.winner]
        spec, slots = unlabel(res.winner)
        if slots != "auto":
            print(f"\nslots: {slots} (run with --slot-dtype {slots} --store-dtype {slots})", end="")
        print(f"\npolicy: {spec}\nestimated speed-up over fetch-every-miss: {v['estimated_speedup']:.2f}x "
              f"({v['estimated_ms']:.2f} vs {res.baseline_ms:.2f} ms/token)\nvalidated perplexity increase: "
              f"{signed(v['pct'])}% (95% CI {signed(v['ci'][0])} to {signed(v['ci'][1])}) on held-out text")
        if not v["within_budget"]:  # chosen on the calibration text; the held-out text is the honest check
            print(f"warning: on held-out text the winner is outside the {a.budget:g}% budget; raise --budget, "
                  "tune on more --calib-tokens, or prefer a finalist marked within it above")
    write_json(a.json, res.to_dict())
    if a.plot and len(res.finalists) > 1:
        plot_search(res, a.plot)
    if interrupted:
        doing = {"score": "scoring the finalists", "time": "timing the winner",
                 "validate": "validating on held-out text"}[interrupted]
        print(f"interrupted while {doing}: the report holds what was done", file=sys.stderr)
        return 130
    return 0


def plot_search(res, path: Path) -> Path:
    """Perplexity increase on calibration text (with its CI) against estimated ms/token, one point per
    finalist, the Pareto frontier drawn and the winner marked."""
    from ..lab.plots import scatter
    est = {r["label"]: r["estimated_ms"] for r in res.candidates}
    points = {s: (est[s], f["pct"]) for s, f in res.finalists.items()}
    errors = {s: (f["pct"] - f["ci"][0], f["ci"][1] - f["pct"]) for s, f in res.finalists.items()}
    short = {s: s.replace("threshold:", "").replace("eviction=", "").replace("beta=", "b=") for s in points}
    return scatter(points, "estimated ms/token", "perplexity increase on calibration text (%)",
                   f"Tune: finalists and the winner (budget {res.config['budget_pct']:g}%)", path,
                   errors=errors, frontier=True, highlight=res.winner, short=short)
