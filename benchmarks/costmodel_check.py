"""The cost model out of sample: calibrate a profile on one set of runs and text, then predict
runs it never saw, on other cache sizes, other policies (prefetch variants included) and
held-out text, in decode and teacher-forced.

Calibration: the CALIBRATION runs (costmodel.py) timed on the start of the evaluation text
(its first domain), fitted by non-negative least squares. Validation: the VALIDATION runs
below, timed on a later domain of the evaluation text. Calibration and validation runs are
timed in one round-robin, repetition by repetition, so that a change of the machine's load
hits both alike.
Each validation run's time is estimated twice with the calibrated profile: from the engine's
own counters in that run (tests the cost model alone), and from a replay of the same tokens'
router-logit trace (what `simulate` and `tune` do; a prefetch variant replays its predictor's
routes, recorded over the same tokens as decode computes them). Decode: a 32-token prompt, then
256 tokens fed alone, timed.
Reported per run: measured / estimated time, and per mode the share of runs within 15%.

    python benchmarks/costmodel_check.py [--repeats 3] [--modes forced decode] [--json out.json]
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from expertcache.cli import run_script
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import load_routing_counts, open_checkpoint
from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.engine.perplexity import EVAL_TEXT
from expertcache.engine.stores import open_store
from expertcache.lab.bench import parse_variant
from expertcache.lab.costmodel import CALIBRATION, calibration_ids, difference, fit_profile, time_runs
from expertcache.lab.prediction import prediction_routes
from expertcache.lab.simulator import replay
from expertcache.lab.trace import record_trace
from expertcache.models import model_args

# None of these (cache, variant) pairs is a calibration run: other sizes, rules, substitutes and prefetch.
VALIDATION = ((0.375, "fetch-all"), (0.625, "fetch-all"), (0.1875, "threshold:tau=0.1"),
              (0.375, "threshold:tau=0.05,beta=0.5"), (0.5, "first-choice"), (0.375, "speed-first"),
              (0.25, "band:lo=0,hi=0.1"), (0.25, "conditional:j=2,m=16"),
              (0.25, "fetch-all+prefetch/quasi-hidden"), (0.5, "quality-first+prefetch/router-ahead"),
              (0.375, "lowbit:tau=0.1"), (0.25, "lowbit:tau=0.3,lo=0.05"), (0.25, "lowbit:tau=0.15,upgrade=1"))
HELD_OUT_DOMAIN = 2  # the evaluation text's third domain (scripture); calibration reads the first (drama)
TOKENS = {"decode": 32 + 256, "forced": 1025}  # decode: prompt + timed tokens
CONTEXT = 256  # teacher-forced windows, as the benchmark


def held_out_ids(mode: str) -> list[int]:
    seg = json.loads(EVAL_TEXT.with_suffix(".json").read_text())["segments"][HELD_OUT_DOMAIN]
    text = EVAL_TEXT.read_text(encoding="utf-8")[seg["start_char"]:seg["start_char"] + seg["chars"]]
    return calibration_ids(None, mode, TOKENS[mode], text)


def record(ids: list[int], mode: str, d: Path) -> tuple:
    """The traces a replay of `ids` needs, each with its validation predictors' routes: the teacher-forced
    windows, or (whole, prompt) in decode (the prompt's routes are the whole's first: attention is causal)."""
    predictors = list(dict.fromkeys(pre.predictor for _, v in VALIDATION if (pre := parse_variant(v)[1])))
    context = CONTEXT if mode == "forced" else len(ids)
    routes = prediction_routes(BUILTIN_MODEL, ids, predictors, context)
    if mode == "forced":
        return ((record_trace(BUILTIN_MODEL, ids, d / "forced.ectrace", CONTEXT, "float32"), routes),)
    head = {p: (i[:, :32], w[:, :32]) for p, (i, w) in routes.items()}
    return ((record_trace(BUILTIN_MODEL, ids, d / "whole.ectrace", len(ids), "float32"), routes),
            (record_trace(BUILTIN_MODEL, ids[:32], d / "head.ectrace", 32, "float32"), head))


def replayed_ms(profile, traces: tuple, variant: str, fraction: float, counts) -> float:
    """Estimated ms/token from a replay of `record`'s traces (decode: the tokens after the prompt)."""
    cache = CacheConfig(fraction=fraction)
    if len(traces) == 1:
        trace, routes = traces[0]
        return profile.ms_per_token(replay(trace, variant, cache, None, counts, predictions=routes).stats)
    (whole, routes), (head, head_routes) = traces
    return profile.ms_per_token(difference(
        replay(whole, variant, cache, None, counts, window=1, predictions=routes).stats,
        replay(head, variant, cache, None, counts, window=1, predictions=head_routes).stats))


