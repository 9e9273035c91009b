"""expertcache predict: train the next-layer estimators, or measure recall@k per layer."""
from __future__ import annotations

import json
from pathlib import Path

from ..choices import (
    BUILTIN_MODEL,
    CALIB_TEXT,
    EVAL_TEXT,
    LOOKAHEAD_WIDTH,
    PREDICTORS,
    SKETCH_NEURONS,
    SKETCH_RANK,
)
from ..errors import BadInput
from .options import (
    add_json_argument,
    add_model_argument,
    fraction,
    non_negative_int,
    plot_path,
    positive_int,
    write_json,
    written_model,
)

HELP = ("train the estimators (--train), report each predictor's recall@k per layer, or (--speculative) what "
        "running its predictions in place of the router costs in perplexity and greedy tokens")


EPOCHS, HYBRID_BELOW = 30, 0.85  # --train's defaults, which predict without --train refuses set otherwise


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p, default="the built-in model, to score; --train writes beside the model and needs --model")
    p.add_argument("--train", action="store_true",
                   help="train the estimator and the lookahead's net on calibration text and save them")
    p.add_argument("--speculative", action="store_true",
                   help="run each predictor's experts in place of the true router's (speculative execution): "
                        "perplexity against the exact model with a paired bootstrap CI, over --max-tokens per "
                        "domain of the evaluation text (default 4096), and greedy continuations' agreement")
    p.add_argument("--text", type=Path, default=None,
                   help="default: calibration text to train, evaluation text to measure")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="use only the first N tokens (default: the whole text; with --speculative, N tokens of "
                        "each domain, default 4096)")
    p.add_argument("--epochs", type=positive_int, default=EPOCHS,
                   help="training epochs of each net (per layer transition)")
    p.add_argument("--sketch-rank", type=non_negative_int, default=SKETCH_RANK,
                   help="rank of the linear map in the lookahead's expert sketches")
    p.add_argument("--sketch-neurons", type=non_negative_int, default=SKETCH_NEURONS,
                   help="neurons each expert sketch keeps exact (0 and rank 0: each expert's mean output alone)")
    p.add_argument("--lookahead-width", type=positive_int, default=LOOKAHEAD_WIDTH,
                   help="hidden width of the lookahead's net on top of the router (its bytes read a decode call)")
    p.add_argument("--hybrid-below", type=fraction, default=HYBRID_BELOW,
                   help="hybrid: estimator where quasi-hidden recall is below")
    p.add_argument("--predictors", nargs="+", default=list(PREDICTORS), choices=PREDICTORS, help="predictors to score")
    p.add_argument("--plot", type=plot_path, default=None, help="per-layer recall PNG")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..lab.calibrate import encode_text
    from ..lab.plots import lines
    from ..lab.prediction import fit_estimator, recall_table
    from ..lab.texts import read_text
    from ..progress import progress_bar
    path = a.model or BUILTIN_MODEL
    if a.train and a.speculative:
        raise BadInput("--speculative measures trained predictors: run --train first, then --speculative")
    # options that only another mode reads: given, they were dropped in silence
    training = {"--epochs": (a.epochs, EPOCHS), "--sketch-rank": (a.sketch_rank, SKETCH_RANK),
                "--sketch-neurons": (a.sketch_neurons, SKETCH_NEURONS),
                "--lookahead-width": (a.lookahead_width, LOOKAHEAD_WIDTH),
                "--hybrid-below": (a.hybrid_below, HYBRID_BELOW)}
    if not a.train and (given := [flag for flag, (value, default) in training.items() if value != default]):
        raise BadInput(f"{', '.join(given)} set how --train fits the predictors; add --train, or leave them out")
    if (a.train or a.speculative) and a.plot:
        raise BadInput(f"--plot draws the recall table, which --{'train' if a.train else 'speculative'} does not "
                       "print; leave it out, or run predict without it")
    if a.train:
        text = read_text(a.text or CALIB_TEXT)
        from ..engine.checkpoint import ESTIMATOR_FILE, LOOKAHEAD_FILE
        path = written_model(a, "predict --train", f"{ESTIMATOR_FILE} and {LOOKAHEAD_FILE}")
        ids = encode_text(path, text, a.max_tokens)
        with progress_bar() as bar:
            r = fit_estimator(path, ids, a.hybrid_below, a.epochs, progress=_stages(bar),
                              sketch=(a.sketch_rank, a.sketch_neurons), width=a.lookahead_width)
        print(json.dumps(r, indent=1))
        write_json(a.json, r)
        return 0
    if a.speculative:
        return _speculative(a)
    ids = encode_text(path, read_text(a.text or EVAL_TEXT), a.max_tokens)
    with progress_bar() as bar:
        table = recall_table(path, ids, a.predictors, _stages(bar))
    layers = len(next(iter(table.values())))
    print(f"recall@k of layer l+1's routed experts, predicted at layer l (k: the model's top-k), over {len(ids):,} "
          f"tokens of {a.text or EVAL_TEXT}\n")
    print("| predictor | " + " | ".join(f"{l}->{l + 1}" for l in range(layers)) + " | mean |")
    print("|---|" + "---:|" * (layers + 1))
    for name, rec in table.items():
        print(f"| {name} | " + " | ".join(f"{r:.1%}" for r in rec) + f" | {sum(rec) / len(rec):.1%} |")
    if a.plot:
        lines(table, [f"{l}->{l + 1}" for l in range(layers)], "layer transition (MoE layers)", "recall@k", a.plot,
              title=f"Next layer's experts predicted: recall@k on {len(ids):,} tokens", percent=True)
    write_json(a.json, table)
    return 0


