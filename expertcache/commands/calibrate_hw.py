"""expertcache calibrate-hw: measure this machine's hardware profile for the cost model."""
from __future__ import annotations

from dataclasses import asdict

from .options import (
    add_model_argument,
    add_store_arguments,
    announce_compile,
    format_from_args,
    output_path,
    positive_int,
)

HELP = "measure fetch, expert and dense times on this machine into a cost-model profile"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    add_store_arguments(p)
    p.add_argument("--mode", default="decode", choices=["decode", "forced"],
                   help="what the profile times: decode (one token a step) or teacher-forced windows")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed repetitions of each run (median)")
    p.add_argument("--out", type=output_path, required=True, help="profile JSON to write")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    announce_compile()
    from ..lab.costmodel import CALIBRATION, measure_profile, runs_for_slots
    from ..progress import progress_bar
    runs = len(runs_for_slots(CALIBRATION, a.slot_dtype))
    with progress_bar(total=runs * (a.repeats + 1), unit="run", desc="calibrate-hw") as bar:
        options = {"read_mode": a.read_mode, "io": a.io, "slot_dtype": a.slot_dtype,
                   "store_format": format_from_args(a, a.store_dtype)}
        prof = measure_profile(a.model, a.store, a.mode, a.repeats, device=a.device, store_dir=a.store_dir,
                               progress=lambda label: (bar.set_postfix_str(label), bar.update()), options=options)
    prof.save(a.out)
    for k, v in asdict(prof).items():
        if k != "calibration":
            print(f"{k}: {', '.join(v) or 'none'}" if k == "unfitted" else f"{k}: {v}")  # not a tuple's repr
    print("\n| cache | policy | measured ms/token | fitted | error |\n|---:|---|---:|---:|---:|")
    for r in prof.calibration:
        print(f"| {r['cache']:g} | `{r['policy']}` | {r['ms_per_token']:.3f} | {r['fitted_ms_per_token']:.3f} | "
              f"{100 * (r['fitted_ms_per_token'] / r['ms_per_token'] - 1):+.1f}% |")
    return 0
