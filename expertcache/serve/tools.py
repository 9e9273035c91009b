"""Tool calls in chat completions. A model whose chat template writes a call in <tool_call> tags has its calls parsed
out of its text into OpenAI's `tool_calls`, whole and streamed: as JSON, {"name": ..., "arguments": {...}} (Qwen's and
Hermes' way), as the name then <arg_key>/<arg_value> pairs (GLM-4.5's), or as <function=NAME> with <parameter=KEY>
values (Qwen3-Coder's); or between DeepSeek's or Kimi K2's call markers. tool_choice "required" or a named function
keeps the output to one call, in the JSON form, by a grammar (llguidance's, over the tool's parameter schema),
whatever the template. (GPT-OSS's calls, in its harmony format, are read in reasoning.py.)"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.structured import LAYOUT, bounded, closed, schema_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)  # Qwen3-Coder's
XML_PARAMETER = re.compile(r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
MAX_NAME = 64  # characters of a function's name (OpenAI's bound)


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
        if len(name) > MAX_NAME or any(c.isspace() or c in "<>" for c in name):  # no call could name it
            raise ValueError(f"tools[{i}].function.name {json.dumps(name[:80])} is not a tool's name: a model writes "
                             f"it in its call, so give at most {MAX_NAME} characters without spaces or markup "
                             "(e.g. get_weather)")
        parameters = fn.get("parameters")
        if parameters is None:  # OpenAI's: a function of no parameters, called with {}
            parameters = NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters is not a JSON schema (an object)")
        if parameters.get("type", "object") != "object":  # a call's arguments are an object, in every form
            raise ValueError(f"tools[{i}].function.parameters must be a schema of type object, not "
                             f"{json.dumps(parameters['type'])[:40]}: a call's arguments are an object of named values")
        out[name] = closed(parameters) if fn.get("strict") is True else parameters
    return out


def forced_names(tools: list | None, choice) -> tuple[str, ...]:
    """The functions a call forced by tool_choice `choice` may name: every tool's for "required", the named one's
    for {"type": "function", "function": {"name": ...}}; () for "auto", "none" or no choice, which force none.
    ValueError for a choice that is none of these, or that names no tool."""
    return _forced(functions(tools), choice)


def _forced(tools_by_name: dict[str, dict], choice) -> tuple[str, ...]:
    """forced_names' on the tools as `functions` gives them."""
    if choice in (None, "auto", "none"):
        return ()
    if choice == "required":
        if not tools_by_name:
            raise ValueError("tool_choice required needs tools to call; send tools, or tool_choice auto")
        return tuple(tools_by_name)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools_by_name:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(map(repr, tools_by_name)) or 'none'})")
        return (name,)
    raise ValueError('tool_choice is "none", "auto", "required" or {"type": "function", "function": {"name": '
                     '"..."}}')


def call_grammar(tools: list | None, choice) -> str | None:
    """The grammar (llguidance's Lark) of one call in tags to one of the functions `choice` forces (forced_names);
    None where it forces none. ValueError for a choice that is no tool_choice, or that names no tool."""
    tools_by_name = functions(tools)  # checked whatever the choice: a tool the model may call must be one
    names = _forced(tools_by_name, choice)
    if not names:
        return None
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
    return bounded(f'start: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"',
                   f"the grammar of a call to {'the tools' if len(names) > 1 else repr(names[0])} is")


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


def tool_call(name: str, arguments: str) -> dict:
    """An entry of OpenAI's tool_calls: a call of function `name` with `arguments` (JSON text)."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _names_a_tool(name: str, tools: list | None) -> bool:
    """Whether a word a model wrote where a call's name goes is one: a single word (no markup), and one of the
    request's tools where it gives any."""
    return bool(name) and not any(c.isspace() for c in name) and "<" not in name and \
        not (tools and name not in _names(tools))


def _typed(pairs: list[tuple[str, str]], strings: set[str]) -> dict:
    """Arguments written as text: each value JSON, unless it does not parse or its tool declares it a string."""
    arguments = {}
    for key, text in pairs:
        try:
            arguments[key.strip()] = text if key.strip() in strings else json.loads(text)
        except ValueError:  # not JSON, or an integer of more digits than int() takes
            arguments[key.strip()] = text
    return arguments


def _call(body: str, tools: list | None) -> dict | None:
    """One tag's call as an entry of OpenAI's tool_calls (its arguments as JSON text); None unless it is a JSON
    object with a string name, a name followed by GLM-4.5's argument pairs, or Qwen3-Coder's <function=NAME> with
    its <parameter=KEY> values (each value JSON, unless it does not parse or the tool declares it a string)."""
    try:
        value = json.loads(body)
    except ValueError:  # not JSON (JSONDecodeError), or an integer of more digits than int() takes
        if (function := XML_FUNCTION.match(body)) is not None:
            name, pairs = function.group(1), [(k, v.removeprefix("\n").removesuffix("\n"))
                                              for k, v in XML_PARAMETER.findall(function.group(2))]
        else:
            name, pairs = body.split("<arg_key>", 1)[0].strip(), GLM_ARGUMENT.findall(body)
        if not _names_a_tool(name, tools):
            return None
        value = {"name": name, "arguments": _typed(pairs, _string_arguments(tools, name))}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return tool_call(value["name"], arguments if isinstance(arguments, str) else
                     json.dumps(arguments, ensure_ascii=False))


