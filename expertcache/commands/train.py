"""expertcache train: rebuild the built-in model from the corpus (about an hour on 2 cores)."""
from __future__ import annotations

from pathlib import Path

HELP = "rebuild the built-in model: corpus, tokenizer, training, HF checkpoint"


def add_arguments(p):
    """The verb's options (train.Schedule's token budget is the default)."""
    p.add_argument("--work", type=Path, default=Path("build/train"), help="corpus, tokens and resume state")
    p.add_argument("--out", type=Path, default=Path("build/model"), help="where the HF checkpoint goes")
    p.add_argument("--tokens", type=int, default=6_600_000, help="training tokens")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..train.train import run_from_args
    run_from_args(a)
    return 0