def _speculative(a) -> int:
    """`--speculative`: the quality of running each predictor's experts, as the study measures a policy's."""
    from ..lab.speculation import speculative_quality
    from ..lab.study import BASELINE, StudyConfig, increase_text
    from ..lab.texts import text_segments
    from ..progress import phases, progress_bar
    cfg = StudyConfig(tokens_per_domain=a.max_tokens or StudyConfig.tokens_per_domain,
                      text=str(a.text) if a.text else None)
    if cfg.tokens_per_domain < cfg.context:
        raise BadInput(f"--speculative scores windows of {cfg.context} tokens in each domain of the text; give "
                       f"--max-tokens {cfg.context} or more")
    text_segments(a.text or EVAL_TEXT, None)  # a bad text fails here, before the progress bar
    with progress_bar(unit="tok") as bar:  # phases: perplexity of every variant, then the generation test
        r = speculative_quality(a.model, cfg, a.predictors, phases(bar))
    print(f"speculative execution over {r['tokens']} tokens; baseline: the exact model "
          f"(ppl {r['ppl'][BASELINE]:.3f})\n")
    print("| predictor | ppl | increase [95% CI] | greedy tokens identical | first divergence (tokens) |")
    print("|---|---:|---:|---:|---:|")
    for name in a.predictors:
        label = f"speculative/{name}"
        gen = r["generation"][label]
        print(f"| {name} | {r['ppl'][label]:.3f} | {increase_text(r['increase'][label])} | "
              f"{gen['identical_token_share']:.1%} | {gen['mean_first_divergence']:.1f} |")
    write_json(a.json, r)
    return 0


def _stages(bar):
    """A `progress(stage, done, total)` that shows each stage's count on `bar`: recording's and the lookahead's
    tokens, training's epochs (a stage whose label changes within it, e.g. the loss, keeps counting)."""
    kind = [None]

    def progress(stage: str, done: int, total: int) -> None:
        unit = stage.split()[0]
        if unit != kind[0]:
            kind[0] = unit
            bar.reset(total=total)
            bar.unit = "tok" if unit in ("record", "ahead") else "epoch"
        bar.set_description(stage, refresh=False)
        bar.update(done)
    return progress
