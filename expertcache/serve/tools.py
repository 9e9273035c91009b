"""Tool calls in chat completions. A model whose chat template writes a call in <tool_call> tags has its calls parsed
out of its text into OpenAI's `tool_calls`, whole and streamed: as JSON, {"name": ..., "arguments": {...}} (Qwen's and
Hermes' way), as the name then <arg_key>/<arg_value> pairs (GLM-4.5's), or as <function=NAME> with <parameter=KEY>
values (Qwen3-Coder's). tool_choice "required" or a named function keeps the output to one call, in the JSON form,
by a grammar (llguidance's, over the tool's parameter schema), whatever the template. (GPT-OSS's calls, in its
harmony format, are read in reasoning.py.)"""
from __future__ import annotations

import json
import re
import uuid

from ..engine.structured import LAYOUT, schema_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)  # Qwen3-Coder's
XML_PARAMETER = re.compile(r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _function(tool) -> dict | None:
    """A tool's function object ({"name", "parameters", ...}), or None where the tool is not a function tool."""
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    return fn if isinstance(fn, dict) else None


def functions(tools: list | None) -> dict[str, dict]:
    """name -> parameter schema of each function tool; ValueError naming a tool that is not one."""
    out = {}
    for i, tool in enumerate(tools or ()):
        fn = _function(tool)
        name = fn.get("name") if fn is not None else None
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
    for key in ("$defs", "definitions"):  # a parameter schema's references ("#/$defs/X") resolve from the root
        for name in names:
            for ref, definition in (tools_by_name[name].get(key) or {}).items():
                if schema.setdefault(key, {}).setdefault(ref, definition) != definition:
                    raise ValueError(f"tools define {key}/{ref} differently; give each definition its own name")
    return f'start: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'


def _names(tools: list) -> set:
    """The names of the request's function tools, as sent."""
    return {fn.get("name") for fn in map(_function, tools) if fn is not None}


def _string_arguments(tools: list | None, name: str) -> set[str]:
    """The arguments of tool `name` that its schema declares strings (GLM-4.5 and Qwen3-Coder write those as they
    are)."""
    for fn in map(_function, tools or ()):
        if fn is not None and fn.get("name") == name and isinstance(fn.get("parameters"), dict):
            properties = fn["parameters"].get("properties")
            if isinstance(properties, dict):
                return {k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def _typed(pairs: list[tuple[str, str]], strings: set[str]) -> dict:
    """Arguments written as text: each value JSON, unless it does not parse or its tool declares it a string."""
    arguments = {}
    for key, text in pairs:
        try:
            arguments[key.strip()] = text if key.strip() in strings else json.loads(text)
        except json.JSONDecodeError:
            arguments[key.strip()] = text
    return arguments


def _call(body: str, tools: list | None) -> dict | None:
    """One tag's call as an entry of OpenAI's tool_calls (its arguments as JSON text); None unless it is a JSON
    object with a string name, a name followed by GLM-4.5's argument pairs, or Qwen3-Coder's <function=NAME> with
    its <parameter=KEY> values (each value JSON, unless it does not parse or the tool declares it a string)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        if (function := XML_FUNCTION.match(body)) is not None:
            name, pairs = function.group(1), [(k, v.removeprefix("\n").removesuffix("\n"))
                                              for k, v in XML_PARAMETER.findall(function.group(2))]
        else:
            name, pairs = body.split("<arg_key>", 1)[0].strip(), GLM_ARGUMENT.findall(body)
        if not name or any(c.isspace() for c in name) or "<" in name or (tools and name not in _names(tools)):
            return None  # a word in tags is a call only where it names a tool the request gives
        value = {"name": name, "arguments": _typed(pairs, _string_arguments(tools, name))}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"], "arguments": arguments if isinstance(arguments, str) else
                         json.dumps(arguments, ensure_ascii=False)}}


def _split(text: str, tools: list | None) -> tuple[str, list[dict]]:
    """(`text` without its calls' tags, the calls). A tag that holds no call stays in the text as the model wrote
    it."""
    calls, kept, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start)) >= 0:
        call = _call(text[start + len(OPEN):end].strip(), tools)
        kept.append(text[pos:end + len(CLOSE)] if call is None else text[pos:start])
        calls += [call] if call is not None else []
        pos = end + len(CLOSE)
    return "".join(kept + [text[pos:]]), calls


class CallStream:
    """A streamed choice's text, held back from where a call may begin: `feed` gives what can be sent now, `end`
    the rest of the text and the calls."""

    def __init__(self, tools: list | None = None):
        self.tools, self.text, self.sent = tools, "", 0

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
        content, calls = _split(self.text, self.tools)  # the text before the first tag is as sent
        return (content[self.sent:].rstrip(), calls) if calls else (self.text[self.sent:], [])
