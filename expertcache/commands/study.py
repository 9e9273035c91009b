"""expertcache study: the emulation study of the miss policies (report, plots, JSON)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..choices import EVAL_TEXT
from ..errors import BadInput
from .options import (
    add_json_argument,
    add_model_argument,
    add_text_arguments,
    announce_compile,
    fraction,
    output_dir,
    positive_int,
    write_json,
)

HELP = "emulate every miss policy on a text (exact, ram store) and write the report"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    p.add_argument("--cache", type=fraction, default=0.25, help="cache size as a fraction of each layer's experts")
    p.add_argument("--tokens-per-domain", type=positive_int, default=4096,
                   help="evaluation tokens taken from each domain of the text")
    p.add_argument("--context", type=positive_int, default=512, help="window length in tokens")
    p.add_argument("--policies", nargs="+", default=None, help="policy specs (default: the full set)")
    add_text_arguments(p)
    p.add_argument("--out", type=output_dir, default=Path("study"), help="report folder")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    announce_compile()
    from ..lab.plots import require
    from ..lab.report import write_report
    from ..lab.study import StudyConfig, run_study
    from ..lab.texts import text_segments
    from ..policies import make_policy
    from ..progress import phases, progress_bar
    if a.tokens_per_domain < a.context:  # before the model loads
        raise BadInput(f"--tokens-per-domain {a.tokens_per_domain} holds no window of --context {a.context} tokens; "
                       "raise the one or lower the other")
    cfg = StudyConfig(cache_fraction=a.cache, tokens_per_domain=a.tokens_per_domain, context=a.context,
                      text=str(a.text) if a.text else None, domains=a.domains or ())
    if a.policies:
        for spec in a.policies:  # a bad name fails here, before the baseline runs
            make_policy(spec)
        chosen = tuple(dict.fromkeys(["fetch-all", *a.policies]))  # the generation test too runs only these
        cfg = StudyConfig(**{**cfg.__dict__, "policies": chosen, "generation_policies": chosen})
    text_segments(a.text or EVAL_TEXT, a.domains or None)  # a bad text fails here, before the progress bar
    try:
        require()  # the report's plots: before the run, not after it
    except BadInput:  # its own words name --plot, which study does not have: its report always has plots
        raise BadInput("the study's report draws plots with matplotlib, which this install lacks: "
                       "pip install 'expertcache[study]'") from None
    with progress_bar(unit="tok") as bar:  # phases: perplexity of every policy, then the generation test
        res = run_study(a.model, cfg, phases(bar))
    files = write_report(res, a.out)
    write_json(a.json, res.to_dict())
    print((a.out / "README.md").read_text())
    print("wrote " + ", ".join(map(str, files)), file=sys.stderr)
    if res.not_run:  # Ctrl-C past the baseline and a policy: the report of what ran, and the exit code of an interrupt
        print(f"interrupted: the report holds what ran; not run: {', '.join(res.not_run)}", file=sys.stderr)
        return 130
    return 0