def check(mode: str, repeats: int, bar) -> dict:
    progress = lambda label: (bar.set_postfix_str(f"{mode} {label}"), bar.update())  # noqa: E731
    cal_ids, ids = calibration_ids(None, mode, TOKENS[mode]), held_out_ids(mode)
    timed = time_runs(None, CALIBRATION + VALIDATION, cal_ids, mode, repeats, context=CONTEXT, progress=progress,
                      run_ids=[cal_ids] * len(CALIBRATION) + [ids] * len(VALIDATION))
    cal, val = timed[:len(CALIBRATION)], timed[len(CALIBRATION):]
    ckpt = open_checkpoint(BUILTIN_MODEL)
    a = model_args(ckpt.config)
    store = open_store("disk", ckpt, a)
    profile = fit_profile(cal, store, a.num_moe_layers, a.top_k, mode, "disk")
    store.close()
    counts = load_routing_counts(BUILTIN_MODEL)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        traces = record(ids, mode, Path(d))
        for r in val:
            rows.append({"cache": r.cache, "variant": r.variant, "measured_ms": 1000 * r.seconds,
                         "from_engine_counts_ms": profile.ms_per_token(r.stats),
                         "from_replay_ms": replayed_ms(profile, traces, r.variant, r.cache, counts)})
    return {"profile": profile.__dict__, "calibration_tokens": len(cal_ids), "validation_tokens": len(ids),
            "calibration": list(profile.calibration), "validation": rows,
            "summary": {"engine counts": summary(rows, "from_engine_counts_ms"),
                        "replay": summary(rows, "from_replay_ms")}}


def summary(rows: list[dict], key: str) -> dict:
    """Mean and worst |error|, and the share within 15%, of the estimates in `key` against the measured times."""
    ratios = [r["measured_ms"] / r[key] for r in rows]
    errs = [abs(1 / q - 1) for q in ratios]
    return {"runs": len(errs), "mean_abs_error": sum(errs) / len(errs), "worst_abs_error": max(errs),
            "within_15pct": sum(e <= 0.15 for e in errs) / len(errs)}


def table(mode: str, res: dict) -> None:
    p = res["profile"]
    print(f"\n### {mode}: calibrated on {len(CALIBRATION)} runs x {res['calibration_tokens']} tokens of the first "
          f"domain, validated on {len(VALIDATION)} other runs x {res['validation_tokens']} tokens of a later one\n")
    lowbit = "bytes/bandwidth" if p["lowbit_fetch_s"] is None else f"{1e6 * p['lowbit_fetch_s']:.0f} us"
    print(f"profile: dense {1e3 * p['dense_s']:.3f} ms/token, expert run {1e6 * p['expert_run_s']:.1f} us, "
          f"flushed entry {1e6 * p['flushed_s']:.1f} us, fetch wait "
          f"{1e6 * p['fetch_latency_s']:.0f} us, per fetch {1e6 * p['expert_bytes'] / p['fetch_bandwidth']:.0f} us, "
          f"lowbit fetch {lowbit}, admission {1e6 * p['admission_s']:.0f} us, prefetch {1e6 * p['prefetch_s']:.0f} us "
          f"(+{1e6 * p['exposed_prefetch_s']:.0f} us exposed), prediction {1e6 * p['prediction_s']:.0f} us, "
          f"substituting call {1e6 * p['decision_s']:.1f} us; "
          f"unfitted: {', '.join(p['unfitted']) or 'none'}; {p['source']}\n")
    print("| cache | variant | measured ms/token | est. (engine counts) | measured/est. | est. (replay) "
          "| measured/est. |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in res["validation"]:
        print(f"| {r['cache']:g} | `{r['variant']}` | {r['measured_ms']:.2f} | {r['from_engine_counts_ms']:.2f} | "
              f"{r['measured_ms'] / r['from_engine_counts_ms']:.2f} | {r['from_replay_ms']:.2f} | "
              f"{r['measured_ms'] / r['from_replay_ms']:.2f} |")
    for k, v in res["summary"].items():
        print(f"\nfrom {k}: mean |error| {100 * v['mean_abs_error']:.1f}%, worst {100 * v['worst_abs_error']:.1f}%, "
              f"{round(v['within_15pct'] * v['runs'])}/{v['runs']} ({100 * v['within_15pct']:.0f}%) within 15%", end="")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["forced", "decode"], choices=["forced", "decode"])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    out = {}
    total = len(a.modes) * (len(CALIBRATION) + len(VALIDATION)) * (a.repeats + 1)
    with tqdm(total=total, unit="run", file=sys.stderr) as bar:
        for mode in a.modes:
            out[mode] = check(mode, a.repeats, bar)
    for mode in a.modes:
        table(mode, out[mode])
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    run_script(main)
