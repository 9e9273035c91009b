"""expertcache ppl: teacher-forced perplexity of a text under the engine's cache and policy."""
from __future__ import annotations

from pathlib import Path

from ..choices import EVAL_TEXT
from .options import add_engine_arguments, add_json_argument, engine_from_args, positive_int, write_json

HELP = "teacher-forced perplexity over a text file (default: the built-in evaluation text)"


def add_arguments(p):
    """The verb's options."""
    add_engine_arguments(p, prompts=False)
    p.add_argument("--text", type=Path, default=EVAL_TEXT, help="UTF-8 text file")
    p.add_argument("--context", type=positive_int, default=512, help="window length in tokens")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="score only the first N tokens (default: the whole text; the built-in one is 160,876 tokens, "
                        "about 40 min on 2 cores; Ctrl-C prints the perplexity so far)")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..engine.perplexity import perplexity
    from ..lab.texts import read_text
    from ..progress import progress_bar
    text = read_text(a.text)
    engine = engine_from_args(a, longest_prompt=a.context)  # a window is scored in one forward
    ids = engine.encode(text, max_tokens=a.max_tokens and a.max_tokens + 1)
    with progress_bar(total=len(ids) - 1, unit="tok", desc="ppl") as bar:
        r = perplexity(engine, ids, a.context, progress=bar.update, partial_on_interrupt=True)
    spread = f"± {r.stderr:.3f}" if r.tokens > 1 else "(one token: no standard error)"
    scored = f"{r.tokens} of {len(ids) - 1} tokens, interrupted" if r.interrupted else \
        f"{r.tokens} token{'s' * (r.tokens != 1)}"
    slots = engine.budget()["slots_per_layer_long_pass"]  # a window's: under a budget a decode's may be more
    print(f"perplexity {r.ppl:.3f} {spread} over {scored} "
          f"({a.store}, cache {slots}/{engine.args.num_experts} per layer, {engine.variant})")
    print(engine.stats.line())
    # the policy as --policy spells it, every option (its repr drops them: quality-first:beta=0 read quality-first)
    write_json(a.json, {"text": str(a.text), "context": a.context, "policy": engine.variant,
                        "eviction": engine.cache.cfg.eviction, "initial": "warm" if engine.warm_start else "cold",
                        "quota": engine.cache.cfg.quota, "slot_format": engine.slot_format.tag,
                        "store": a.store, "cache_fraction": slots / engine.args.num_experts,
                        **r.to_dict(), "budget": engine.budget()})
    engine.close()
    return 130 if r.interrupted else 0
