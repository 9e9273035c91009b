"""expertcache bench: time every policy on the real engine against fetch-every-miss and the floor."""
from __future__ import annotations

import sys
from pathlib import Path

from ..lab.bench import POLICIES, BenchConfig, markdown, run_bench
from .options import write_json

HELP = "time the policies on the real engine (disk store by default) with warm-up and repetitions"


def add_arguments(p):
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint folder (default: the built-in model)")
    p.add_argument("--store", default="disk")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache", type=float, default=0.25)
    p.add_argument("--policies", nargs="*", default=list(POLICIES))
    p.add_argument("--decode-tokens", type=int, default=BenchConfig.decode_tokens)
    p.add_argument("--forced-tokens", type=int, default=BenchConfig.forced_tokens)
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    p.add_argument("--json", type=Path, default=None)


def run(a) -> int:
    policies = tuple(dict.fromkeys(["fetch-all", *a.policies]))
    cfg = BenchConfig(store=a.store, device=a.device, cache_fraction=a.cache, policies=policies,
                      decode_tokens=a.decode_tokens, forced_tokens=a.forced_tokens, repeats=a.repeats)
    res = run_bench(a.model, cfg, progress=lambda s: print(s, file=sys.stderr))
    print(markdown(res))
    write_json(a.json, res.to_dict())
    return 0
