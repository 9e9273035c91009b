"""expertcache simulate: replay policies on a trace over a sweep of cache sizes."""
from __future__ import annotations

from pathlib import Path

from ..cache import CacheConfig
from ..costmodel import load_profile
from ..simulator import load_counts, replay
from ..trace import read_trace
from .options import write_json

HELP = "replay miss policies on a router-logit trace: hits, fetches, substitutions per cache size"


def add_arguments(p):
    p.add_argument("trace", type=Path)
    p.add_argument("--policies", nargs="*", default=["fetch-all", "threshold:tau=0.15", "first-choice",
                                                    "quality-first", "speed-first", "substitute-all"])
    p.add_argument("--cache", type=float, nargs="*", default=[0.25])
    p.add_argument("--eviction", default=None)
    p.add_argument("--initial", default="auto", help="warm (the model's routing counts), cold or auto")
    p.add_argument("--profile", default=None, help="cost model: a calibrate-hw file, rtx3090-qwen3-next or "
                                                   "a6000-qwen3-30b; adds estimated ms/token")
    p.add_argument("--json", type=Path, default=None)


def run(a) -> int:
    trace = read_trace(a.trace)
    profile = load_profile(a.profile) if a.profile else None
    counts = None if a.initial == "cold" else load_counts(Path(trace.header["model"]))
    rows = []
    print("| policy | cache | hit rate | fetches/token | admissions/token | slots subst. | mass/call | est. ms/token "
          "| events/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for fraction in a.cache:
        for policy in a.policies:
            r = replay(trace, policy, CacheConfig(fraction=fraction), a.eviction, counts)
            s = r.stats
            est = profile.ms_per_token(s) if profile else float("nan")
            rows.append({"policy": policy, "cache": fraction, "events_per_second": r.events_per_second,
                         "estimated_ms_per_token": est, **s.to_dict()})
            print(f"| `{policy}` | {fraction:g} | {s.hit_rate:.1%} | {s.fetches_per_token:.2f} | "
                  f"{s.background_fetches / s.tokens:.3f} | {100 * s.substitutions / s.routed:.1f}% | "
                  f"{s.mass_per_call:.4f} | {est:.2f} | {r.events_per_second / 1e6:.2f}M |")
    write_json(a.json, {"trace": str(a.trace), "header": trace.header, "runs": rows})
    return 0
