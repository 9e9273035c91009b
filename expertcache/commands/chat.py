"""expertcache chat: an interactive conversation through the checkpoint's chat template;
one user message per stdin line, the reply streamed (a reasoning model's reasoning to stderr, its answer to
stdout); the expert cache stays warm across turns, and the keys and values of the conversation so far are kept:
a turn's prefill runs only what its prompt adds to the tokens before it."""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.chat import ChatTemplate

from ..errors import BadInput
from .generate import add_sampling_arguments, check_fits, sampling_from_args
from .options import add_engine_arguments, command_text, engine_from_args

EXIT = ("/exit", "/quit")
HELP = "chat with the model: one message per stdin line, replies streamed (uses the chat template); /exit or /quit leaves"


def add_arguments(p):
    """The verb's options."""
    add_engine_arguments(p)
    p.add_argument("--system", default=None, type=command_text, help="a system message that starts the conversation")
    add_sampling_arguments(p, max_tokens=128)


def fitting_prompt(engine, template: ChatTemplate, messages: list[dict], max_tokens: int) -> list[int]:
    """The conversation's prompt ids, which leave room for a reply of max_tokens within --max-seq: when they would
    not, the oldest exchanges (after a system message) are dropped from `messages` until they do, and stderr says
    so. BadInput naming -n and --max-seq, `messages` untouched, for a last message too long to fit even alone:
    dropping the others for it lost the conversation."""
    from ..engine.chat import encode_chat
    first = 1 if messages and messages[0]["role"] == "system" else 0
    prompt, dropped = encode_chat(engine, template, messages), 0
    if len(prompt) + max_tokens > engine.model.max_seq:
        check_fits(engine, len(encode_chat(engine, template, messages[:first] + messages[-1:])), max_tokens)
    while len(prompt) + max_tokens > engine.model.max_seq and len(messages) - first > 1:
        del messages[first:first + 2]  # a user message and its reply
        dropped += 1
        prompt = encode_chat(engine, template, messages)
    if dropped:
        print(f"[the oldest {dropped} exchange(s) left the context to fit --max-seq {engine.model.max_seq}]",
              file=sys.stderr)
    return prompt


def reusable(engine, held: list[int], prompt: list[int]) -> int:
    """How many of `prompt`'s first tokens the engine's cache holds already: those it shares with `held`, the
    tokens whose keys and values it holds from position 0 (at least one is left to run). A model with a recurrent
    state (linear attention) holds it for all of `held`, which cannot be cut back: only a prompt that extends
    `held` reuses it."""
    shared = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
    shared = min(shared, len(prompt) - 1)
    return 0 if engine.model.linear and shared < len(held) else shared


def show(delta: dict, thought: list[str], answer: list[str]) -> None:
    """A reply's new text: its reasoning to stderr, its answer to stdout (each kept in its list)."""
    if text := delta.get("reasoning_content"):
        sys.stderr.write(text)
        sys.stderr.flush()
        thought.append(text)
    if text := delta.get("content"):
        if thought and not answer:  # the answer on a line of its own, after the reasoning
            sys.stderr.write("\n")
        sys.stdout.write(text)
        sys.stdout.flush()
        answer.append(text)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..engine.chat import ChatTemplate
    from ..engine.checkpoint import model_name
    from ..engine.generate import TextGeneration, check_token_ids
    from ..serve.reasoning import Reply, opens_thinking, reply_form
    params = sampling_from_args(a)
    engine = engine_from_args(a)
    check_token_ids(engine, params)  # once, here: refused with every message, no conversation could go on
    if params.max_tokens >= engine.model.max_seq:
        raise BadInput(f"-n {params.max_tokens} leaves no room for a message in --max-seq {engine.model.max_seq}; "
                       "lower -n")
    template = ChatTemplate.of(engine)
    form = reply_form(template.source)
    if form == "harmony":  # its parts are told apart by special tokens, which the reply leaves out
        params = replace(params, skip_special_tokens=False)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    interactive, refused = sys.stdin.isatty(), 0
    held: list[int] = []  # the tokens whose keys and values the engine's cache holds, from position 0
    name = model_name(engine.path) if a.model else "the built-in model"
    print(f"expertcache chat: {name} ({engine.config.store} store, cache {engine.cache.per_layer}/"
          f"{engine.args.num_experts} per layer, {engine.variant}); /exit, /quit, Ctrl-D or Ctrl-C at the prompt to "
          "leave, Ctrl-C during a reply to stop it", file=sys.stderr)
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            break
        if not line or line.strip() in EXIT:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\r\n")})  # a Windows line ends in \r\n
        try:  # a message refused (too long, or by the template) is left out, and the conversation goes on
            prompt = fitting_prompt(engine, template, messages, params.max_tokens)
            gen = TextGeneration(engine, prompt, params, cached=reusable(engine, held, prompt))
        except BadInput as e:
            messages.pop()
            refused += 1
            print(f"expertcache: error: {e} (the message is left out; the conversation goes on)", file=sys.stderr)
            continue
        opened = False if params.constrained else opens_thinking(engine.decode(prompt[-16:]))  # as the server
        reply, thought, answer = Reply(form, opened=opened), [], []
        try:
            for out in gen:
                show(reply.feed(out.text), thought, answer)
        except KeyboardInterrupt:  # stops this reply; the conversation goes on with what it said so far
            sys.stdout.write(" [stopped]")
            if engine.model.linear:  # its recurrent state may have been cut mid-forward
                gen.kv_end = 0
        held = (prompt + gen.tokens)[:gen.kv_end]
        show(reply.end()[0], thought, answer)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
    if engine.stats.tokens:  # a session that said nothing has no statistics to report
        print(f"[{engine.variant}] the session, prompts and replies: {engine.stats.line()}", file=sys.stderr)
    engine.close()
    return 2 if refused else 0  # a script piping messages in learns that one was not answered
