"""expertcache calibrate-hw: measure this machine's hardware profile for the cost model."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

HELP = "measure fetch, expert and dense times on this machine into a cost-model profile"


def add_arguments(p):
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint folder (default: the built-in model)")
    p.add_argument("--store", default="disk")
    p.add_argument("--mode", default="decode", choices=["decode", "forced"])
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")


def run(a) -> int:
    from ..costmodel import measure_profile
    prof = measure_profile(a.model, a.store, a.mode)
    prof.save(a.out)
    for k, v in asdict(prof).items():
        print(f"{k}: {v}")
    return 0
