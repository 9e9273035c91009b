"""expertcache generate: prompt -> streamed text until EOS or the token limit, then a statistics line."""
from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BadInput

if TYPE_CHECKING:
    from ..engine.sampling import SamplingParams
from .options import add_engine_arguments, command_text, engine_from_args, json_output, write_json

HELP = "generate text from a prompt, streamed, with cache statistics"
DEFAULT_PROMPT = "ROMEO.\n"


# the CLI flag of each SamplingParams field, for errors raised from the command line
FLAGS = {"max_tokens": "-n/--max-new-tokens", "min_tokens": "--min-new-tokens", "temperature": "--temperature",
         "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
         "logit_bias": "--logit-bias", "seed": "--seed", "stop": "--stop", "json_schema": "--json-schema",
         "grammar": "--grammar"}


def add_sampling_arguments(p, max_tokens: int = 64) -> None:
    """The sampling flags shared by generate and chat."""
    p.add_argument("-n", "--max-new-tokens", type=int, default=max_tokens, help="most tokens to generate")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="fewest tokens to generate: no end-of-sequence token or stop string ends the text before")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: no limit")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 disables it")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of each token the output has (OpenAI's; -2..2, 0 disables it)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once for each time the output has a token (OpenAI's; -2..2, 0 disables it)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100..100) to a token's logit before sampling (repeatable; -100 bans it)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], type=command_text, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="the output is a JSON value of this JSON schema (its JSON text, or a file holding it), e.g. "
                        "'{\"type\": \"object\"}'; it ends where the value is complete")
    p.add_argument("--grammar", default=None, metavar="GRAMMAR",
                   help="the output is a sentence of this context-free grammar, in llama.cpp's GBNF or llguidance's "
                        "Lark syntax (its text, or a file holding it), e.g. 'root ::= \"yes\" | \"no\"'")


def sampling_from_args(a) -> SamplingParams:
    """The SamplingParams that the sampling flags ask for; a value out of range is named by its flag."""
    from ..engine.sampling import SamplingError, SamplingParams
    try:
        return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                              repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                              frequency_penalty=a.frequency_penalty, logit_bias=logit_bias_flags(a.logit_bias),
                              seed=a.seed, max_tokens=a.max_new_tokens, min_tokens=a.min_new_tokens,
                              stop=tuple(a.stop), ignore_eos=a.ignore_eos, json_schema=schema_flag(a.json_schema),
                              grammar=grammar_flag(a.grammar))
    except SamplingError as e:
        flag = FLAGS.get(e.param, e.param)
        message = str(e).replace(f"{e.param}=", f"{flag} ", 1).replace(" (0 only when scoring the prompt)", "") \
            .replace("max_tokens (", "-n (")
        if "each constrain the output" in message:  # two constraints, named by their fields
            message = message.replace("json_schema", FLAGS["json_schema"]).replace("grammar", FLAGS["grammar"])
        raise BadInput(f"--json-schema: {message}" if e.param == "json_schema" else message) from None


def schema_flag(flag: str | None) -> str | None:
    """--json-schema's JSON text, or the text of the file it names."""
    if flag is None or flag.lstrip().startswith("{"):
        return flag
    from ..lab.texts import read_bounded
    try:
        with open(flag, "rb") as f:
            return read_bounded(f, f"--json-schema {flag}").decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--json-schema {flag!r} is neither a JSON schema nor a readable file ({e}); give the schema "
                       "as JSON, e.g. '{\"type\": \"object\"}'") from None


def grammar_flag(flag: str | None) -> str | None:
    """--grammar's text, or the text of the file it names."""
    try:
        named = flag is not None and Path(flag).is_file()
    except (OSError, ValueError):  # a grammar too long to be a file name, or one holding a NUL
        named = False
    if not named:
        return flag
    try:
        return Path(flag).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--grammar {flag!r} cannot be read ({e}); give the grammar itself or a readable file") \
            from None


def logit_bias_flags(flags: list[str]) -> tuple[tuple[int, float], ...]:
    """--logit-bias TOKEN_ID=BIAS flags as SamplingParams takes them; BadInput for one not of that form."""
    pairs = []
    for flag in flags:
        token, _, bias = flag.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise BadInput(f"--logit-bias {flag!r} is not TOKEN_ID=BIAS; write e.g. --logit-bias 42=-100") from None
    return tuple(pairs)


