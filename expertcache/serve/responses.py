"""OpenAI's Responses API (/v1/responses) over the chat path: a request's instructions and input items become a
chat's messages, its function tools, tool_choice, text format and reasoning effort the chat's own fields, and the
chat's answer (whole, or its stream's chunks) becomes a response object (or the Responses stream's typed events).
Every check a chat makes is made on the request so translated, its errors naming the Responses fields. The server
keeps the last responses asked to be stored (store: true, OpenAI's default; KeptResponses), so that a request may
continue one by previous_response_id and GET /v1/responses/{id} returns it; a conversation, an item_reference and
background runs are refused."""
from __future__ import annotations

import difflib
import gc
import json
import re
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from itertools import compress
from typing import Any, Literal

from pydantic import StrictBool, StrictInt, field_validator

from .schemas import (METADATA_KEY_CHARS, METADATA_KEYS, METADATA_VALUE_CHARS, SERVICE_TIERS, APIError, OpenAIBody,
                      refuse_misspelt)

# what a Responses body holds that the chat path has under another name, and where an error's param points then
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text", "reasoning_effort": "reasoning"}
# the chat's own fields a Responses body does not take, and what it sends instead
CHAT_ONLY = {"messages": "send input", "max_tokens": "send max_output_tokens",
             "max_completion_tokens": "send max_output_tokens", "response_format": "send text.format",
             "n": "send one request per answer", "logprobs": "leave it out"}
# fields of OpenAI's that need conversations kept on the server, or hosted prompts
KEPT = {"conversation": "send it in input, or continue a response by previous_response_id",
        "prompt": "send the prompt's text in instructions and input"}
# include values that change nothing here (the reasoning comes back as text, not encrypted)
INCLUDED = ("reasoning.encrypted_content",)
# the keys of the objects a request nests, as the Responses API names them: another is a misspelling or refused
KEYS = {"text": ("format", "verbosity"), "reasoning": ("effort", "summary", "generate_summary"),
        "tool": ("type", "name", "description", "parameters", "strict"),
        "format": ("type", "name", "description", "schema", "strict")}
ROLES = ("user", "assistant", "system", "developer")  # a tool's output is a function_call_output item
# fields that come back in the response as sent: what JSON cannot carry (NaN, a lone surrogate) is refused first
ECHOED = ("user", "metadata", "tools", "text", "reasoning", "tool_choice", "instructions")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
              "reasoning_text": "text", "summary_text": "text"}


