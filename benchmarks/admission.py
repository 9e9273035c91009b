"""Background admission under decode semantics, and the score an admitted expert enters with.

Two instruments on the same text: the replay of the evaluation trace (hit rate, fetches and
substituted mass, in 512-token windows and in decode order), and exact teacher-forced
perplexity of the study's sequences (warm 25% cache, `ram` store) with the increase over
fetch-every-miss overall and in the two windows after each topic change, paired bootstrap
95% CIs. Every admitting policy runs under `freq` (an admitted expert enters with score 0)
and `demand` (it enters with its decayed routing demand).

    python benchmarks/admission.py --trace build/eval16k.ectrace --json build/results/admission.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from expertcache import CacheConfig, Engine, EngineConfig, perplexity
from expertcache.cli import run_script
from expertcache.engine.checkpoint import load_routing_counts
from expertcache.lab.simulator import replay, route_trace
from expertcache.lab.study import BASELINE, StudyConfig, paired_increase, study_sequences
from expertcache.lab.trace import read_trace

RUNS = [(BASELINE, "lru"), ("threshold:tau=0.15", "freq"), ("threshold:tau=0.15", "demand"),
        ("quality-first:beta=0", "freq"), ("quality-first", "freq"), ("quality-first", "demand"),
        ("speed-first", "freq"), ("speed-first", "demand")]


def replays(trace_path: Path, cache: float) -> list[dict]:
    trace = read_trace(trace_path)
    routes, counts = route_trace(trace), load_routing_counts(Path(trace.header["model"]))
    rows = []
    for spec, eviction in RUNS:
        for window in (None, 1):
            s = replay(trace, spec, CacheConfig(fraction=cache), eviction, counts, routes=routes,
                       window=window).stats
            rows.append({"policy": spec, "eviction": eviction, "window": window or trace.header["context"],
                         "hit_rate": s.hit_rate, "fetches_per_token": s.fetches_per_token,
                         "admissions_per_token": s.background_fetches / s.tokens, "mass_per_call": s.mass_per_call})
    return rows


def quality(cache: float, cfg: StudyConfig) -> list[dict]:
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=cache), initial="warm"))
    seq = study_sequences(engine, cfg)
    per_domain = cfg.tokens_per_domain // cfg.context
    after = [w + j for w in seq.first_windows(cfg.context)[1:] for j in range(min(2, per_domain))]
    nll = {}
    rows = []
    for spec, eviction in RUNS:
        engine.set_policy(spec, eviction)
        r = perplexity(engine, seq.ids, cfg.context, segments=seq.starts)
        nll[spec, eviction] = w = np.asarray(r.window_nll)
        base = nll[BASELINE, "lru"]
        rows.append({"policy": spec, "eviction": eviction, "ppl": r.ppl,
                     "increase": paired_increase(base, w, cfg.bootstrap, cfg.seed),
                     "increase_after_topic_change": paired_increase(base[after], w[after], cfg.bootstrap, cfg.seed),
                     "hit_rate": r.stats["hit_rate"],
                     "mass_per_call": r.stats["substituted_mass"] / r.stats["moe_calls"],
                     "admissions_per_token": r.stats["background_fetches"] / r.tokens})
    engine.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, required=True, help="`expertcache trace` of the evaluation text")
    p.add_argument("--cache", type=float, default=0.25)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    sim = replays(a.trace, a.cache)
    print("| policy | eviction | window | hit rate | fetches/token | admissions/token | mass/call |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in sim:
        print(f"| `{r['policy']}` | {r['eviction']} | {r['window']} | {r['hit_rate']:.1%} | "
              f"{r['fetches_per_token']:.2f} | {r['admissions_per_token']:.3f} | {r['mass_per_call']:.4f} |")
    ppl = quality(a.cache, StudyConfig())
    print("\n| policy | eviction | ppl | increase [95% CI] | after topic change [95% CI] | hit rate | mass/call |"
          " admissions/token |\n|---|---|---:|---:|---:|---:|---:|---:|")
    ci = lambda d: f"{d['pct']:+.2f}% [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]"  # noqa: E731
    for r in ppl:
        print(f"| `{r['policy']}` | {r['eviction']} | {r['ppl']:.2f} | {ci(r['increase'])} | "
              f"{ci(r['increase_after_topic_change'])} | {r['hit_rate']:.1%} | {r['mass_per_call']:.4f} | "
              f"{r['admissions_per_token']:.3f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"replay": sim, "perplexity": ppl}, indent=1))


if __name__ == "__main__":
    run_script(main)
