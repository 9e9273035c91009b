"""expertcache calibrate: routing counts and default vectors on calibration text."""
from __future__ import annotations

from pathlib import Path

from ..choices import CALIB_TEXT
from .options import add_model_argument, byte_size, positive_int, written_model

HELP = ("compute routing counts (warm cache) and per-expert default vectors on calibration text, written into the "
        "model's folder (routing_counts.json, default_vectors.safetensors)")


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p, default="none: it writes beside the model, and the built-in model's files ship with it")
    p.add_argument("--text", type=Path, default=CALIB_TEXT, help="calibration text, disjoint from evaluation text")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="use only the first N tokens")
    p.add_argument("--memory-budget", type=byte_size, default=None,
                   help="refuse (naming the minimum) a calibration that would hold more than this beyond the "
                        "process's baseline, e.g. 600M; it holds the dense weights, the text's hidden states and one "
                        "expert at a time")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..engine.checkpoint import DEFAULT_VECTORS, ROUTING_COUNTS, check_writable
    from ..lab.calibrate import (
        calibrate,
        check_calibration_budget,
        check_fit_tokens,
        encode_text,
        save_calibration,
    )
    from ..lab.texts import read_text
    from ..progress import progress_bar
    text = read_text(a.text)
    files = (ROUTING_COUNTS, DEFAULT_VECTORS)
    path = written_model(a, "calibrate", " and ".join(files))
    check_writable(path, files)
    ids = encode_text(path, text, a.max_tokens)
    check_fit_tokens(ids, "calibrate")  # before the progress bar
    if a.memory_budget is not None:
        check_calibration_budget(path, len(ids), a.memory_budget)
    with progress_bar(total=len(ids), unit="tok", desc="calibrate") as bar:
        c = calibrate(path, ids, progress=bar.update)
    save_calibration(c, path, a.text.name)
    print(f"{c.tokens} tokens; {c.never_routed} of {c.counts.numel()} experts never routed (zero default vector); "
          f"wrote routing counts and default vectors to {path}")
    return 0
