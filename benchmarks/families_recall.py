"""Next-layer recall@k of every predictor on other families' tiny random models, per layer
transition: text-like token sequences (the built-in calibration and evaluation texts through the
built-in tokenizer, folded into the tiny vocabulary), calibrated and trained on the first,
scored on the held-out second. Routing is made decisive as in the tests (routers scaled up).

    python benchmarks/families_recall.py [--families mixtral deepseek_v2] [--layers 5]
        [--train-tokens 16384] [--eval-tokens 8192] [--epochs 20] [--sketch-rank 16]
        [--sketch-neurons 8] [--json FILE]

The tiny models' experts have 16 neurons on a 32-wide hidden state: the default sketch (rank 16,
8 neurons) is most of such an expert; `--sketch-rank 3 --sketch-neurons 2` keeps the built-in
model's proportions (rank 16 of 160 channels, 8 of 64 neurons).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from hf_models import hf_config, save_tiny  # noqa: E402

from expertcache.choices import (  # noqa: E402
    BUILTIN_MODEL,
    CALIB_TEXT,
    EVAL_TEXT,
    LOOKAHEAD_WIDTH,
    SKETCH_NEURONS,
    SKETCH_RANK,
)
from expertcache.cli import run_script
from expertcache.lab.calibrate import calibrate, encode_text, save_calibration  # noqa: E402
from expertcache.lab.prediction import fit_estimator, recall_table  # noqa: E402
from expertcache.lab.texts import read_text  # noqa: E402


def folded(text: Path, tokens: int, vocab: int) -> list[int]:
    """The text's built-in token ids folded into 1..vocab-1 (0 is the tiny models' padding)."""
    return [1 + i % (vocab - 1) for i in encode_text(BUILTIN_MODEL, read_text(text), tokens)]


def deeper(family: str, layers: int) -> dict:
    """The overrides that give `family`'s tiny model `layers` decoder layers (a per-layer pattern repeated)."""
    over = {"num_hidden_layers": layers}
    pattern = getattr(hf_config(family), "layer_types", None)
    if pattern:
        over["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["mixtral", "deepseek_v2"])
    p.add_argument("--layers", type=int, default=5, help="decoder layers of each tiny model")
    p.add_argument("--train-tokens", type=int, default=16384)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--sketch-rank", type=int, default=SKETCH_RANK, help="the lookahead's expert sketches' rank")
    p.add_argument("--sketch-neurons", type=int, default=SKETCH_NEURONS, help="and the neurons they keep")
    p.add_argument("--lookahead-width", type=int, default=LOOKAHEAD_WIDTH, help="the lookahead's net's width")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families:
            path = Path(tmp) / family
            model = save_tiny(family, path, **deeper(family, a.layers))
            vocab = model.config.vocab_size
            train, held_out = folded(CALIB_TEXT, a.train_tokens, vocab), folded(EVAL_TEXT, a.eval_tokens, vocab)
            save_calibration(calibrate(path, train, context=128), path, "the built-in calibration text, folded")
            fit_estimator(path, train, epochs=a.epochs, sketch=(a.sketch_rank, a.sketch_neurons),
                          width=a.lookahead_width)
            table = recall_table(path, held_out)
            out[family] = table
            layers = len(next(iter(table.values())))
            print(f"\n{family}: {layers + 1} MoE layers, top-{model.config.num_experts_per_tok}\n")
            print("| predictor | " + " | ".join(f"{l}->{l + 1}" for l in range(layers)) + " | mean |")
            print("|---|" + "---:|" * (layers + 1))
            for name, rec in table.items():
                print(f"| {name} | " + " | ".join(f"{r:.1%}" for r in rec) + f" | {sum(rec) / len(rec):.1%} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_script(main)
