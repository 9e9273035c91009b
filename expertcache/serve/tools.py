"""Tool calls in chat completions. A model whose chat template writes a call as <tool_call>{"name": ..., "arguments":
{...}}</tool_call> (Qwen's and Hermes' way) has its calls parsed out of its text into OpenAI's `tool_calls`, whole and
streamed; tool_choice "required" or a named function keeps the output to one such call by a grammar (llguidance's,
over the tool's parameter schema), whatever the template."""
from __future__ import annotations

import json
import uuid

from ..engine.structured import LAYOUT, schema_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def functions(tools: list | None) -> dict[str, dict]:
    """name -> parameter schema of each function tool; ValueError naming a tool that is not one."""
    out = {}
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f'tools[{i}] is not a function tool; give {{"type": "function", "function": {{"name": '
                             '"...", "parameters": {...}}}')
        parameters = fn.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters is not a JSON schema (an object)")
        out[name] = parameters
    return out


def call_grammar(tools: list | None, choice) -> str | None:
    """The grammar (llguidance's Lark) of one call in tags: to any of the tools for tool_choice "required", to the
    named function for {"type": "function", "function": {"name": ...}}; None for "auto", "none" or no choice.
    ValueError for a choice that is none of these, or that names no tool."""
    if choice in (None, "auto", "none"):
        return None
    tools_by_name = functions(tools)
    if choice == "required":
        names = list(tools_by_name)
        if not names:
            raise ValueError("tool_choice required needs tools to call; send tools, or tool_choice auto")
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        names = [choice["function"].get("name")]
        if names[0] not in tools_by_name:
            raise ValueError(f"tool_choice names the function {names[0]!r}, which is not among the tools "
                             f"({', '.join(map(repr, tools_by_name)) or 'none'})")
    else:
        raise ValueError('tool_choice is "none", "auto", "required" or {"type": "function", "function": {"name": '
                         '"..."}}')
    for name in names:  # a schema llguidance cannot follow, named by its tool rather than by the grammar around it
        try:
            schema_text(tools_by_name[name])
        except ValueError as e:
            raise ValueError(f"the parameters of tool {name!r}: the JSON schema {e}") from None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": tools_by_name[name]},
              "required": ["name", "arguments"], "additionalProperties": False} for name in names]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": LAYOUT}
    return f'start: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'


def _call(body: str) -> dict | None:
    """One tag's JSON as an entry of OpenAI's tool_calls (its arguments as JSON text); None unless it is an object
    with a string name."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"], "arguments": arguments if isinstance(arguments, str) else
                         json.dumps(arguments, ensure_ascii=False)}}


def _split(text: str) -> tuple[str, list[dict]]:
    """(`text` without its calls' tags, the calls). A tag that holds no call (not JSON, no name) stays in the text
    as the model wrote it."""
    calls, kept, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start)) >= 0:
        call = _call(text[start + len(OPEN):end].strip())
        kept.append(text[pos:end + len(CLOSE)] if call is None else text[pos:start])
        calls += [call] if call is not None else []
        pos = end + len(CLOSE)
    return "".join(kept + [text[pos:]]), calls


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """(a message's content, its tool_calls): with calls, the text around them stripped (None when nothing is
    left); without, `text` as it is."""
    content, calls = _split(text)
    return (content.strip() or None, calls) if calls else (text, [])


class CallStream:
    """A streamed choice's text, held back from where a call may begin: `feed` gives what can be sent now, `end`
    the rest of the text and the calls."""

    def __init__(self):
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        opened = self.text.find(OPEN, self.sent)
        if opened < 0:  # held: a tail that may be the start of OPEN
            opened = len(self.text) - next((n for n in range(len(OPEN) - 1, 0, -1)
                                            if self.text.endswith(OPEN[:n])), 0)
        out, self.sent = self.text[self.sent:opened], max(self.sent, opened)
        return out

    def end(self) -> tuple[str, list[dict]]:
        """The text not yet sent, and the calls (the text of their tags left out)."""
        content, calls = _split(self.text)  # the text before the first tag is as sent
        return (content[self.sent:].rstrip(), calls) if calls else (self.text[self.sent:], [])
