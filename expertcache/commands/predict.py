"""expertcache predict: train the next-layer estimator, or measure recall@k per layer."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..lab.calibrate import CALIB_TEXT, encode_text
from ..engine.engine import BUILTIN_MODEL
from ..engine.perplexity import EVAL_TEXT
from ..lab.prediction import fit_estimator, recall_table
from ..engine.predictors import PREDICTORS
from .options import write_json

HELP = "train the estimator (--train) or report each predictor's recall@k per layer"


def add_arguments(p):
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint folder (default: the built-in model)")
    p.add_argument("--train", action="store_true", help="train the estimator on calibration text and save it")
    p.add_argument("--text", type=Path, default=None, help="default: calibration text to train, evaluation text to measure")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--epochs", type=int, default=12, help="estimator training epochs")
    p.add_argument("--hybrid-below", type=float, default=0.85, help="hybrid: estimator where quasi-hidden recall is below")
    p.add_argument("--predictors", nargs="*", default=list(PREDICTORS))
    p.add_argument("--plot", type=Path, default=None, help="per-layer recall PNG")
    p.add_argument("--json", type=Path, default=None)


def run(a) -> int:
    path = a.model or BUILTIN_MODEL
    if a.train:
        ids = encode_text(path, (a.text or CALIB_TEXT).read_text(encoding="utf-8"), a.max_tokens)
        r = fit_estimator(path, ids, a.hybrid_below, a.epochs, progress=lambda s: print(s, file=sys.stderr))
        print(json.dumps(r, indent=1))
        write_json(a.json, r)
        return 0
    ids = encode_text(path, (a.text or EVAL_TEXT).read_text(encoding="utf-8"), a.max_tokens)
    table = recall_table(path, ids, a.predictors)
    layers = len(next(iter(table.values())))
    print("| predictor | " + " | ".join(f"{l}->{l + 1}" for l in range(layers)) + " | mean |")
    print("|---|" + "---:|" * (layers + 1))
    for name, rec in table.items():
        print(f"| {name} | " + " | ".join(f"{r:.1%}" for r in rec) + f" | {sum(rec) / len(rec):.1%} |")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, rec in table.items():
            ax.plot(range(layers), rec, "o-", label=name)
        ax.set_xticks(range(layers), [f"{l}->{l + 1}" for l in range(layers)])
        ax.set_xlabel("transition")
        ax.set_ylabel("recall@k")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    write_json(a.json, table)
    return 0