def _marked_call(body: str, tools: list | None) -> dict | None:
    """A call between DeepSeek's or Kimi K2's markers: DeepSeek-V3's `function<sep>NAME` then its arguments in a
    ```json block, DeepSeek-V3.1's `NAME<sep>ARGUMENTS`, Kimi K2's `functions.NAME:INDEX<argument begin>ARGUMENTS`;
    None for another body, or a name that is not a given tool."""
    for sep in (DEEPSEEK_SEP, KIMI_ARGUMENTS):
        if sep in body:
            name, arguments = body.split(sep, 1)
            break
    else:
        return None
    name = name.strip()
    if name == "function":  # DeepSeek-V3: the type, then the name on the line before the arguments
        name, _, arguments = arguments.partition("\n")
        name, arguments = name.strip(), arguments.strip().removeprefix("```json").removesuffix("```")
    name = name.removeprefix("functions.").rsplit(":", 1)[0] if sep == KIMI_ARGUMENTS else name
    return tool_call(name, arguments.strip()) if _names_a_tool(name, tools) else None


CUT_CALL = re.compile(r'\s*' + re.escape(OPEN) + r'\n\{"name": ("(?:[^"\\]|\\.)*"), "arguments": (.*)\Z', re.S)


def cut_call(text: str, names: tuple[str, ...] = ()) -> dict | None:
    """A forced call (call_grammar's form) that max_tokens cut before its end, as OpenAI and vLLM give one: its name
    and the arguments written so far, or whole where only the closing markup was cut. Cut before its arguments
    began, the call of the one of `names` (the functions it may call) that the text so far can still be, with no
    arguments yet; None where that is more than one."""
    found = CUT_CALL.match(text)
    if found is None:
        written = text.lstrip()
        can_be = [name for name in names
                  if f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '.startswith(written)]
        return tool_call(can_be[0], "") if len(can_be) == 1 else None
    try:
        arguments, end = json.JSONDecoder().raw_decode(found.group(2))
        written = found.group(2)[:end]
    except ValueError:
        written = found.group(2)
    return tool_call(json.loads(found.group(1)), written)


@dataclass(frozen=True)
class CallSyntax:
    """How a template's model writes a call: between `begin` and `end`, read by `parse`; `opens`: where the text
    that may hold calls begins (held back from a stream); `wrappers`: markers around a group of calls, left out
    of the text."""
    begin: str
    end: str
    parse: Callable[[str, list | None], dict | None]
    opens: tuple[str, ...] = ()
    wrappers: tuple[str, ...] = ()


DEEPSEEK_SEP, KIMI_ARGUMENTS = "<｜tool▁sep｜>", "<|tool_call_argument_begin|>"
SYNTAXES = {  # by a marker its chat template writes
    OPEN: CallSyntax(OPEN, CLOSE, _call, (OPEN,)),
    "<｜tool▁call▁begin｜>": CallSyntax("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _marked_call,
                                      ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
                                      ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    "<|tool_call_begin|>": CallSyntax("<|tool_call_begin|>", "<|tool_call_end|>", _marked_call,
                                      ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
                                      ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")),
}


def call_syntaxes(template_source: str) -> tuple[CallSyntax, ...]:
    """The ways a template's model writes calls: <tool_call> tags (also a forced call's, whatever the template),
    and DeepSeek's or Kimi K2's markers where the template writes them."""
    return (SYNTAXES[OPEN], *(syntax for marker, syntax in SYNTAXES.items()
                               if marker != OPEN and marker in template_source))


def _split(text: str, tools: list | None, syntax: CallSyntax) -> tuple[str, list[dict]]:
    """(`text` without its calls' markers, the calls). A call that does not parse stays in the text as the model
    wrote it."""
    calls, kept, pos = [], [], 0
    while (start := text.find(syntax.begin, pos)) >= 0 and (end := text.find(syntax.end, start)) >= 0:
        call = syntax.parse(text[start + len(syntax.begin):end].strip(), tools)
        kept.append(text[pos:end + len(syntax.end)] if call is None else text[pos:start])
        calls += [call] if call is not None else []
        pos = end + len(syntax.end)
    kept = "".join(kept + [text[pos:]])
    for wrapper in syntax.wrappers if calls else ():
        kept = kept.replace(wrapper, "")
    return kept, calls


def held_tail(text: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `marks` (held back from a stream)."""
    return max((n for mark in marks for n in range(min(len(mark) - 1, len(text)), 0, -1)
                if text.endswith(mark[:n])), default=0)


class CallStream:
    """A streamed choice's text, held back from where a call may begin: `feed` gives what can be sent now, `end`
    the rest of the text and the calls. syntaxes: call_syntaxes' (default: <tool_call> tags)."""

    def __init__(self, tools: list | None = None, syntaxes: tuple[CallSyntax, ...] = (SYNTAXES[OPEN],)):
        self.tools, self.syntaxes, self.text, self.sent = tools, syntaxes, "", 0
        self.opens = tuple(mark for syntax in syntaxes for mark in syntax.opens)

    def feed(self, piece: str) -> str:
        self.text += piece
        found = [i for mark in self.opens if (i := self.text.find(mark, self.sent)) >= 0]
        # held: from where a call may begin, or a tail that may be the start of one
        opened = min(found) if found else len(self.text) - held_tail(self.text, self.opens)
        out, self.sent = self.text[self.sent:opened], max(self.sent, opened)
        return out

    def end(self) -> tuple[str, list[dict]]:
        """The text not yet sent, and the calls (the text of their markers left out)."""
        content, calls = self.text, []
        for syntax in self.syntaxes:  # the text before the first call is as sent
            content, found = _split(content, self.tools, syntax)
            calls += found
        return (content[self.sent:].rstrip(), calls) if calls else (self.text[self.sent:], [])