class ResponsesBody(OpenAIBody):
    """A /v1/responses request. Fields beyond OpenAI's (vLLM's top_k, seed, stop, ...) go to the chat as sent, and
    are checked there as a chat's."""

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_items(cls, value: Any) -> Any:
        if not isinstance(value, (str, list)):
            raise ValueError("must be a text or a list of items (messages, function calls and their outputs)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _name_or_object(cls, value: Any) -> Any:  # else pydantic names its union's branches (tool_choice.str)
        if not isinstance(value, (str, dict)):
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": ...}')
        return value

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    text: dict | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: dict | None = None
    store: StrictBool | None = None
    previous_response_id: str | None = None
    background: StrictBool | None = None
    metadata: dict | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: Literal[SERVICE_TIERS] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: StrictInt | None = None


def chat_fields(body: ResponsesBody, before: list[dict] = ()) -> dict:
    """The chat request (ChatBody's fields) that answers `body`, continuing the conversation `before` (the items
    of the response it names by previous_response_id); APIError for what it cannot."""
    extra = body.model_extra or {}
    for name, instead in CHAT_ONLY.items():
        if extra.get(name) is not None:
            raise APIError(400, f"{name} is a chat completion's field, not one of /v1/responses; {instead}", name)
    if extra.get("top_logprobs"):
        raise APIError(400, "top_logprobs is not supported on /v1/responses; leave it out, or ask /v1/chat/completions "
                       "with logprobs: true", "top_logprobs")
    for name, instead in KEPT.items():
        if extra.get(name) is not None:
            raise APIError(400, f"{name} is not supported here; {instead}", name)
    for name in extra:
        refuse_misspelt(name, ResponsesBody.model_fields)
    if body.background:
        raise APIError(400, "background responses are not supported; leave background out and wait for the answer, "
                       "or stream it", "background")
    if body.truncation not in (None, "disabled", "auto"):
        raise APIError(400, f"truncation {body.truncation!r} is not one of disabled, auto", "truncation")
    for value in body.include or ():
        if value not in INCLUDED:
            raise APIError(400, f"include {value!r} is not supported; leave it out", "include")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(400, "max_output_tokens must be at least 1", "max_output_tokens")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise APIError(400, "max_tool_calls must be at least 1; send tool_choice none for no calls", "max_tool_calls")
    check_echoed(body)
    known("text", body.text, KEYS["text"], "text")
    known("reasoning", body.reasoning, KEYS["reasoning"], "reasoning")
    if body.stream_options and (more := sorted(set(body.stream_options) - {"include_obfuscation"})):
        raise APIError(400, f"stream_options takes include_obfuscation only, not {', '.join(more)}; the usage comes "
                       "with response.completed", "stream_options")
    fields: dict[str, Any] = {**extra, "model": body.model, "messages": messages(body, before),
                              "stream": body.stream}
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if body.stream:  # the last event carries the usage
        fields["stream_options"] = {"include_usage": True, **(body.stream_options or {})}
    elif body.stream_options is not None:
        raise APIError(400, "stream_options needs stream: true", "stream_options")
    if body.tools:
        fields["tools"] = [function_tool(i, t) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    if (fmt := response_format(body.text)) is not None:
        fields["response_format"] = fmt
    if body.reasoning is not None:
        effort = body.reasoning.get("effort")
        if effort is not None and not isinstance(effort, str):
            raise APIError(400, "reasoning.effort must be a string such as low, medium or high", "reasoning")
        if effort is not None:
            fields["reasoning_effort"] = effort
    return fields


def check_echoed(body: ResponsesBody) -> None:
    """APIError for an echoed field JSON cannot carry (NaN or Infinity, which the body's parser takes; a lone
    surrogate, which UTF-8 cannot encode: the answer failed as it was written), or metadata past OpenAI's bounds."""
    for name in ECHOED:
        value = getattr(body, name)
        try:
            json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
        except (ValueError, UnicodeEncodeError):
            raise APIError(400, f"{name} holds what JSON cannot carry (NaN or Infinity, or a lone surrogate escape "
                           "such as \\ud800); send finite numbers and UTF-8 text", name) from None
    meta = body.metadata or {}
    if len(meta) > METADATA_KEYS or any(not isinstance(v, str) or len(k) > METADATA_KEY_CHARS or
                                        len(v) > METADATA_VALUE_CHARS for k, v in meta.items()):
        raise APIError(400, f"metadata holds at most {METADATA_KEYS} keys of at most {METADATA_KEY_CHARS} characters, "
                       f"each with a string of at most {METADATA_VALUE_CHARS}", "metadata")


def known(where: str, value: Any, keys: tuple[str, ...], param: str) -> None:
    """APIError (on `param`) for a key of the object `value` (at `where`) that is not among `keys`: a misspelling
    named, as a top-level field's is, rather than dropped."""
    if not isinstance(value, dict):
        return
    for key in value:
        if key not in keys:
            near = difflib.get_close_matches(key, keys, 1, 0.6)
            hint = f"did you mean {near[0]}?" if near else f"it takes {', '.join(keys)}"
            raise APIError(400, f"{where}.{key} is not a field of it; {hint}", param)


def without_oldest(messages: list) -> list | None:
    """A conversation (ChatMessages) without its oldest item, for truncation "auto" (OpenAI's: items dropped from
    the beginning until the input fits): system and developer messages kept, a call's outputs dropped with the
    call; None where only the last item is left."""
    items = [i for i, m in enumerate(messages) if m.role not in ("system", "developer")]
    if len(items) <= 1:
        return None
    dropped = {items[0]}
    for i in items[1:-1]:  # outputs of a call no longer in the input
        if messages[i].role not in ("tool", "function"):
            break
        dropped.add(i)
    return [m for i, m in enumerate(messages) if i not in dropped]


def input_items(body: ResponsesBody) -> list:
    """The input as items: a text is one user message."""
    return [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else \
        list(body.input)


def messages(body: ResponsesBody, before: list[dict] = ()) -> list[dict]:
    """The chat's messages: the instructions as a system message, then the items `before` (a kept conversation)
    and the input (a text: one user message; or items: messages, function calls and their outputs, reasoning that
    the next assistant turn carries). The instructions are this request's alone, as OpenAI's."""
    out = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if isinstance(body.input, list) and not body.input:
        raise APIError(400, "input is empty; send a text or at least one message", "input")
    thought: list[str] = []
    called: set[str] = set()  # the call_ids of the function_call items so far
    for i, item in enumerate([*before, *input_items(body)]):
        where = f"input[{i - len(before)}]"  # a kept item was checked when it was sent
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object: a message, a function_call or a function_call_output",
                           "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                what = "needs a role" if role is None else f"has role {role!r}, not one"
                tool = "; a tool's output is a function_call_output item" if role in ("tool", "function") else ""
                raise APIError(400, f"{where}: a message {what} of {', '.join(ROLES)}{tool}", "input")
            content = item.get("content")  # an assistant turn that only called tools may have none
            message = {"role": role, "content": None if content is None and role == "assistant" else
                       text_of(content, where)}
            if role == "assistant" and thought:
                message["reasoning_content"], thought = "".join(thought), []
            out.append(message)
        elif kind == "function_call":
            call = {"id": str_field(item, "call_id", where), "type": "function",
                    "function": {"name": str_field(item, "name", where),
                                 "arguments": str_field(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":  # calls after an answer: that turn's
                last = {"role": "assistant", "content": None}
                out.append(last)
            if thought:
                last["reasoning_content"], thought = last.get("reasoning_content", "") + "".join(thought), []
            last.setdefault("tool_calls", []).append(call)
            called.add(call["id"])
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise APIError(400, f"{where}: a function_call_output item needs output (a string or text parts)",
                               "input")
            call_id = str_field(item, "call_id", where)
            if call_id not in called:  # the output of no call in the conversation
                raise APIError(400, f"{where}: no function_call item with call_id {json.dumps(call_id)[:80]} comes "
                               "before this output; send the call's item before it, or continue the response that "
                               "made the call (previous_response_id)", "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text_of(output, where)})
        elif kind == "reasoning":  # carried by the assistant turn that follows, as chat templates take it
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise APIError(400, f"{where}: a reasoning item's content and summary are lists of text parts",
                               "input")
            thought.append(text_of(parts, where))
        elif kind == "item_reference":
            raise APIError(400, f"{where}: an item_reference is not supported here; send the item itself, or "
                           "continue the response that holds it (previous_response_id)", "input")
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported; send messages, function_call "
                           "and function_call_output items", "input")
    return out


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined; APIError for other parts (images, files)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{where}: only text content parts are supported (input_text, output_text), not "
                           f"{kind!r}", "input")
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise APIError(400, f"{where}: a {kind} part's {TEXT_PARTS[kind]} must be a string", "input")
        texts.append(text)
    return "\n".join(texts)  # as a chat's text parts are joined


def str_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}: a {item.get('type')} item needs {name} (a string)", "input")
    return value


def function_tool(i: int, tool: Any) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) as a chat's tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"tools[{i}] of type {kind!r} is not supported; this server runs function tools "
                       '({"type": "function", "name": ..., "parameters": {...}})', "tools")
    if "function" in tool and "name" not in tool:  # a chat completion's form, sent here
        raise APIError(400, f'tools[{i}]: a Responses function tool gives its name and parameters at the top '
                       '({"type": "function", "name": ..., "parameters": {...}}), not under "function"', "tools")
    known(f"tools[{i}]", tool, KEYS["tool"], "tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f'tools[{i}]: a function tool needs its name ({{"type": "function", "name": ..., '
                       '"parameters": {...}})', "tools")
    keys = ("name", "description", "parameters")
    # strict where it is not turned off, as OpenAI's Responses take a function tool (its chat's are not)
    return {"type": "function", "function": {**{k: tool[k] for k in keys if tool.get(k) is not None},
                                             "strict": tool.get("strict") is not False}}


def tool_choice(choice: str | dict) -> str | dict:
    """tool_choice as a chat takes it: none, auto, required, or {"type": "function", "name": ...}."""
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice is "none", "auto", "required" or {"type": "function", "name": ...}; '
                   f"{json.dumps(choice)[:80]} is not one", "tool_choice")


def response_format(text: dict | None) -> dict | None:
    """text.format as a chat's response_format (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError(400, 'text.format is {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                       '"name": ..., "schema": {...}}', "text")
    known("text.format", fmt, KEYS["format"], "text")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, 'text.format json_schema needs its schema: {"type": "json_schema", "name": "...", '
                           '"schema": {...}}', "text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if fmt["type"] == "text" and (more := sorted(set(fmt) - {"type"})):  # dropped, the text unconstrained
        raise APIError(400, f"text.format gives {', '.join(more)} with type 'text', which takes nothing more; for a "
                       'schema send {"type": "json_schema", "name": "...", "schema": {...}}', "text")
    return fmt if fmt["type"] != "text" else None


def renamed(e: APIError) -> APIError:
    """A chat's error as the Responses fields name it."""
    message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", e.message)
    message = re.sub(r"\bresponse_format\b", "text.format", message)
    message = re.sub(r"\bmessages\b", "input", message)
    message = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", message)  # a Responses tool has no "function"
    return APIError(e.status, message, PARAMS.get(e.param, e.param), e.code, e.kind, e.headers)


KEPT_BYTES = 64 * 2**20  # the kept responses' own memory at most (held_bytes) besides their count; a body may hold 8 MB
JSON_CONTAINERS = frozenset((dict, list, tuple))  # what held_bytes walks into


def held_bytes(value: Any) -> int:
    """The bytes a JSON value holds as Python objects, each counted where it appears. Its JSON text says too little:
    64 MiB of text in one-character messages held 246 MiB (RSS). Walked a level at a time by the garbage collector's
    C traversal, as fast as json.dumps (an 8 MB body of small messages in 0.14-0.24 s, against 0.7 s item by item in
    Python), into JSON's containers only: anything else is counted alone, never followed to its class and modules."""
    total, level = 0, [value]
    while level:
        total += sum(map(sys.getsizeof, level))
        level = gc.get_referents(*compress(level, map(JSON_CONTAINERS.__contains__, map(type, level))))
    return total


class KeptResponses:
    """The last responses asked to be stored (store: true, OpenAI's default), by id, at most `limit` of them (0:
    none is) and KEPT_BYTES of their own memory, for as long as the server runs: each its response object and the
    conversation it ends as items (the one it continued, its input, its output), which a later request continues
    by previous_response_id."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept: OrderedDict[str, tuple[dict, list, int]] = OrderedDict()  # oldest first
        self.bytes = 0

    def conversation(self, rid: str) -> list:
        """The items of the conversation that response `rid` ends; a 404 where it is not kept."""
        return self._get(rid, "previous_response_id")[1]

    def response(self, rid: str) -> dict:
        return self._get(rid, None)[0]

    def delete(self, rid: str) -> dict:
        self._get(rid, None)
        self.bytes -= self.kept.pop(rid)[2]
        return {"id": rid, "object": "response", "deleted": True}

    def keep(self, response: dict, before: list, body: ResponsesBody) -> None:
        """Keep `response`, the answer to `body` continuing the conversation `before`, if it was asked to be; the
        oldest go past the bounds. A failed response is not kept."""
        if not self.stores(body) or response["status"] not in ("completed", "incomplete"):
            return
        own = input_items(body)
        size = held_bytes(own) + held_bytes(response)
        self.kept[response["id"]] = (response, [*before, *own, *response["output"]], size)
        self.bytes += size
        while len(self.kept) > self.limit or self.bytes > KEPT_BYTES and len(self.kept) > 1:
            self.bytes -= self.kept.popitem(last=False)[1][2]

    def stores(self, body: ResponsesBody) -> bool:
        """Whether the answer to `body` will be kept (its store field as the response gives it)."""
        return bool(self.limit) and body.store is not False

    def _get(self, rid: str, param: str | None) -> tuple[dict, list, int]:
        if rid not in self.kept:
            why = "this server keeps none (serve --responses-kept 0)" if not self.limit else \
                f"it keeps the last {self.limit} stored, while it runs"
            raise APIError(404, f"no response {json.dumps(rid)[:80]} is kept here: {why}; send the whole "
                           "conversation in input", param, "response_not_found")
        return self.kept[rid]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Envelope:
    """The response object's fields that every state of one response shares. `tokens`: a text's token count (the
    reasoning's, which the usage reports; None: not counted)."""

    def __init__(self, body: ResponsesBody, model: str, tokens: Callable[[str], int] | None = None,
                 stored: bool = False):
        self.id, self.created = new_id("resp"), int(time.time())
        self.body, self.model, self.tokens, self.stored = body, model, tokens, stored

    def usage(self, chat_usage: dict | None, output: list[dict]) -> dict | None:
        """The chat's usage as the Responses API gives it, the reasoning items' tokens counted among the output's."""
        if chat_usage is None:
            return None
        thought = "".join(i["content"][0]["text"] for i in output if i["type"] == "reasoning")
        reasoning = min(self.tokens(thought), chat_usage["completion_tokens"]) if thought and self.tokens else 0
        return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": chat_usage["total_tokens"]}

    def __call__(self, status: str, output: list[dict], use: dict | None = None, finish: str | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "max_tool_calls": b.max_tool_calls, "model": self.model, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id,
                "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
                "store": self.stored, "temperature": (b.model_extra or {}).get("temperature", 1.0),
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
                "tools": [{**t, "strict": t.get("strict") is not False} for t in b.tools or ()],  # as they ran
                "top_p": (b.model_extra or {}).get("top_p", 1.0),
                "truncation": b.truncation or "disabled", "usage": use, "user": b.user,
                "metadata": b.metadata or {}}


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"id": new_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def whole(chat: dict, envelope: Envelope) -> dict:
    """A whole chat completion as the response object."""
    choice = chat["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    output, cut = [], "incomplete" if finish == "length" else "completed"
    if message.get("reasoning_content"):  # cut short where nothing came after it
        output.append(reasoning_item(message["reasoning_content"], "completed" if message.get("content") or
                                     message.get("tool_calls") else cut))
    if message.get("content") or not message.get("tool_calls"):  # an empty answer is still a message
        output.append(message_item(message.get("content") or "", cut))
    calls = message.get("tool_calls") or ()  # the last one's arguments cut short where the answer was
    output += [call_item(c, cut if j == len(calls) - 1 else "completed") for j, c in enumerate(calls)]
    return envelope(status_of(finish), output, envelope.usage(chat.get("usage"), output), finish)


class Events:
    """The Responses stream's events of one chat stream's chunks: each item opened, its text's deltas, closed;
    every event numbered, as server-sent events named by their type."""

    def __init__(self, envelope: Envelope):
        self.envelope, self.sequence = envelope, 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item whose text is arriving

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> list[str]:
        response = self.envelope("in_progress", [])
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def text(self, kind: str, delta: str) -> list[str]:
        """A delta of the reasoning ("reasoning") or of the answer ("message")."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            item = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            self.open, index = item, len(self.output)
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=index,
                                  item={**item, "content": []}))
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0]))
        item, index = self.open, len(self.output) - 1
        item["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*out, self.event(name, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra)]

    def close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = self.output.index(item), item["content"][0]
        item["status"] = status
        name = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self.event(name, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def calls(self, calls: list[dict], finish: str | None) -> list[str]:
        """The items of the answer's last calls (`finish`: its finish reason, which cuts the last one short)."""
        out = self.close()
        for j, call in enumerate(calls):
            cut = finish == "length" and j == len(calls) - 1
            item, index = call_item(call, "incomplete" if cut else "completed"), len(self.output)
            self.output.append(item)
            out += [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return out

    def end(self, finish: str | None, use: dict | None) -> list[str]:
        out = self.close("incomplete" if finish == "length" else "completed")
        status = status_of(finish)
        response = self.final = self.envelope(status, self.output, self.envelope.usage(use, self.output), finish)
        # response.completed also where the status is incomplete, as vLLM's: the openai client's stream helper
        # (responses.stream) ends only on that event
        return [*out, self.event("response.completed", response=response)]

    def failed(self, error: dict) -> list[str]:
        out = [self.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))]
        response = self.envelope("failed", self.output, None, None,
                                 {"code": error.get("code") or "server_error", "message": error.get("message")})
        return [*out, self.event("response.failed", response=response)]


async def stream(chunks: AsyncIterator[str], envelope: Envelope, ended: Callable[[dict], None] = lambda _: None
                 ) -> AsyncIterator[str]:
    """The Responses events of a chat stream's SSE chunks (one choice, its usage in the last chunk); `ended` gets
    the final response object (not a failed one) before its event is sent."""
    events, finish, use = Events(envelope), None, None
    try:
        for e in events.start():
            yield e
        async for piece in chunks:
            data = piece.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                for e in events.failed(chunk["error"]):
                    yield e
                return
            use = chunk.get("usage") or use
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                out = []
                if delta.get("reasoning_content"):
                    out += events.text("reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    out += events.text("message", delta["content"])
                finish = choice.get("finish_reason") or finish
                if delta.get("tool_calls"):
                    out += events.calls([{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]],
                                        finish)
                for e in out:
                    yield e
        if not any(item["type"] != "reasoning" for item in events.output):  # an empty answer is still a message
            for e in [*events.close("incomplete" if finish == "length" else "completed"), *events.text("message", "")]:
                yield e  # the reasoning cut short where nothing came after it
        last = events.end(finish, use)
        ended(events.final)  # kept before the client has it: its next request may name it at once
        for e in last:
            yield e
    finally:  # a client that left ends the chat's generation too
        await chunks.aclose()
