"""expertcache ppl: teacher-forced perplexity of a text under the engine's cache and policy."""
from __future__ import annotations

from pathlib import Path

from ..engine.perplexity import EVAL_TEXT, perplexity
from ..lab.texts import read_text
from ..progress import progress_bar
from .options import add_engine_arguments, add_json_argument, engine_from_args, positive_int, write_json

HELP = "teacher-forced perplexity over a text file (default: the built-in evaluation text)"


def add_arguments(p):
    """The verb's options."""
    add_engine_arguments(p)
    p.add_argument("--text", type=Path, default=EVAL_TEXT, help="UTF-8 text file")
    p.add_argument("--context", type=positive_int, default=512, help="window length in tokens")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="score only the first N tokens")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    text = read_text(a.text)
    engine = engine_from_args(a)
    ids = engine.encode(text)[: a.max_tokens and a.max_tokens + 1]
    with progress_bar(total=len(ids) - 1, unit="tok", desc="ppl") as bar:
        r = perplexity(engine, ids, a.context, progress=bar.update)
    spread = f"± {r.stderr:.3f}" if r.tokens > 1 else "(one token: no standard error)"
    print(f"perplexity {r.ppl:.3f} {spread} over {r.tokens} tokens "
          f"({a.store}, cache {engine.cache.per_layer}/{engine.args.num_experts} per layer, {engine.policy})")
    print(engine.stats.line())
    write_json(a.json, {"text": str(a.text), "context": a.context, "policy": repr(engine.policy),
                        "store": a.store, "cache_fraction": a.cache, **r.to_dict(), "budget": engine.budget()})
    engine.close()
    return 0
