"""expertcache generate: prompt -> streamed text until EOS or the token limit, then a statistics line."""
from __future__ import annotations

import sys

from ..engine.generate import TextGeneration
from ..engine.sampling import SamplingParams
from ..errors import BadInput
from .options import add_engine_arguments, engine_from_args, output_path, write_json

HELP = "generate text from a prompt, streamed, with cache statistics"
DEFAULT_PROMPT = "ROMEO.\n"


def add_sampling_arguments(p, max_tokens: int = 64) -> None:
    """The sampling flags shared by generate and chat."""
    p.add_argument("-n", "--max-new-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no limit")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def sampling_from_args(a) -> SamplingParams:
    """The SamplingParams that the sampling flags ask for."""
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          repetition_penalty=a.repetition_penalty, seed=a.seed, max_tokens=a.max_new_tokens,
                          stop=tuple(a.stop), ignore_eos=a.ignore_eos)


def add_arguments(p):
    """The verb's options."""
    add_engine_arguments(p)
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (or use -p)")
    p.add_argument("-p", "--prompt", dest="prompt_option", default=None,
                   help="prompt text; '-' reads it from stdin (also read when stdin is not a terminal)")
    add_sampling_arguments(p)
    p.add_argument("--json", type=output_path, default=None, help="write statistics as JSON")


def prompt_text(a) -> str:
    """The prompt, given by -p or as the argument; '-' or a piped stdin without a prompt reads stdin. Without
    any (no prompt, nothing piped) it is the default prompt; an empty prompt asked for is an error."""
    if a.prompt_option is not None and a.prompt is not None:
        raise BadInput(f"two prompts given (-p {a.prompt_option!r} and {a.prompt!r}); give one, quoting it if it "
                       "has spaces")
    given = a.prompt_option if a.prompt_option is not None else a.prompt
    text = sys.stdin.read() if given == "-" or (given is None and not sys.stdin.isatty()) else given
    if not text and given is not None:  # asked for explicitly, so the default prompt would be a silent substitute
        raise BadInput("the prompt is empty; give some text (or no prompt at all for the default one)")
    return text or DEFAULT_PROMPT


def run(a) -> int:
    """Run the verb; returns the exit code."""
    params = sampling_from_args(a)
    text = prompt_text(a)
    engine = engine_from_args(a)
    gen = TextGeneration(engine, engine.encode(text), params)
    sys.stdout.write(text)
    shown = []
    for out in gen:
        sys.stdout.write(out.text)
        sys.stdout.flush()
        shown.append(out.text)
    print(f"\n[{engine.config.store}, cache {engine.cache.per_layer}/{engine.args.num_experts} per layer, "
          f"{engine.policy}] finish: {gen.finish_reason}; {engine.stats.line()}", file=sys.stderr)
    write_json(a.json, {"prompt": text, "text": "".join(shown), "tokens": gen.tokens,
                        "finish_reason": gen.finish_reason, "stats": engine.stats.to_dict(),
                        "budget": engine.budget()})
    engine.close()
    return 0
