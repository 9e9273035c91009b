"""expertcache train: rebuild the built-in model from the corpus (about an hour on 2 cores)."""
from __future__ import annotations

HELP = "rebuild the built-in model: corpus, tokenizer, training, HF checkpoint"


def add_arguments(p):
    """The verb's options."""
    from ..train.train import add_arguments as add
    add(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..train.train import run_from_args
    run_from_args(a)
    return 0
