"""The API's request bodies and their checks: the OpenAI-style error, the completion and chat schemas, the
fields refused rather than ignored, and the bounds that keep one request from holding the server."""
from __future__ import annotations

import difflib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, field_validator, model_validator

from ..engine.sampling import MAX_LOGPROBS, short
from ..engine.structured import JSON_OBJECT, closed
from .tools import call_grammar

MAX_CHOICES = 16  # n: choices a prompt
MAX_GENERATIONS = 2048  # prompts x n in one request: more would hold the server for a single client
MAX_STOP = 16  # stop strings a request (OpenAI takes 4)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_FIELDS = 128  # fields of a body: each unknown one is checked for a misspelling, and 100,000 held the server
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's


class APIError(Exception):
    """An error answered with HTTP status `status` and an OpenAI-style body."""
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        """The OpenAI-style body {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """stream_options: include_usage (a last chunk carries the usage); vLLM's continuous_usage_stats (with
    include_usage, every chunk also carries its choice's usage so far); OpenAI's include_obfuscation, which pads
    chunks against a size side channel and changes no answer (no padding is added here). Another key is refused,
    not ignored."""
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False
    include_obfuscation: StrictBool | None = None


NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class OpenAIBody(BaseModel):
    """A request body as OpenAI's API takes one: fields of other APIs kept (each endpoint refuses or passes them on),
    a null read as the field's default."""
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if len(data) > MAX_FIELDS:
                raise ValueError(f"the body has {len(data)} fields; send at most {MAX_FIELDS}, those of the API")
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class SamplingFields(OpenAIBody):
    """Fields shared by both endpoints; top_k, min_p, repetition_penalty, stop_token_ids are extensions (as in
    vLLM). Fields that would change the output and are not implemented are refused (`refuse_unsupported`), not
    ignored. A null means the field's default, as in OpenAI's schema."""

    @field_validator(*NUMBERS, mode="before")
    @classmethod
    def _a_number(cls, value: Any, info) -> Any:  # a field's own check: its error's param names the field
        if isinstance(value, (bool, str)):  # pydantic reads true as 1.0 and "0.5" as 0.5: a client's mistake
            raise ValueError(f"{info.field_name} must be a number, not {json.dumps(value)}")
        return value
    model: str | None = None  # left out: the model served, as vLLM and llama-server take it (OpenAI requires it)
    max_tokens: StrictInt | None = None  # strict: a bool or a string is refused, not read as a number
    max_completion_tokens: StrictInt | None = None
    min_tokens: StrictInt = 0  # vLLM's: no end before this many tokens (benchmark clients fix output lengths with it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: StrictBool = False  # vLLM's: the text ends after the stop string it reached
    n: StrictInt = 1
    stream: StrictBool = False  # strict: pydantic reads "false" as false and "yes" as true
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    logprobs: StrictBool | StrictInt | None = None  # chat: true or false; completions: alternatives a token (0-20)
    top_logprobs: StrictInt | None = None  # chat, with logprobs true: alternatives a token (0-20)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    response_format: dict | None = None
    tool_choice: str | dict | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: ids that end the output as EOS does
    skip_special_tokens: StrictBool = True  # vLLM's: false keeps special tokens' text (GPT-OSS's <|channel|>...)
    # OpenAI's fields that change no answer, checked as OpenAI checks them: a client's mistake shows at once
    user: str | None = None
    metadata: dict | None = None
    service_tier: Literal[SERVICE_TIERS] | None = None

    @field_validator("metadata")
    @classmethod
    def _strings(cls, value: dict | None) -> dict | None:
        if value is not None and (len(value) > METADATA_KEYS or any(
                not isinstance(v, str) or len(k) > METADATA_KEY_CHARS or len(v) > METADATA_VALUE_CHARS
                for k, v in value.items())):
            raise ValueError(f"holds at most {METADATA_KEYS} keys of at most {METADATA_KEY_CHARS} characters, each "
                             f"with a string of at most {METADATA_VALUE_CHARS}")
        return value


