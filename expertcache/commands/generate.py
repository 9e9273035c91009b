"""expertcache generate: prompt -> streamed text, then a statistics line."""
from __future__ import annotations

import sys
from pathlib import Path

from ..engine.generate import generate
from .options import add_engine_arguments, engine_from_args, write_json

HELP = "generate text from a prompt, streamed, with cache statistics"


def add_arguments(p):
    add_engine_arguments(p)
    p.add_argument("prompt", nargs="?", default="ROMEO.\n", help="prompt text")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write statistics as JSON")


def run(a) -> int:
    engine = engine_from_args(a)
    prompt = engine.encode(a.prompt)
    sys.stdout.write(a.prompt)
    out: list[int] = []
    shown = ""
    for token in generate(engine, prompt, a.max_new_tokens, a.temperature, a.seed):
        out.append(token)
        text = engine.decode(out)  # decode the whole tail: byte-level tokens may split characters
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    print(f"\n[{engine.config.store}, cache {engine.cache.per_layer}/{engine.args.num_experts} per layer, "
          f"{engine.policy}] {engine.stats.line()}", file=sys.stderr)
    write_json(a.json, {"prompt": a.prompt, "text": shown, "tokens": out, "stats": engine.stats.to_dict(),
                        "budget": engine.budget()})
    engine.close()
    return 0
