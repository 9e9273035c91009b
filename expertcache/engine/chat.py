"""Chat templates: the checkpoint's chat_template.jinja or tokenizer_config.json `chat_template`, rendered with
jinja2 the way HF transformers renders it (sandboxed, trim_blocks, lstrip_blocks, its `tojson` that does not escape
HTML, `dict`, `raise_exception`, `strftime_now`, the `{% generation %}` block, bos/eos tokens from the tokenizer
config)."""
from __future__ import annotations

import ctypes
import json
import threading
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import BadInput, CheckpointError
from .engine import Engine
from .generate import tokenizer_config


RENDER_SECONDS = 10.0  # a template still rendering after this loops past any conversation's need (a real one: ms)


class ChatTemplateError(BadInput):
    """The template rejected the messages (its raise_exception) or failed to render."""


class _RenderTooLong(Exception):
    """Raised in the rendering thread once RENDER_SECONDS have passed."""


def _within_render_seconds(render):
    """render() -> its text, or ChatTemplateError once it has run RENDER_SECONDS. A template is code of the
    checkpoint's, and the sandbox bounds each `range` but not loops within loops, which ran for ever (a request's
    template arguments can drive one, and a server thread would be lost to it): a timer raises in this thread, as
    Ctrl-C would, between two of the template's Python steps."""
    thread, state, lock = threading.get_ident(), {"rendering": True}, threading.Lock()

    def stop():
        with lock:  # never once render has returned: the exception would land in whatever this thread ran next
            if state["rendering"]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_RenderTooLong))
    timer = threading.Timer(RENDER_SECONDS, stop)
    timer.daemon = True
    timer.start()
    try:
        try:
            return render()
        finally:
            with lock:
                state["rendering"] = False
            timer.cancel()  # a call: where a pending exception lands at the latest, still within the outer try
    except _RenderTooLong:
        raise ChatTemplateError(f"the chat template was still rendering after {RENDER_SECONDS:g} s: it loops past "
                                "what any conversation needs; fix it in chat_template.jinja or tokenizer_config.json, "
                                "or use plain completions (`expertcache generate`, /v1/completions)") from None


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused these messages: {message}")  # its words alone named no source


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """HF's tojson: plain JSON (jinja's own escapes <, >, & and ' for HTML, which would change a tool's schema in
    the prompt)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which HF's templates use to mark the assistant's tokens for
    training masks: rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, by the names clients use


def _with_reasoning_aliases(message: dict) -> dict:
    """A message whose reasoning comes under any of its names carries it under reasoning_content (what most
    templates read) and thinking (GPT-OSS's), as HF's apply_chat_template passes it."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _token_text(token) -> str:
    return (token.get("content") if isinstance(token, dict) else token) or ""


RESERVED = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}  # what render itself passes


class ChatTemplate:
    """messages [{"role", "content"}] -> prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _Generation])
        env.filters["tojson"] = _tojson
        env.globals["dict"] = dict
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"the chat template does not parse ({e}); fix it in chat_template.jinja or "
                                  "tokenizer_config.json, or use plain completions (`expertcache generate`, "
                                  "/v1/completions)") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def of(cls, engine: Engine) -> ChatTemplate:
        """The engine's checkpoint template, where HF looks for it: chat_template.jinja (what transformers 5
        saves), else tokenizer_config.json's or chat_template.json's chat_template; CheckpointError when
        there is none."""
        cfg = tokenizer_config(engine)
        jinja = engine.checkpoint.path / "chat_template.jinja"
        try:
            source = jinja.read_text(encoding="utf-8") if jinja.exists() else \
                cfg.get("chat_template") or engine.checkpoint.side_json("chat_template.json").get("chat_template")
        except UnicodeDecodeError:
            raise CheckpointError(f"{jinja} is not UTF-8 text; restore it from the model's release") from None
        if isinstance(source, list):  # named templates: HF picks "default"
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not source or not isinstance(source, str):
            raise CheckpointError(f"{engine.path}: no chat template (chat_template.jinja, or chat_template in "
                                  "tokenizer_config.json); add one or use plain completions (`expertcache generate`, "
                                  "/v1/completions)")
        return cls(source, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               kwargs: dict | None = None) -> str:
        """Render the conversation, as HF's apply_chat_template does: with the tools the model may call (the
        template writes them into the prompt) and the template's own keyword arguments (e.g. Qwen3's
        enable_thinking); ChatTemplateError when the template rejects it, or for a keyword it reserves."""
        kwargs = kwargs or {}
        taken = sorted(RESERVED & kwargs.keys())
        if taken:
            raise ChatTemplateError(f"chat template arguments {', '.join(taken)} are set by the server; "
                                    "send them as fields of the request, or leave them out")
        messages = [_with_reasoning_aliases(m) for m in messages]
        try:
            return _within_render_seconds(lambda: self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs))
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 -- a template is code of the checkpoint's, run on the request's fields
            raise ChatTemplateError(f"chat template failed on these messages ({type(e).__name__}: {e})") from None


def encode_chat(engine: Engine, template: ChatTemplate, messages: list[dict],
                add_generation_prompt: bool = True) -> list[int]:
    """Messages -> prompt ids (the template writes any special tokens itself, as in HF); BadInput for text that
    is not UTF-8."""
    return engine.encode(template.render(messages, add_generation_prompt), special=False)