class CompletionBody(SamplingFields):
    """A /v1/completions request: the sampling fields and a prompt (text or token ids), or a list of them (one
    choice each). echo puts the prompt before the completion, and with logprobs scores the prompt's tokens
    (then max_tokens may be 0), as evaluation harnesses ask."""
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # strict: [true] is no token id 1

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_form(cls, value: Any) -> Any:  # else pydantic names its union's branches (prompt.str, ...)
        forms = (lambda v: isinstance(v, str), _is_id, lambda v: isinstance(v, list) and all(map(_is_id, v)))
        if not (isinstance(value, str) or isinstance(value, list) and any(all(map(f, value)) for f in forms)):
            raise ValueError("must be a text, a list of texts, a list of token ids (integers) or a list of lists of "
                             "token ids")
        return value
    add_special_tokens: StrictBool = True  # vLLM's: false encodes a text prompt without the tokenizer's own (a BOS)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(BaseModel):
    """One message of a chat request: a role and its content (a string or text parts; only an assistant's
    may be absent, as when it called tools)."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    @model_validator(mode="after")
    def _known_role_with_content(self) -> ChatMessage:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatBody(SamplingFields):
    """A /v1/chat/completions request: the sampling fields and the conversation so far; add_generation_prompt
    (vLLM's, default true) false renders the conversation without the assistant turn's opening. tools go to the
    chat template, which writes them into the prompt (a call the model makes comes back in tool_calls where the
    template writes calls in a form tools.py or reasoning.py reads, else as its text), and so do
    chat_template_kwargs (vLLM's: e.g. {"enable_thinking": false}), and reasoning_effort (OpenAI's), which
    GPT-OSS's template writes into its system message; chat_template_kwargs' own reasoning_effort wins. The model's
    reasoning comes back in reasoning_content (reasoning.py), unless include_reasoning (vLLM's) is false, which leaves
    it out, or reasoning_format (llama.cpp's) is "none", which leaves the text as the model wrote it. documents
    (vLLM's and HF's, for retrieval) go to the template too; add_special_tokens (vLLM's) true adds the tokenizer's
    own (a BOS) to the rendered prompt, which holds the template's."""
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    tools: list[dict] | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call comes back
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: StrictBool = True
    documents: list[dict] | None = None
    add_special_tokens: StrictBool = False
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None  # None: the server's --reasoning-format

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's further arguments: reasoning_effort and documents where sent, then
        chat_template_kwargs."""
        given = {"reasoning_effort": self.reasoning_effort, "documents": self.documents}
        return {**{k: v for k, v in given.items() if v is not None}, **(self.chat_template_kwargs or {})}


class TokenizeBody(BaseModel):
    """A /tokenize request, as vLLM's: a prompt's token ids (with the tokenizer's special tokens, as a completion
    encodes it, unless add_special_tokens is false), or a conversation's through the chat template, as a chat
    completion renders it."""
    model_config = ConfigDict(extra="forbid")  # a misspelt field would tokenize something else silently
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: StrictBool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # as a chat completion passes them to the template
    documents: list[dict] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt (a text) or messages (a conversation)")
        return self


class DetokenizeBody(BaseModel):
    """A /detokenize request, as vLLM's: token ids -> their text."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


# Extra fields of OpenAI's, vLLM's and llama.cpp's APIs that would change the answer, with the value that would
# not: sent with another, they are refused rather than ignored. (echo is chat's here, vLLM's: it prepends the last
# message; completions declare their own.)
UNIMPLEMENTED = {"function_call": ("none", "auto"), "functions": ([],), "modalities": (["text"],), "audio": (),
                 "web_search_options": (),
                 "continue_final_message": (False,), "bad_words": ([],), "chat_template": (),
                 "allowed_token_ids": (), "logits_processors": ([],),
                 "typical_p": (1, 1.0), "mirostat": (0,), "repeat_penalty": (1, 1.0), "tfs_z": (1, 1.0),
                 "top_n_sigma": (-1, -1.0), "dry_multiplier": (0, 0.0), "xtc_probability": (0, 0.0),
                 "n_predict": (), "max_new_tokens": (), "prompt_logprobs": (), "truncate_prompt_tokens": (),
                 "length_penalty": (1, 1.0), "use_beam_search": (False,), "echo": (False,)}
INSTEAD = {"functions": "send them as tools", "function_call": "send tool_choice", "n_predict": "send max_tokens",
           "max_new_tokens": "send max_tokens", "chat_template": "the model's own template renders the chat"}


# vLLM's structured_outputs keys, and its guided_* fields (and llama.cpp's json_schema and grammar), as
# SamplingParams' fields
OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
GUIDED = {"guided_json": "json_schema", "json_schema": "json_schema", "guided_regex": "regex",
          "guided_choice": "choice", "guided_grammar": "grammar", "grammar": "grammar"}
# every field either endpoint reads or refuses by name: another extra field is a misspelling only where it is close
# to one of its own request's
KNOWN = {*UNIMPLEMENTED, *GUIDED, "structured_outputs", *CompletionBody.model_fields, *ChatBody.model_fields}


def refuse_misspelt(name: str, fields) -> None:
    """APIError where the extra field `name` is one of `fields` misspelt (temprature, top-p, Temperature): it would
    have been taken for another API's and ignored."""
    spelt = name.strip().lower().replace("-", "_")
    if near := difflib.get_close_matches(spelt, fields, 1, 0.85):
        raise APIError(400, f"{name} is not a field of this request; did you mean {near[0]}?", name)


def refuse_unsupported(body: SamplingFields) -> None:
    """APIError for a field this server does not implement and that would change the answer, or one that is a
    known field misspelt (temprature); fields that do not change it (user, tools the model may leave uncalled, ...)
    are accepted and ignored."""
    for name, value in (body.model_extra or {}).items():
        if name in UNIMPLEMENTED and value is not None and value not in UNIMPLEMENTED[name]:
            raise APIError(400, f"{name} is not supported by this server; {INSTEAD.get(name, 'leave it out')}",
                           name)
        if name not in KNOWN:
            refuse_misspelt(name, type(body).model_fields)
    unsupported = [  # chat's tool_choice is taken (structure)
        (body.tool_choice not in (None, "none", "auto") and not isinstance(body, ChatBody), "tool_choice",
         "a completion has no tools; leave it out"),
        (getattr(body, "best_of", None) not in (None, 1), "best_of", "use best_of=1"),
        (bool(getattr(body, "suffix", None)), "suffix", "leave it out"),
    ]
    for refused, name, fix in unsupported:
        if refused:
            raise APIError(400, f"{name} is not supported; {fix}", name)


def structure(body: SamplingFields) -> tuple[str | None, dict]:
    """What a body asks the output to follow, as (the body's field that asks it, SamplingParams' fields): OpenAI's
    response_format (nothing for {"type": "text"}, any JSON object for json_object, json_schema.schema for
    json_schema, whose name changes nothing (the schema is always followed) and whose strict true closes its objects,
    as OpenAI's does: no key beyond an object's listed properties unless the schema allows some; llama-server's schema
    beside either type); vLLM's guided_json, guided_regex, guided_choice, guided_grammar and structured_outputs;
    llama.cpp's json_schema and grammar (whose empty string asks nothing); a chat's tool_choice required or a named
    function (one call of a tool: tools.py). APIError for another format, for a text format given more than its
    type, or for two ways at once."""
    fmt, extra = body.response_format or {}, body.model_extra or {}
    kind = fmt.get("type", "text")
    asked = {name: {field: extra[name]} for name, field in GUIDED.items()
             if extra.get(name) is not None and not (name == "grammar" and extra[name] == "")}
    if (outputs := extra.get("structured_outputs")) is not None:  # one of json, regex, choice or grammar
        if not (isinstance(outputs, dict) and len(outputs) == 1 and set(outputs) <= set(OUTPUTS)):
            raise APIError(400, "structured_outputs is not supported by this server but as one of json, regex, "
                           "choice or grammar; leave it out", "structured_outputs")
        asked["structured_outputs"] = {OUTPUTS[key]: value for key, value in outputs.items()}
    if kind != "text":
        asked = {"response_format": {}, **asked}
    if isinstance(body, ChatBody):
        try:
            calls = call_grammar(body.tools, body.tool_choice)
        except ValueError as e:
            raise APIError(400, str(e), "tool_choice" if str(e).startswith("tool_choice") else "tools") from None
        if calls is not None:
            asked = {"tool_choice": {"grammar": calls}, **asked}
            # a stop inside the call cut it, and its tags came back as the reply's content
            if cut := next((name for name in ("stop", "stop_token_ids") if getattr(body, name)), None):
                forced = "required" if body.tool_choice == "required" else "naming a function"
                raise APIError(400, f"{cut} cannot be combined with tool_choice {forced}: the call decides where the "
                               f"output ends; leave {cut} out", cut)
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} each constrain the output; give one", list(asked)[1])
    if kind == "text" and (more := sorted(set(fmt) - {"type"})):  # a schema sent without its type was dropped
        given = f"type {kind!r}" if "type" in fmt else "no type (text)"
        raise APIError(400, f"response_format gives {', '.join(more)} with {given}, which takes nothing more; for a "
                       'schema send {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}',
                       "response_format")
    if asked and kind == "text":
        return next(iter(asked.items()))
    if kind == "text":
        return None, {}
    if kind == "json_object":  # llama-server's takes a schema beside the type
        return "response_format", {"json_schema": fmt["schema"] if isinstance(fmt.get("schema"), dict) else JSON_OBJECT}
    spec = fmt.get("json_schema")
    if kind == "json_schema" and isinstance(spec, dict) and not (isinstance(spec.get("name"), str) and spec["name"]):
        raise APIError(400, 'response_format json_schema needs its name, as OpenAI\'s does: {"type": "json_schema", '
                       '"json_schema": {"name": "...", "schema": {...}}}', "response_format")
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        return "response_format", {"json_schema": closed(spec["schema"]) if spec.get("strict") is True
                                   else spec["schema"]}
    if kind == "json_schema" and spec is None and isinstance(fmt.get("schema"), dict):  # llama-server's form
        return "response_format", {"json_schema": fmt["schema"]}
    if kind == "json_schema":
        raise APIError(400, 'response_format json_schema needs its schema: {"type": "json_schema", "json_schema": '
                       '{"name": "...", "schema": {...}}}', "response_format")
    raise APIError(400, f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                   "response_format")


def logit_bias_pairs(body: SamplingFields, vocab: int) -> tuple[tuple[int, float], ...]:
    """The body's logit_bias, OpenAI's map of token ids (as strings) to biases in [-100, 100], as SamplingParams
    takes it; APIError for a key that is not a token id of the vocabulary or a value that is not such a number."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        digits = key.strip()  # read only as long as a token id: int() of 4,301 digits (zeros too) is a ValueError
        is_id = digits.isascii() and digits.isdigit() and len(digits.lstrip("0")) <= len(str(vocab))
        token = int(digits.lstrip("0") or "0") if is_id else -1
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias key {short(key)} is not a token id; keys are token ids in [0, {vocab}) "
                           "written as strings, e.g. {\"42\": -100}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias value {bias!r} for token {key} must be a number in [-100, 100]",
                           "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def logprobs_count(body: SamplingFields, chat: bool) -> int | None:
    """Alternatives to report a token (SamplingParams.logprobs), or None when the body asks for no logprobs:
    chat asks with logprobs: true and top_logprobs: N, completions with logprobs: N."""
    if chat:
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise APIError(400, "logprobs is true or false in chat completions; top_logprobs: N asks for "
                           "alternatives", "logprobs")
        if body.top_logprobs and not body.logprobs:  # 0 asks for nothing, as some clients send by default
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        n, param = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    else:
        if body.top_logprobs is not None:  # refused, not ignored, as every field that would change the answer
            raise APIError(400, "top_logprobs is chat's field; completions take logprobs: N (alternatives a token)",
                           "top_logprobs")
        if isinstance(body.logprobs, bool):
            raise APIError(400, "logprobs in completions is how many alternatives to list for each token (0 to "
                           f"{MAX_LOGPROBS}, e.g. logprobs: 1), not true or false", "logprobs")
        n, param = body.logprobs, "logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise APIError(400, f"{param}={n} must be in [0, {MAX_LOGPROBS}]", param)
    return n


# content parts read as text, by the field that holds it: an assistant's refusal comes back so when a client sends
# the conversation again (the openai client's types allow it), and vLLM reads it as text
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def message_text(message: ChatMessage, index: int) -> dict:
    """A message (messages[index]) as the template sees it: its fields as sent (a tool call's, a name), content
    parts of type text (or an assistant's refusal) joined by newlines, as vLLM joins them. APIError for another
    part, or an assistant's tool_calls that are not OpenAI's list of calls."""
    where, content = f"messages[{index}]", message.content
    if isinstance(content, list):
        for part in content:
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise APIError(400, f"{where}: a content part of type {json.dumps(kind)[:60]} is not supported here: "
                               f"this server reads text only ({', '.join(TEXT_PARTS)}); send the text as such a part",
                               "messages")
            if not isinstance(part.get(TEXT_PARTS[kind]), str):
                raise APIError(400, f"{where}: a {kind} content part needs its {TEXT_PARTS[kind]} as a string",
                               "messages")
        content = "\n".join(part[TEXT_PARTS[part["type"]]] for part in content)
    extra = message.model_extra or {}
    calls = extra.get("tool_calls")
    if calls is not None:  # the template writes each call's name and arguments
        if not isinstance(calls, list) or not all(isinstance(c, dict) and _is_call(c.get("function")) for c in calls):
            raise APIError(400, f'{where}: tool_calls must be a list of calls {{"id": "...", "type": "function", '
                           '"function": {"name": "...", "arguments": "{...}"}}', "messages")
    return {**extra, "role": message.role, "content": content or ""}


def _is_call(function: Any) -> bool:
    """Whether a tool call's function object names its function and gives its arguments (JSON text, or the
    object some clients send)."""
    return isinstance(function, dict) and isinstance(function.get("name"), str) and \
        isinstance(function.get("arguments", "{}"), (str, dict))


def checked_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """The stop strings of a body; APIError beyond MAX_STOP of them or MAX_STOP_CHARS characters each (each
    token's text is matched against every one)."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stop) > MAX_STOP:
        raise APIError(400, f"{len(stop)} stop strings; send at most {MAX_STOP}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"a stop string is over {MAX_STOP_CHARS} characters; shorten it", "stop")
    return stop