def check_fits(engine, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse, naming the CLI flags, a prompt and -n that outgrow --max-seq; a higher --max-seq is named as a fix
    only up to the model's context (past it, --max-seq is refused)."""
    from ..engine.engine import max_seq_limit
    max_seq, limit = engine.model.max_seq, max_seq_limit(engine.args)
    if prompt_len + max_new_tokens > max_seq:
        tokens = f"over {max_seq}" if prompt_len > max_seq else prompt_len
        room = f", or raise --max-seq (at most {limit}, the model's context)" if max_seq < limit else \
            f" (--max-seq {max_seq} is the model's whole context)"
        raise BadInput(f"the prompt ({tokens} tokens) + -n {max_new_tokens} exceed --max-seq {max_seq}; lower -n or "
                       f"shorten the prompt{room}")


def add_arguments(p):
    """The verb's options."""
    add_engine_arguments(p)
    p.add_argument("prompt", nargs="?", default=None, type=command_text,
                   help=f"prompt text (or use -p; default: {DEFAULT_PROMPT!r})")
    p.add_argument("-p", "--prompt", dest="prompt_option", default=None, type=command_text,
                   help="prompt text; '-' reads it from stdin (also read when stdin is not a terminal)")
    add_sampling_arguments(p)
    p.add_argument("--json", type=json_output, default=None, help="write statistics as JSON to FILE (- for stdout)")


def prompt_text(a) -> str:
    """The prompt, given by -p or as the argument; '-' or a piped stdin without a prompt reads stdin. Without
    any (no prompt, nothing piped) it is the default prompt; an empty prompt asked for is an error."""
    if a.prompt_option is not None and a.prompt is not None:
        raise BadInput(f"two prompts given (-p {a.prompt_option!r} and {a.prompt!r}); give one, quoting it if it "
                       "has spaces")
    given = a.prompt_option if a.prompt_option is not None else a.prompt
    text = given
    if given == "-" or (given is None and not sys.stdin.isatty()):  # its bytes as read (surrogateescape), checked
        # as a --text file's are
        from ..lab.texts import read_bounded, utf8_text
        source = "the prompt read from stdin"
        raw = getattr(sys.stdin, "buffer", None)  # a test's StringIO has none
        if given is None and raw is not None and not _readable_soon(raw):  # an open pipe (an IDE's, a job's) waits
            print("reading the prompt from stdin until it ends (give -p PROMPT to pass one)", file=sys.stderr)
        data = read_bounded(raw, source) if raw is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        text = utf8_text(data, source)
    if not text and given is not None:  # asked for explicitly, so the default prompt would be a silent substitute
        raise BadInput("the prompt is empty; give some text (or no prompt at all for the default one)")
    return text or DEFAULT_PROMPT


def _readable_soon(stream, seconds: float = 1.0) -> bool:
    """Whether `stream` has something to read (or its end) within `seconds`; True where it cannot be asked."""
    import select
    try:
        return bool(select.select([stream], [], [], seconds)[0])
    except (OSError, ValueError, io.UnsupportedOperation):
        return True


def prompt_tokens_ahead(model: str | None, text: str) -> int:
    """The prompt's tokens by the model's own tokenizer (at most a full pass's: past that the passes are whole),
    counted before the engine loads so that a memory budget plans its forward passes for them
    (EngineConfig.longest_prompt; a prompt longer than this would only take more passes). A Hub id's tokenizer
    comes with its weights, and a folder without a readable one is the engine's to report: there, a bound from the
    text's bytes (a token holds at least one, and a tokenizer adds a few of its own: a BOS, a leading space)."""
    from ..choices import BUILTIN_MODEL
    from ..engine.budget import FORWARD_CHUNK
    from ..engine.checkpoint import encode_prefix, is_hub_id, read_tokenizer
    bound = len(text.encode("utf-8", "surrogatepass")) + 8
    if model is not None and is_hub_id(model):
        return bound
    file = (BUILTIN_MODEL if model is None else Path(model).expanduser()) / "tokenizer.json"
    try:
        tokenizer = read_tokenizer(file)  # the engine's own, read once
        ids = encode_prefix(lambda t: tokenizer.encode(t, add_special_tokens=True).ids, text, FORWARD_CHUNK)
    except Exception:  # noqa: BLE001 -- the binding raises a bare Exception; the engine names the file in one line
        return bound
    return max(len(ids), 1)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..engine.compile_clock import compile_seconds
    from ..engine.generate import TextGeneration
    params = sampling_from_args(a)
    text = prompt_text(a)
    engine = engine_from_args(a, longest_prompt=prompt_tokens_ahead(a.model, text))
    prompt = engine.encode(text, max_tokens=engine.model.max_seq + 1)  # a piped file is not tokenized whole
    check_fits(engine, len(prompt), params.max_tokens)
    gen = TextGeneration(engine, prompt, params)
    shown, steps, start, compiled = [], 0, time.perf_counter(), compile_seconds()
    for out in gen:
        if steps == 0:  # the prefill, and the first token sampled from its logits; less a first run's compiling
            first = time.perf_counter() - (compile_seconds() - compiled)
            # the prompt echoed with the first token, not before a first run's minutes of compiling the prefill's
            # and decode's kernels, where the echo alone read as a generation that hung
            sys.stdout.write(text)
        steps += 1
        sys.stdout.write(out.text)
        sys.stdout.flush()
        shown.append(out.text)
    end = time.perf_counter() - (compile_seconds() - compiled)
    if not (text + "".join(shown)).endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    timing = {"prompt_tokens": len(prompt), "prefill_s": first - start, "generated_tokens": len(gen.tokens),
              "decode_steps": steps - 1, "decode_s": end - first}
    print(f"[{engine.config.store}, cache {engine.cache.per_layer}/{engine.args.num_experts} per layer, "
          f"{engine.variant}] finish: {gen.finish_reason}\n{speed_line(timing)}\ncache: {engine.stats.line(speed=False)}",
          file=sys.stderr)
    write_json(a.json, {"prompt": text, "text": "".join(shown), "tokens": gen.tokens,
                        "finish_reason": gen.finish_reason, "policy": engine.variant, "store": engine.config.store,
                        "cache_per_layer": engine.cache.per_layer, **timing, "stats": engine.stats.to_dict(),
                        "budget": engine.budget()})
    engine.close()
    return 0


def speed_line(t: dict) -> str:
    """Prefill and generation apart, as llama.cpp and `ollama --verbose` report them: the prompt's tokens over the
    prefill's time (which samples the first new token), and the decode steps that produced the other tokens."""
    def rate(n: int, s: float) -> str:
        return f"{n / s:.1f} tok/s" if n and s > 0 else "-"
    return (f"prefill: {t['prompt_tokens']} prompt tokens in {1e3 * t['prefill_s']:.1f} ms "
            f"({rate(t['prompt_tokens'], t['prefill_s'])}); generation: {t['generated_tokens']} tokens, "
            f"{t['decode_steps']} decode steps in {1e3 * t['decode_s']:.1f} ms ({rate(t['decode_steps'], t['decode_s'])})")
