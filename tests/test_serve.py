"""The OpenAI-compatible server, live on a loopback port, driven by the official openai client."""
import contextlib
import io
import json
import os
import re
import select
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import SERVED as MODEL  # the server and client fixtures' model (conftest.py)

from expertcache.engine.chat import ChatTemplate
from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from expertcache.engine.generate import TextGeneration, generate
from expertcache.engine.sampling import SamplingParams
from expertcache.serve.app import create_app
from expertcache.serve.background import BackgroundServer
from expertcache.serve.limits import ServerLimits
from expertcache.serve.scheduler import Scheduler
from expertcache.serve.tools import cut_call

SERVER_DOC = Path(__file__).parents[1] / "docs" / "server.md"


@pytest.fixture(scope="module")
def reference():
    """A separate engine that runs the plain token loop serially."""
    engine = Engine(None, EngineConfig(store="ram", max_seq=512))

    def complete(prompt_ids: list[int], max_tokens: int) -> str:
        ids = list(generate(engine, prompt_ids, max_tokens, stop=0))
        return engine.tokenizer.decode([t for t in ids if t != 0])

    complete.engine = engine
    yield complete
    engine.close()


def get(url: str) -> str:
    with urllib.request.urlopen(url) as r:
        return r.read().decode()


def metric(server, name: str) -> float:
    text = get(f"{server.url}/metrics")
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_completion_whole_and_streamed_equal_serial_generate(client, reference):
    want = reference(reference.engine.encode("ROMEO.\n"), 24)
    got = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.completion_tokens == 24 and got.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed_use_the_template(client, reference):
    messages = [{"role": "user", "content": "Who goes there?"}]
    prompt = ChatTemplate.of(reference.engine).render(messages)
    assert prompt == "USER.\nWho goes there?\n\nASSISTANT.\n"
    want = reference(reference.engine.tokenizer.encode(prompt, add_special_tokens=False).ids, 20)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_builtin_template_renders_as_in_hf(reference):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(BUILTIN_MODEL))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hail!"}]
    assert ChatTemplate.of(reference.engine).render(messages) == \
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


TOOL_TEMPLATE = """{% set d = dict(a=1) %}{% if tools %}TOOLS:{% for t in tools %} {{ t | tojson }}{% endfor %}
{% endif %}{% for m in messages %}{{ m.role | upper }}{% if m.name %} ({{ m.name }}){% endif %}.
{% if m.role == "assistant" %}{% generation %}<think>{{ m.reasoning_content }}</think>{{ m.content }}{% endgeneration %}
{%- else %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }}({{ c.function.arguments }})</call>{% endfor %}

{% endfor %}{% if reasoning_effort is defined %}EFFORT {{ reasoning_effort }}.
{% endif %}{% for d in documents or [] %}DOCUMENT {{ d.title }}: {{ d.text }}
{% endfor %}{% if add_generation_prompt %}ASSISTANT.
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"""


def test_tools_calls_and_template_arguments_reach_the_template_as_in_hf(tmp_path):
    """A chat's tools, its messages' own fields (an assistant's tool calls, a name) and chat_template_kwargs reach
    the chat template as HF's apply_chat_template passes them, and the template has HF's helpers (tojson that does
    not escape HTML, dict, the generation block): the prompt is the one HF renders; an argument the server sets
    itself is refused with a 400."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "weather", "description": "the day's <rain> & sun",
                                               "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Rain?", "name": "Kate"},
                {"role": "assistant", "content": "", "reasoning": "look it up", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "content": "wet", "tool_call_id": "1"}]
    want = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert "day's <rain> & sun" in want and "<call>weather({})</call>" in want and "(Kate)" in want
    assert "<think>look it up</think>" in want
    engine = Engine(path, EngineConfig(store="ram", max_seq=128))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = lambda **kw: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,  # noqa: E731
                                                          temperature=0, **kw).usage.prompt_tokens
        assert ask(tools=tools, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == \
            len(engine.encode(want, special=False)) > ask()
        with pytest.raises(openai.BadRequestError, match="set by the server"):
            ask(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
        effort = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(  # GPT-OSS's field
            messages, tokenize=False, add_generation_prompt=True, reasoning_effort="low")
        assert "EFFORT low." in effort and ask(reasoning_effort="low") == len(engine.encode(effort, special=False))
        assert ask(reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}) == \
            len(engine.encode(effort.replace("low", "high"), special=False))
        documents = [{"title": "Forecast", "text": "Rain all day."}]  # retrieval's, vLLM's and HF's field
        grounded = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, documents=documents)
        assert "DOCUMENT Forecast: Rain all day." in grounded
        assert ask(extra_body={"documents": documents}) == len(engine.encode(grounded, special=False))
        counted = call(s, "/tokenize", {"messages": messages, "documents": documents, "reasoning_effort": "low"})
        assert counted[1]["count"] == ask(reasoning_effort="low", extra_body={"documents": documents}) > \
            ask(extra_body={"documents": documents})  # /tokenize renders what the chat renders
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]: tool_calls must be a list of calls"):
            client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                {"role": "assistant", "content": "x", "tool_calls": 5}])
    engine.close()


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
               "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
               "additionalProperties": False}}},
           {"type": "function", "function": {"name": "get_time", "parameters": {
               "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
               "additionalProperties": False}}}]


def test_a_forced_tool_choice_comes_back_as_a_call_of_its_tool(client):
    """tool_choice required or a named function: a grammar over the tools' parameters keeps the output to one call,
    whatever the chat template (the built-in model's writes no tools), and it comes back in tool_calls, whole and
    streamed, with finish_reason tool_calls."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, max_tokens=60)
    choice = client.chat.completions.create(**ask, tool_choice={"type": "function",
                                                                "function": {"name": "get_weather"}}).choices[0]
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and call.id.startswith("call_")
    assert call.function.name == "get_weather" and set(arguments) == {"city"} and len(arguments["city"]) <= 10
    for choice in client.chat.completions.create(**ask, tool_choice="required", n=3, temperature=1.0, seed=2).choices:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
    chunks = [c for c in client.chat.completions.create(**ask, tool_choice="required", stream=True) if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time") and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)



def test_a_forced_call_cut_short_gives_the_call_so_far(client):
    """A forced call that max_tokens cuts ends with finish_reason length, whole and streamed alike, and never with
    its markup as content: with the call so far, its arguments cut (as OpenAI and vLLM give it; it came back empty,
    whatever max_tokens left of it). Cut before its arguments began, a named function's call still names it (it
    came back with no call); a call of tool_choice required, the tool its name so far can only be, else none."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
               tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    whole = client.chat.completions.create(**ask, max_tokens=60).choices[0]
    (full,) = whole.message.tool_calls
    written = []
    for max_tokens in (1, 3, 8, 12, 16, 24):
        choice = client.chat.completions.create(**ask, max_tokens=max_tokens).choices[0]
        chunks = [c for c in client.chat.completions.create(**ask, max_tokens=max_tokens, stream=True) if c.choices]
        streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert choice.finish_reason == chunks[-1].choices[0].finish_reason == "length"
        assert choice.message.content is None and not "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = choice.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in streamed]
        (call,) = calls
        assert call.function.name == "get_weather" and full.function.arguments.startswith(call.function.arguments)
        written.append(call.function.arguments)
    assert written[0] == "" and written[-1] and written[-1] != full.function.arguments
    required = dict(ask, tool_choice="required")  # get_weather or get_time: "get_" can be either
    for max_tokens in (1, 40):
        choice = client.chat.completions.create(**required, max_tokens=max_tokens).choices[0]
        assert choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls or []] in ([], ["get_weather"], ["get_time"])
    names = ("get_weather", "get_time")
    assert cut_call("<tool_call>\n{\"name\": \"get_", names) is None
    assert cut_call("<tool_call>\n{\"name\": \"get_t", names)["function"] == {"name": "get_time", "arguments": ""}
    assert cut_call("<tool_call>\n{\"name\": \"get_time\", \"argu", names)["function"]["name"] == "get_time"
    assert cut_call("<tool_call>\n{\"name\": \"get_tim", ("get_weather",)) is None  # not a name it may call


def test_a_forced_call_follows_the_references_in_its_parameters(client):
    """Parameters with $defs, as pydantic writes them: the references resolve (the grammar nests the schema)."""
    unit = {"$defs": {"Unit": {"enum": ["C", "F"]}}, "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
            "required": ["unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "temp", "parameters": unit}}]
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=40,
                                            tools=tools, tool_choice="required").choices[0]
    assert json.loads(choice.message.tool_calls[0].function.arguments) in ({"unit": "C"}, {"unit": "F"})


@pytest.mark.parametrize("fields, words, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_rain"}}}, "not among the tools", "tool_choice"),
    ({"tool_choice": "sometimes"}, 'tool_choice is "none", "auto", "required"', "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "each constrain", "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": 5}}]},
     r"tools\[0\] is not a function tool", "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}]},
     "the parameters of tool 'f': the JSON schema cannot be followed", "tools"),
    # checked whatever the choice: a tool no call could name, or whose arguments are no object
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "is not a tool's name", "tools"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "must be a schema of type object", "tools"),
    ({"tools": [{"type": "web_search"}]}, r"tools\[0\] is not a function tool", "tools"),
    # a stop inside a forced call cut it: its tags came back as the content, and no call
    ({"tool_choice": "required", "stop": ["{"]}, "stop cannot be combined with tool_choice required", "stop"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "extra_body": {"stop_token_ids": [5]}},
     "stop_token_ids cannot be combined with tool_choice naming a function", "stop_token_ids")])
def test_a_tool_choice_that_cannot_be_followed_is_a_400(client, fields, words, param):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4, tools=WEATHER)
    with pytest.raises(openai.BadRequestError, match=words) as e:
        client.chat.completions.create(**{**ask, **fields})
    assert e.value.body["param"] == param


def test_calls_are_read_out_of_the_text_in_each_templates_form():
    """Qwen's and Hermes' JSON in tags, GLM-4.5's name and argument pairs, Qwen3-Coder's <function=...> and
    <parameter=...> (a value JSON unless its tool declares it a string); a tag that holds no call stays text; a
    stream cut anywhere sends the same content and calls."""
    import random

    from expertcache.serve.reasoning import split_reply
    from expertcache.serve.tools import CallStream
    split_calls = lambda text, tools: split_reply(text, tools=tools)[1:]  # noqa: E731
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "depth": {"type": "integer"}}}}}]
    hermes = 'Looking. <tool_call>\n{"name": "ls", "arguments": {"path": "src", "depth": 2}}\n</tool_call>'
    glm = "Looking. <tool_call>ls\n<arg_key>path</arg_key>\n<arg_value>123</arg_value>\n<arg_key>depth</arg_key>\n" \
          "<arg_value>2</arg_value>\n</tool_call>"
    coder = "Looking. <tool_call>\n<function=ls>\n<parameter=path>\nsrc\n</parameter>\n<parameter=depth>\n2\n" \
            "</parameter>\n</function>\n</tool_call>"
    for text, arguments in ((hermes, {"path": "src", "depth": 2}), (glm, {"path": "123", "depth": 2}),
                            (coder, {"path": "src", "depth": 2})):
        content, (call,) = split_calls(text, tools)
        assert content == "Looking." and call["function"]["name"] == "ls" and call["type"] == "function"
        assert json.loads(call["function"]["arguments"]) == arguments
        for seed in range(20):  # the same, streamed in random pieces
            cuts = sorted(random.Random(seed).sample(range(1, len(text)), 6))
            stream = CallStream(tools)
            sent = "".join(stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)]))
            rest, calls = stream.end()
            assert (sent + rest).strip() == "Looking." and [c["function"] for c in calls] == [call["function"]]
    for text in ("<tool_call>not json</tool_call>", "<tool_call>rm\n</tool_call>", "a <tool_call> unclosed",
                 "<tool_call><function=rm>\n</function></tool_call>",
                 "<tool_call>[1, 2]</tool_call>", "plain <tool"):
        assert split_calls(text, tools) == (text, [])
        stream = CallStream(tools)
        assert stream.feed(text) + stream.end()[0] == text


def test_deepseeks_and_kimi_k2s_calls_are_read_out_of_their_markers():
    """DeepSeek-V3's calls (type, name, a ```json block), DeepSeek-V3.1's (name, arguments) and Kimi K2's
    (functions.NAME:INDEX, arguments) between their templates' markers, the markers around them left out; whole
    and streamed in random pieces; a <tool_call> (a forced call's form) is read too; a name no tool has stays text."""
    import random

    from expertcache.serve.reasoning import split_reply
    from expertcache.serve.tools import CallStream, call_syntaxes
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    args = '{"path": "src"}'
    v3 = ("Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ls\n```json\n" + args +
          "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    v31 = "Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>ls<｜tool▁sep｜>" + args + \
          "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    kimi = "Looking.<|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0<|tool_call_argument_begin|>" + \
           args + "<|tool_call_end|><|tool_calls_section_end|>"
    for template, text in (("{{ '<｜tool▁call▁begin｜>' }}", v3), ("{{ '<｜tool▁call▁begin｜>' }}", v31),
                           ("{{ '<|tool_call_begin|>' }}", kimi),
                           ("{{ '<|tool_call_begin|>' }}", 'Looking. <tool_call>{"name": "ls", "arguments": ' + args +
                            "}</tool_call>")):
        syntaxes = call_syntaxes(template)
        thought, content, (call,) = split_reply(text, tools=tools, calls=syntaxes)
        assert content == "Looking." and call["function"]["name"] == "ls"
        assert json.loads(call["function"]["arguments"]) == {"path": "src"}
        for seed in range(10):
            cuts = sorted(random.Random(seed).sample(range(1, len(text)), 6))
            stream = CallStream(tools, syntaxes)
            sent = "".join(stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)]))
            rest, calls = stream.end()
            assert (sent + rest).strip() == "Looking." and [c["function"] for c in calls] == [call["function"]]
    unknown = v31.replace(">ls<", ">rm<")
    assert split_reply(unknown, tools=tools, calls=call_syntaxes("<｜tool▁call▁begin｜>")) == (None, unknown, [])


CALL_TEMPLATE = """{% if tools %}TOOLS: {{ tools | tojson }}; call one as <tool_call>{"name": ..., "arguments": ...}\
</tool_call>
{% endif %}{% for m in messages %}{{ m.role | upper }}.
{{ m.content }}

{% endfor %}{% if add_generation_prompt %}ASSISTANT.
{% endif %}"""


def test_calls_written_in_the_templates_tags_come_back_as_tool_calls(tmp_path):
    """A template that writes calls in <tool_call> tags (Qwen's, Hermes'): under tool_choice auto, the calls the
    model writes come back in tool_calls, and the text around them as content, whole and streamed; a stream holds
    back nothing of an answer without calls; without tools, or with tool_choice none, the tags stay text."""
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(CALL_TEMPLATE)
    said = 'Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    writes = {"grammar": f"start: {json.dumps(said)}"}  # the model's text, as a model that calls would write it
    engine = Engine(path, EngineConfig(store="ram", max_seq=512))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], max_tokens=120, temperature=0)
        choice = client.chat.completions.create(**ask, tools=WEATHER, extra_body=writes).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
        chunks = [c for c in client.chat.completions.create(**ask, tools=WEATHER, extra_body=writes, stream=True)
                  if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Let me look."
        assert [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or []] == ["get_time"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        for kw in ({}, {"tools": WEATHER, "tool_choice": "none"}):
            choice = client.chat.completions.create(**ask, **kw, extra_body=writes).choices[0]
            assert choice.message.content == said and not choice.message.tool_calls
            assert choice.finish_reason == "stop"
        plain = client.chat.completions.create(**ask, tools=WEATHER).choices[0].message.content
        streamed = client.chat.completions.create(**ask, tools=WEATHER, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain
        two = {"grammar": f"start: {json.dumps(said + said.removeprefix('Let me look. '))}"}  # two calls written
        assert len(client.chat.completions.create(**ask, tools=WEATHER, extra_body=two).choices[0]
                   .message.tool_calls) == 2
        for stream in (False, True):  # parallel_tool_calls false: the first call only
            got = client.chat.completions.create(**ask, tools=WEATHER, parallel_tool_calls=False, stream=stream,
                                                 extra_body=two)
            calls = [t for c in got if c.choices for t in c.choices[0].delta.tool_calls or []] if stream else \
                got.choices[0].message.tool_calls
            assert [t.function.name for t in calls] == ["get_time"]
        response = client.responses.create(model=MODEL, input="Time?", tools=[{"type": "function", **t["function"]}
                                                                             for t in WEATHER],
                                           parallel_tool_calls=False, max_output_tokens=120, extra_body=two)
        assert [i.type for i in response.output] == ["message", "function_call"]
    engine.close()


def test_replies_are_split_into_reasoning_content_and_calls_in_each_templates_form():
    """<think> tags (also opened by the prompt), GPT-OSS's harmony channels (analysis, final, a commentary call to a
    function, the recipient before or after the channel), and <tool_call> tags after the reasoning; text with
    neither is left as written; a stream cut anywhere sends the same parts and calls, and the same answer to its
    whitespace (it sent the whitespace before a call, or at the end of an answer after reasoning, which the whole reply
    leaves out)."""
    import random

    from expertcache.serve.reasoning import Reply, opens_thinking, reply_form, split_reply
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = '{"city": "Paris"}'
    cases = [  # text, form, tools, opened -> reasoning, content, calls' (name, arguments)
        ("<think>\nLet me see.\n</think>\n\nHello there.", "think", None, False, "Let me see.", "Hello there.", []),
        ("Let me see.\n</think>\n\nHello.", "think", None, True, "Let me see.", "Hello.", []),
        (" No thoughts.\n", "think", None, False, None, " No thoughts.\n", []),
        ("<think>cut off mid", "think", None, False, "cut off mid", None, []),
        ("<think>Hm.</think>\n\nHello.\n\n", "think", None, False, "Hm.", "Hello.", []),  # cut after a line
        ("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + call + "}\n</tool_call>",
         "plain", tools, False, None, "Let me look.", [("get_weather", call)]),
        ("\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + call + "}\n</tool_call>\n", "plain",
         tools, False, None, None, [("get_weather", call)]),
        ("<think>Sunny?</think>Checking. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + call +
         "}\n</tool_call>", "think", tools, False, "Sunny?", "Checking.", [("get_weather", call)]),
        ("<|channel|>analysis<|message|>User asks.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.",
         "harmony", None, False, "User asks.", "It is sunny.", []),
        ("<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather <|constrain|>json<|message|>" + call, "harmony", tools, False, "Need the tool.",
         None, [("get_weather", call)]),
        (" to=functions.get_weather<|channel|>commentary json<|message|>" + call + "<|call|>", "harmony", tools,
         False, None, None, [("get_weather", call)]),
        ("Plain words, no header.", "harmony", None, False, None, "Plain words, no header.", []),
        ("<|channel|>analysis<|message|>cut", "harmony", None, False, "cut", None, []),
        ("They greet me.<|end|><|start|>assistant<|channel|>final<|message|>Hello!", "harmony", None,
         "assistant<|channel|>analysis", "They greet me.", "Hello!", []),  # the prompt opened the analysis
    ]
    for text, form, given, opened, thought, content, calls in cases:
        got = split_reply(text, form, given, opened)
        assert got[:2] == (thought, content) and [(c["function"]["name"], c["function"]["arguments"])
                                                  for c in got[2]] == calls, text
        for seed in range(20):
            reply, sent = Reply(form, given, opened), {}
            cuts = sorted(random.Random(seed).sample(range(1, len(text)), 6))
            deltas = [reply.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
            rest, streamed = reply.end()
            for delta in [*deltas, rest]:
                for k, v in delta.items():
                    sent[k] = sent.get(k, "") + v
            assert sent.get("reasoning_content") == thought and [c["function"] for c in streamed] == \
                [c["function"] for c in got[2]]
            assert (sent.get("content") or None) == (content or None), (text, sent)  # its whitespace too
        assert split_reply(text, form, given, opened, reasoning=False)[0] is None
    assert reply_form(TOOL_TEMPLATE) == "think" and reply_form(CALL_TEMPLATE) == "plain"
    assert opens_thinking("ASSISTANT.\n<think>\n") is True and not opens_thinking("<think></think>")
    assert opens_thinking("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>") == \
        "assistant<|channel|>analysis" and opens_thinking("<|end|><|start|>assistant") is False


THINKING_TEMPLATE = """{% for m in messages %}{{ m.role | upper }}.
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}

{% endfor %}{% if add_generation_prompt %}ASSISTANT.
{% if opened is defined %}<think>
{% endif %}{% endif %}"""
HARMONY_TEMPLATE = """{% for m in messages %}<|start|>{{ m.role }}{% if m.role == "assistant" %}<|channel|>final\
{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"""


@pytest.mark.parametrize("template, said, opened", [
    (THINKING_TEMPLATE, "<think>\nThey greet me.\n</think>\n\nHello!", False),
    (THINKING_TEMPLATE, "<think>\nThey greet me.\n</think>\n\nHello!", True),
    (HARMONY_TEMPLATE, "<|channel|>analysis<|message|>They greet me.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Hello!", False)], ids=["think", "think-opened-by-prompt", "harmony"])
def test_a_models_reasoning_comes_back_apart_from_its_answer(tmp_path, template, said, opened):
    """Where the template writes reasoning in <think> tags or in harmony channels, the model's reasoning comes back
    in reasoning_content and its answer in content, whole and streamed; include_reasoning false leaves the
    reasoning out, reasoning_format none leaves the text as written. (The text here is a grammar's, which makes an
    output the answer from its first token even where the prompt opened <think>: a JSON schema's value is no
    reasoning.)"""
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(template)
    writes = {"grammar": f"start: {json.dumps(said)}"}  # the model's text, as a reasoning model would write it
    engine = Engine(path, EngineConfig(store="ram", max_seq=512))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=60, temperature=0)
        kwargs = {"chat_template_kwargs": {"opened": True}} if opened else {}
        message = client.chat.completions.create(**ask, extra_body={**writes, **kwargs}).choices[0].message
        assert message.content == "Hello!" and message.model_extra["reasoning_content"] == "They greet me."
        chunks = [c.choices[0].delta for c in client.chat.completions.create(
            **ask, stream=True, extra_body={**writes, **kwargs}) if c.choices]
        assert "".join(d.content or "" for d in chunks) == "Hello!"
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks) == "They greet me."
        left_out = client.chat.completions.create(**ask, extra_body={**writes, **kwargs, "include_reasoning": False})
        assert left_out.choices[0].message.content == "Hello!"
        assert "reasoning_content" not in left_out.choices[0].message.model_extra
        raw = client.chat.completions.create(**ask, extra_body={**writes, **kwargs, "reasoning_format": "none"})
        assert raw.choices[0].message.content == said
        if opened:
            value = client.chat.completions.create(**ask, response_format={"type": "json_object"},
                                                   extra_body=kwargs).choices[0].message
            assert value.content.startswith("{") and "reasoning_content" not in value.model_extra
        with pytest.raises(openai.BadRequestError, match="reasoning_format"):
            client.chat.completions.create(**ask, extra_body={"reasoning_format": "hidden"})
    with BackgroundServer(create_app(Scheduler(engine), MODEL, reasoning_format="none")) as s:  # --reasoning-format
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        assert client.chat.completions.create(**ask, extra_body={**writes, **kwargs}).choices[0].message.content == said
        split = client.chat.completions.create(**ask, extra_body={**writes, **kwargs, "reasoning_format": "auto"})
        assert split.choices[0].message.content == "Hello!"
    engine.close()


def test_gpt_oss_calls_come_back_as_tool_calls(tmp_path):
    """A harmony template's model calls a tool in a commentary message to=functions.NAME: the call comes back in
    tool_calls with its reasoning apart, whole and streamed, finish_reason tool_calls."""
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    said = "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary " \
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    writes = {"grammar": f"start: {json.dumps(said)}"}
    engine = Engine(path, EngineConfig(store="ram", max_seq=512))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Oslo?"}], max_tokens=80, temperature=0,
                   tools=WEATHER, extra_body=writes)
        choice = client.chat.completions.create(**ask).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == "Look it up."
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert [t.function.name for c in chunks for t in c.delta.tool_calls or []] == ["get_weather"]
        assert chunks[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in chunks)
    engine.close()


def test_add_special_tokens_adds_the_tokenizers_own_where_asked(tmp_path):
    """vLLM's add_special_tokens: a completion's text prompt gets the tokenizer's own tokens (here a BOS) unless it
    is false; a chat's rendered prompt, which holds the template's, gets them only where it is true."""
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    engine = Engine(path, EngineConfig(store="ram", max_seq=128))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        prompt = lambda **kw: client.completions.create(  # noqa: E731
            model=MODEL, prompt="ROMEO.", max_tokens=1, extra_body=kw).usage.prompt_tokens
        chat = lambda **kw: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body=kw).usage.prompt_tokens
        assert prompt() == prompt(add_special_tokens=False) + 1
        assert chat(add_special_tokens=True) == chat() + 1
    engine.close()


def test_skip_special_tokens_false_keeps_their_text(client):
    """vLLM's skip_special_tokens: by default a special token's text is left out of the output; false keeps it; a
    value that is not a boolean is a 400."""
    ask = dict(model=MODEL, prompt="ROMEO.\n", max_tokens=2, temperature=0,
               extra_body={"ignore_eos": True, "logit_bias": {"0": 100}})  # <|endoftext|>, twice
    assert client.completions.create(**ask).choices[0].text == ""
    ask["extra_body"]["skip_special_tokens"] = False
    assert client.completions.create(**ask).choices[0].text == "<|endoftext|>" * 2
    with pytest.raises(openai.BadRequestError, match="skip_special_tokens"):
        client.completions.create(**{**ask, "extra_body": {"skip_special_tokens": "no"}})


def test_a_special_tokens_logprob_entry_names_it_and_its_bytes_are_its_text(client):
    """A special token (here the EOS that ends the output) has its text in logprobs, as vLLM shows it: its chat entry
    had the token "" but the bytes of <|endoftext|>, and completions listed "" where the text (skip_special_tokens
    false) held <|endoftext|>."""
    ask = dict(model=MODEL, max_tokens=2, temperature=0, logit_bias={"0": 100})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=1,
                                          **ask)
    entry = chat.choices[0].logprobs.content[0]
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "stop"
    assert entry.token == "<|endoftext|>" and bytes(entry.bytes).decode() == entry.token
    assert all(bytes(t.bytes).decode() == t.token for t in entry.top_logprobs)
    kept = client.completions.create(prompt="ROMEO.\n", logprobs=1, **ask,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].logprobs.tokens == ["<|endoftext|>"] * 2 == [kept.choices[0].text[:13]] * 2


def test_deepseeks_calls_come_back_as_tool_calls(tmp_path):
    """A template that writes DeepSeek's call markers: the model's call comes back in tool_calls, whole and
    streamed."""
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(CALL_TEMPLATE.replace("<tool_call>", "<｜tool▁call▁begin｜>"))
    said = 'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}' \
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    engine = Engine(path, EngineConfig(store="ram", max_seq=512))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], max_tokens=120, temperature=0,
                   tools=WEATHER, extra_body={"grammar": f"start: {json.dumps(said)}"})
        choice = client.chat.completions.create(**ask).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == "Let me look."
        assert [t.function.name for c in chunks for t in c.delta.tool_calls or []] == ["get_time"]
    engine.close()


def test_stop_strings_and_seeded_sampling(client):
    whole = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0).choices[0]
    first_line = whole.text.split("\n")[0]
    got = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0, stop=["\n"])
    assert got.choices[0].text == first_line and got.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0, stop=["\n"],
                                     extra_body={"include_stop_str_in_output": True})  # vLLM's
    assert kept.choices[0].text == first_line + "\n" and kept.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, prompt="JULIET.\n", max_tokens=16, temperature=0.9, top_p=0.9, seed=3,
              extra_body={"top_k": 50, "min_p": 0.02, "repetition_penalty": 1.1})
    text = lambda **over: client.completions.create(**{**kw, **over}).choices[0].text  # noqa: E731
    sampled = text()
    assert text() == sampled  # a seed makes a request repeatable
    assert text(seed=4) != sampled  # and the seed is the one that draws
    greedy = text(temperature=0)
    assert sampled != greedy  # the temperature samples
    assert text(extra_body={**kw["extra_body"], "top_k": 1}) == greedy  # top_k 1 leaves only the most likely
    assert text(temperature=0.05, top_p=1.0, extra_body={}) != text(temperature=2.0, top_p=1.0, extra_body={})


def test_penalties_and_logit_bias_sample_as_the_engine_does(client, reference):
    """presence_penalty, frequency_penalty and logit_bias, as OpenAI clients send them, give the engine's own
    tokens under the same SamplingParams; each changes the greedy answer, and +100 forces a token."""
    engine = reference.engine
    prompt = engine.encode("ROMEO.\n")
    def engine_text(**kw):
        gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=24, **kw))
        return "".join(step.text for step in gen)
    def served(**kw):
        return client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0,
                                         **kw).choices[0].text
    plain = served()
    token = engine.encode(" love", special=False)[0]
    for fields in [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(presence_penalty=-2.0),
                   dict(logit_bias={str(engine.encode(plain, special=False)[0]): -100})]:
        got = served(**fields)
        bias = tuple((int(t), float(b)) for t, b in fields.pop("logit_bias", {}).items())
        assert got == engine_text(logit_bias=bias, **fields) and got != plain, fields
    forced = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4, temperature=0.8, seed=1,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == engine.decode([token] * 4)


def test_min_tokens_hold_off_every_end(client, reference):
    """vLLM's min_tokens, as benchmark clients send it to fix an output's length: before that many tokens no stop
    token or stop string ends the output; after, they do again. The tokens are the engine's own under the same
    SamplingParams."""
    engine = reference.engine
    prompt = engine.encode("ROMEO.\n")
    plain = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=12, temperature=0)
    first = engine.encode(plain.choices[0].text, special=False)[0]
    kw = dict(model=MODEL, prompt="ROMEO.\n", max_tokens=12, temperature=0)
    ended = client.completions.create(**kw, extra_body={"stop_token_ids": [first]})
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"
    held = client.completions.create(**kw, extra_body={"stop_token_ids": [first], "min_tokens": 3})
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=12, min_tokens=3, stop_token_ids=(first,)))
    assert held.choices[0].text == "".join(step.text for step in gen) and held.usage.completion_tokens >= 3
    stop = plain.choices[0].text[:2]  # a stop string the first tokens hold
    assert client.completions.create(**kw, stop=[stop]).choices[0].text == ""
    late = client.completions.create(**kw, stop=[stop], extra_body={"min_tokens": 4}).choices[0].text
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=12, min_tokens=4, stop=(stop,)))
    assert late == "".join(step.text for step in gen) and late.startswith(stop)  # read again from the 5th token
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(**{**kw, "max_tokens": 2}, extra_body={"min_tokens": 3})


def test_logprobs_are_the_models_own(client, reference):
    """Each token's logprob, and its alternatives', are the model's log-softmax at that position, whole and
    streamed, in chat's and completions' layouts."""
    import torch
    engine = reference.engine
    ids = engine.encode("ROMEO.\n")
    tokens = list(generate(engine, ids, 4))
    engine.reset()
    with torch.no_grad():
        want = torch.log_softmax(engine.forward(torch.tensor(ids + tokens[:-1]), 0)[len(ids) - 1:], -1)
    got = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.tokens == [engine.decode([t]) for t in tokens] and lp.text_offset[0] == 0
    for j, t in enumerate(tokens):
        assert lp.token_logprobs[j] == pytest.approx(float(want[j, t]), abs=1e-4)
        top = torch.topk(want[j], 3)
        assert list(lp.top_logprobs[j]) == [engine.decode([i]) for i in top.indices.tolist()]
        assert list(lp.top_logprobs[j].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    streamed = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4, temperature=0, logprobs=3,
                                         stream=True)
    assert [x for c in streamed for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                                                abs=1e-4)
    # sampled: the chosen token is among the alternatives, the most likely one's or one more (up to logprobs + 1)
    hot = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=3, seed=1,
                                    logprobs=1).choices[0].logprobs
    assert all(token in top and len(top) <= 2 for token, top in zip(hot.tokens, hot.top_logprobs))
    assert any(len(top) == 2 for top in hot.top_logprobs)
    messages = [{"role": "user", "content": "Who goes there?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content and len(content) == 6
    for c in content:  # greedy: the chosen token is the most likely one
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert c.top_logprobs[1].logprob <= c.logprob < 0 and bytes(c.bytes).decode() == c.token
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert [x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content] \
        == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "lines": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "lines"], "additionalProperties": False}


def test_strict_closes_a_schemas_objects_and_a_tool_without_parameters_takes_none(client):
    """OpenAI's strict: true (a json_schema's, a tool's) allows no key beyond an object's listed properties where
    the schema does not say (JSON Schema's default lets the model add its own: it wrote "count coord them!"); a
    tool sent without parameters is a function of none, called with {} (it was called with any object)."""
    open_person = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": open_person, "strict": True}}
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=60, temperature=1.0)
    for choice in client.chat.completions.create(**ask, n=4, seed=3, response_format=fmt).choices:
        if choice.finish_reason == "stop":
            assert set(json.loads(choice.message.content)) == {"name", "lines"}
    tools = [{"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "weather", "strict": True, "parameters": {
                 "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}}}]
    for name, keys in (("now", set()), ("weather", {"city"})):
        forced = {"type": "function", "function": {"name": name}}
        for choice in client.chat.completions.create(**ask, n=3, seed=4, tools=tools, tool_choice=forced).choices:
            if choice.finish_reason == "tool_calls":
                (call,) = choice.message.tool_calls
                assert call.function.name == name and set(json.loads(call.function.arguments)) <= keys
    from expertcache.engine.structured import closed
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"properties": {"b": {}}}},
                                               "properties": {"const": {"properties": 1}}},
              "$defs": {"x": {"properties": {}, "additionalProperties": True}}}
    assert closed(nested) == {**nested, "additionalProperties": False, "properties": {"a": {"type": "array", "items": {
        "properties": {"b": {}}, "additionalProperties": False}}, "properties": {"const": {"properties": 1}}}}
    assert "additionalProperties" not in nested  # a property named "properties", and a const's value, kept as sent


def test_response_format_keeps_every_choice_to_its_json_schema(client):
    """json_object and json_schema (OpenAI's structured outputs), sampled, streamed and batched with other
    requests: every choice that ends is a JSON value of its schema; the built-in model, trained on plays, writes
    no JSON by itself."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=60,
                                           n=3, temperature=1.0, seed=5, response_format=fmt)
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}], max_tokens=60,
                                              stream=True, response_format=fmt)
    texts = [c.message.content for c in whole.choices]
    texts.append("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    assert all(c.finish_reason == "stop" for c in whole.choices)
    for text in texts:
        value = json.loads(text)
        assert set(value) == {"name", "lines"} and 0 <= value["lines"] <= 99 and len(value["name"]) <= 12
    anything = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=200, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].text.startswith("{")  # an object, cut or whole
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)
    free = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=8, temperature=0)
    assert not free.choices[0].text.lstrip().startswith("{")
    for fmt in ({"type": "json_object", "schema": PERSON}, {"type": "json_schema", "schema": PERSON}):  # llama-server's
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "c"}], max_tokens=60,
                                             temperature=0, response_format=fmt)
        assert set(json.loads(out.choices[0].message.content)) == {"name", "lines"}, fmt


def test_a_schema_past_the_grammars_limits_is_a_400_and_the_server_goes_on(client):
    """2,000 optional properties pass the schema's check, then exceed llguidance's parser limits at the first key,
    inside the generation: the request's fault, a 400 (it was a 500), and the next request is answered."""
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(2000)}}
    with pytest.raises(openai.BadRequestError, match="too large to follow"):
        client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=8, temperature=0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}})
    assert client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=2).choices[0].text


SMALL_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}


@pytest.mark.parametrize("extra", [{"guided_json": SMALL_LIST}, {"guided_json": json.dumps(SMALL_LIST)},
                                   {"structured_outputs": {"json": SMALL_LIST}}, {"json_schema": SMALL_LIST}])
def test_vllms_and_llama_cpps_ways_of_asking_for_a_schema_are_taken(client, extra):
    out = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=40, temperature=0, extra_body=extra)
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].text), list)
    with pytest.raises(openai.BadRequestError, match=f"response_format and {next(iter(extra))} each constrain") as e:
        client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=4,
                                  extra_body={**extra, "response_format": {"type": "json_object"}})
    assert e.value.body["param"] == next(iter(extra))


ANSWER = 'root ::= ("yes" | "no") ", " count " times."\ncount ::= [1-9] [0-9]?'  # GBNF, as llama.cpp takes it


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": "[0-9]{2}-[A-Z]{3}"}, lambda text: re.fullmatch("[0-9]{2}-[A-Z]{3}", text)),
    ({"structured_outputs": {"regex": "(yes|no), [a-z]{4}"}}, lambda text: re.fullmatch("(yes|no), [a-z]{4}", text)),
    ({"guided_choice": ["ROMEO", "JULIET", "the NURSE"]}, lambda text: text in ("ROMEO", "JULIET", "the NURSE")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda text: text in ("up", "down")),
    ({"guided_grammar": ANSWER}, lambda text: re.fullmatch(r"(yes|no), [0-9]+ times\.", text)),
    ({"grammar": ANSWER}, lambda text: re.fullmatch(r"(yes|no), [0-9]+ times\.", text)),
    ({"structured_outputs": {"grammar": 'start: ("ha")+ "!"'}}, lambda text: re.fullmatch("(ha)+!", text))])
def test_vllms_guided_regex_choice_and_grammar_are_followed(client, extra, check):
    """vLLM's guided_regex, guided_choice and guided_grammar (and their structured_outputs forms), llama.cpp's GBNF
    grammar: each choice, sampled, is a whole match, one of the strings or a sentence of the grammar, and ends
    there."""
    out = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=30, n=3, temperature=1.0, seed=4,
                                    extra_body=extra)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    with pytest.raises(openai.BadRequestError, match="each constrain the output") as e:
        client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=4, extra_body={**extra, "guided_json": {}})
    assert e.value.body["param"] in ("guided_json", *extra)


@pytest.mark.parametrize("extra, words, param", [({"guided_regex": "("}, "unclosed group", "guided_regex"),
                                                 ({"guided_choice": []}, "non-empty strings", "guided_choice"),
                                                 ({"guided_grammar": "root ::= x"}, "Rule 'x' not found",
                                                  "guided_grammar"),
                                                 ({"grammar": "root ::= (\"a\""}, "is not a grammar", "grammar"),
                                                 ({"structured_outputs": {"choice": "a", "regex": "b"}},
                                                  "structured_outputs is not supported", "structured_outputs")])
def test_a_regex_choice_or_grammar_that_cannot_be_followed_is_a_400(client, extra, words, param):
    with pytest.raises(openai.BadRequestError, match=words) as e:
        client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param
    assert e.value.body["message"].count("\n") == 0


def test_a_grammar_that_leads_nowhere_is_a_400_not_an_empty_answer(client):
    """A grammar whose rules never end (x ::= x) passes the parser's check and allows only an end: a 400 once its
    first token is asked for, where the answer was an empty text with finish_reason stop."""
    with pytest.raises(openai.BadRequestError, match="no text that continues from here") as e:
        client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=4,
                                  extra_body={"grammar": "root ::= x\nx ::= x"})
    assert e.value.body["message"].count("\n") == 0
    assert client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=2).choices[0].text


def test_llama_cpps_empty_grammar_asks_nothing(client):
    plain = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=6, temperature=0)
    assert client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=6, temperature=0,
                                     extra_body={"grammar": ""}).choices[0].text == plain.choices[0].text


@pytest.mark.parametrize("fmt, words", [({"type": "json_schema"}, "needs its schema"),
                                        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
                                         "needs its schema"),
                                        ({"type": "json_schema", "json_schema": {"name": "x",
                                                                                 "schema": {"type": "bogus"}}},
                                         "cannot be followed"),
                                        ({"type": "json_object", "min_tokens": 2}, "min_tokens=2 cannot"),
                                        # a schema without its type was dropped, the text unconstrained with a 200
                                        ({"json_schema": {"name": "x", "schema": PERSON}},
                                         r"gives json_schema with no type \(text\), which takes nothing more"),
                                        ({"type": "text", "json_schema": {"name": "x", "schema": PERSON}},
                                         "gives json_schema with type 'text'")])
def test_a_response_format_that_cannot_be_followed_is_a_400(client, fmt, words):
    extra = {"min_tokens": fmt.pop("min_tokens")} if "min_tokens" in fmt else {}
    with pytest.raises(openai.BadRequestError, match=words) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                       response_format=fmt, extra_body=extra)
    assert e.value.body["param"] in ("response_format", "min_tokens")


def test_logprob_bytes_are_the_tokens_own(reference):
    """A byte-level token that holds part of a character shows U+FFFD as text, but its bytes are exact: the
    tokens' bytes put together are the text's UTF-8."""
    server = create_app(Scheduler(reference.engine), MODEL).state.server
    text = "café naïve 日本語 — ok"
    ids = reference.engine.encode(text)
    assert "\ufffd" in "".join(server._token(t) for t in ids)  # some tokens split a character
    assert b"".join(bytes(server._bytes(t, server._token(t))) for t in ids) == text.encode()


@pytest.mark.parametrize("fields, param", [({"response_format": {"type": "xml"}}, "response_format"),
                                           ({"tool_choice": "required"}, "tool_choice"),
                                           ({"top_logprobs": 2}, "top_logprobs"),
                                           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                           ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_fields_not_implemented_are_refused_not_ignored(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       extra_body=fields)
    assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, best_of=3)


@pytest.mark.parametrize("field, meant", [("temprature", "temperature"), ("top-p", "top_p"),
                                         ("max_token", "max_tokens"), ("Seed", "seed")])
def test_a_misspelt_field_is_a_400_naming_the_field_meant(client, field, meant):
    """A known field misspelt would be ignored as another API's: a 400 that names the field meant; other APIs'
    fields that change nothing (user, store, metadata) still pass."""
    with pytest.raises(openai.BadRequestError, match=f"did you mean {meant}") as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       extra_body={field: 0})
    assert e.value.body["param"] == field
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                   extra_body={"user": "u", "store": False, "metadata": {"a": "b"}})


@pytest.mark.parametrize("fields", [{"function_call": {"name": "f"}}, {"modalities": ["text", "audio"]},
                                    {"bad_words": ["a"]}, {"allowed_token_ids": [1, 2]}, {"typical_p": 0.5},
                                    {"echo": True}, {"functions": [{"name": "f", "parameters": {}}]},
                                    {"n_predict": 8}, {"chat_template": "{{ messages }}"}, {"top_n_sigma": 1.0}])
def test_other_apis_fields_that_change_the_answer_are_refused(client, fields):
    """Fields of OpenAI's legacy API, vLLM's and llama.cpp's that this server does not implement: a 400, not an
    answer that ignores them; their neutral values pass."""
    name = next(iter(fields))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       extra_body=fields)
    assert e.value.body["param"] == name
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                   extra_body={"min_tokens": 0, "modalities": ["text"], "function_call": "auto",
                                               "logprobs": False, "top_logprobs": 0, "echo": False, "functions": [],
                                               "top_n_sigma": -1, "dry_multiplier": 0, "xtc_probability": 0.0})


@pytest.mark.parametrize("stream", [False, True])
def test_an_end_token_is_counted_as_logprobs_list_it(client, stream):
    """A choice that ends at an end token lists it in logprobs; the usage counted one token fewer (vLLM counts it),
    so a client summing its logprobs' tokens disagreed with the usage; never past max_tokens."""
    for max_tokens in (8, 4):
        kw = dict(model=MODEL, prompt="ROMEO.\n", max_tokens=max_tokens, temperature=0, logprobs=1,
                  extra_body={"min_tokens": 3, "logit_bias": {"0": 100}})
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            tokens = [t for c in chunks for ch in c.choices for t in ch.logprobs.tokens]
            reason, usage = [ch.finish_reason for c in chunks for ch in c.choices][-1], chunks[-1].usage
        else:
            got = client.completions.create(**kw)
            tokens, reason, usage = got.choices[0].logprobs.tokens, got.choices[0].finish_reason, got.usage
        assert reason == "stop" and tokens[-1] == "<|endoftext|>" and usage.completion_tokens == len(tokens) == 4


def test_nulls_stop_ids_and_the_generation_prompt(client, reference):
    """null is a field's default, as OpenAI's schema has it; stop_token_ids end the output as EOS does;
    add_generation_prompt false renders the conversation without the assistant's opening."""
    messages = [{"role": "user", "content": "Who goes there?"}]
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                               "top_k", "seed", "stop", "logprobs")}
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    with_nulls = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                extra_body={**nulls, "temperature": 0})
    assert with_nulls.choices[0].message.content == plain.choices[0].message.content
    engine = reference.engine
    ids = engine.encode(plain.choices[0].message.content, special=False)
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                             extra_body={"stop_token_ids": [ids[1]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2  # the stop id too
    template = ChatTemplate.of(engine)
    turn = messages + [{"role": "assistant", "content": "Nay"}]
    want = reference(engine.encode(template.render(turn, add_generation_prompt=False), special=False), 6)
    got = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=6, temperature=0,
                                         extra_body={"add_generation_prompt": False})
    assert got.choices[0].message.content == want
    refused = [*messages, {"role": "assistant", "content": [{"type": "refusal", "refusal": "Nay"}]},
               {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
    said = [*messages, {"role": "assistant", "content": "Nay"}, {"role": "user", "content": "Why?"}]
    assert client.chat.completions.create(model=MODEL, messages=refused, max_tokens=6, temperature=0) \
        .choices[0].message.content == reference(engine.encode(template.render(said), special=False), 6)


def test_a_template_that_renders_nothing_gets_a_400(monkeypatch):
    """A chat template may render a conversation as no text at all: a 400 naming it, not the engine's error."""
    from expertcache.serve import app as app_module
    from expertcache.serve.metrics import ServerMetrics
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    scheduler = Scheduler(engine)  # not started: no request reaches it
    server = app_module.Server(scheduler, MODEL, ServerMetrics(scheduler))
    monkeypatch.setattr(server.template, "render", lambda *a, **k: "")
    body = app_module.ChatBody(messages=[{"role": "user", "content": ""}], add_generation_prompt=False)
    with pytest.raises(app_module.APIError, match="empty prompt") as e:
        server.chat_prompt(body)
    assert e.value.status == 400
    engine.close()


def test_bodies_that_once_failed_inside_the_server_get_400s(server, client):
    """A text part that is not a string, a lone surrogate escape, a prompt too long to tokenize, a body that is
    not UTF-8, holds an integer of more digits than int() reads, or is not a JSON object: 400s naming the problem.
    A JSON body labelled another type is read as JSON. A seed at the top of its range with n=2 wraps for choice 1."""
    def post(body: dict | bytes, path: str = "/chat/completions", content_type: str = "application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(server.base_url + path, data=data, headers={"content-type": content_type})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    chat = {"model": MODEL, "max_tokens": 2}
    code, out = post({**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert code == 400 and "as a string" in out["error"]["message"]
    code, out = post(b'{"model": "%s", "max_tokens": 2, "prompt": "hi \\ud800"}' % MODEL.encode(), "/completions")
    assert code == 400 and "lone surrogate" in out["error"]["message"], out
    start = time.monotonic()
    code, out = post({**chat, "prompt": "word " * 300_000}, "/completions")  # within the body bound
    assert code == 400 and "characters" in out["error"]["message"] and time.monotonic() - start < 5
    code, out = post(b'{"prompt": "caf\xe9"}', "/completions")  # latin-1, not UTF-8
    assert code == 400 and "not UTF-8" in out["error"]["message"], out
    code, out = post(b'{"prompt": "hi", "max_tokens": %s}' % (b"9" * 5000), "/completions")  # past int()'s digits
    assert code == 400 and "cannot be read as JSON" in out["error"]["message"], out
    code, out = post(b"model=x", "/completions", "application/x-www-form-urlencoded")
    assert code == 400 and "the body is not valid JSON" in out["error"]["message"]
    code, out = post(b"[1]", "/completions")
    assert code == 400 and "the body must be a JSON object" in out["error"]["message"]
    # JSON however it is labelled, as llama-server reads it (`curl -d` sends the form type; both were 400s)
    for label in ("application/x-www-form-urlencoded", "text/plain", ""):
        code, out = post({"model": MODEL, "prompt": "a", "max_tokens": 1}, "/completions", label)
        assert code == 200 and len(out["choices"]) == 1, (label, out)
    got = client.completions.create(model=MODEL, prompt="a", max_tokens=2, n=2, seed=2**64 - 1)
    assert len(got.choices) == 2
    code, out = post({"model": MODEL, "max_tokens": 1, "n": 16, "prompt": ["a"] * 200}, "/completions")
    assert code == 400 and "generations in one request" in out["error"]["message"]


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(client, reference):
    """echo with logprobs: the prompt's tokens scored by the model (the first one by nothing), alone (max_tokens
    0) or before the completion; several prompts in one request are one choice each, in order."""
    import torch
    engine = reference.engine
    texts = ["ROMEO.\nWhat light", "JULIET.\nO Romeo"]
    ids = [engine.encode(t) for t in texts]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in got.choices] == [0, 1] and got.usage.completion_tokens == 0
    for prompt, text, choice in zip(ids, texts, got.choices):
        engine.reset()
        with torch.no_grad():
            want = torch.log_softmax(engine.forward(torch.tensor(prompt), 0), -1)
        lp = choice.logprobs
        assert choice.text == text and lp.tokens == [engine.decode([t]) for t in prompt]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([float(want[j - 1, t]) for j, t in enumerate(prompt) if j],
                                                      abs=1e-4)
        assert [max(top, key=top.get) for top in lp.top_logprobs[1:]] == \
            [engine.decode([int(want[j].argmax())]) for j in range(len(prompt) - 1)]
    one = client.completions.create(model=MODEL, prompt=texts[0], max_tokens=3, echo=True, logprobs=0,
                                    temperature=0).choices[0]
    alone = client.completions.create(model=MODEL, prompt=texts[0], max_tokens=3, temperature=0).choices[0].text
    assert one.text == texts[0] + alone and len(one.logprobs.tokens) == len(ids[0]) + 3
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=0)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_an_echo_streamed_sends_what_it_answers_whole(client, max_tokens):
    """echo with stream: each choice's prompt first, with its tokens' logprobs and offsets, then its completion; the
    text and logprobs are the whole answer's (it was a 400)."""
    ask = dict(model=MODEL, prompt=["ROMEO.\nWhat light", "JULIET.\nO"], max_tokens=max_tokens, echo=True,
               logprobs=1, temperature=0)
    whole = client.completions.create(**ask).choices
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    for choice in whole:
        own = [c for c in chunks if c.index == choice.index]
        assert own[0].text.startswith("ROMEO" if choice.index == 0 else "JULIET")
        assert "".join(c.text for c in own) == choice.text and own[-1].finish_reason == "length"
        lps = [c.logprobs for c in own if c.logprobs]
        assert [t for lp in lps for t in lp.tokens] == choice.logprobs.tokens
        assert [o for lp in lps for o in lp.text_offset] == choice.logprobs.text_offset
        # a batch's products may round apart from another's
        assert [x for lp in lps for x in lp.token_logprobs] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)


def test_n_choices_sample_with_successive_seeds(client):
    """n > 1: choice i samples as a request of its own with seed + i would; the prompt counts once in the usage."""
    kw = dict(model=MODEL, prompt="JULIET.\n", max_tokens=8, temperature=1.0)
    got = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [client.completions.create(seed=11 + i, **kw).choices[0].text
                                             for i in range(3)]
    assert len({c.text for c in got.choices}) > 1
    one = client.completions.create(seed=11, **kw).usage
    assert got.usage.prompt_tokens == one.prompt_tokens and got.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hail"}], n=2,
                                          max_tokens=4, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="n=17"):
        client.completions.create(n=17, **kw)
    streamed = {}  # n choices streamed: each chunk one choice by its index, the same texts as whole
    for c in client.completions.create(n=3, seed=11, stream=True, **kw):
        streamed[c.choices[0].index] = streamed.get(c.choices[0].index, "") + c.choices[0].text
    assert [streamed[i] for i in range(3)] == [c.text for c in got.choices]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hail"}], n=2,
                                                 max_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(x.delta.content or "" for x in mine) == chat.choices[i].message.content
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    continuous = list(client.chat.completions.create(  # vLLM's: every chunk with its choice's usage so far
        model=MODEL, messages=[{"role": "user", "content": "Hail"}], n=2, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for i in range(2):
        mine = [c for c in continuous if c.choices and c.choices[0].index == i]
        made = [c.usage.completion_tokens for c in mine]
        assert made[0] == 0 and made == sorted(made) and made[-1] == 4 and mine[-1].choices[0].finish_reason
        assert all(c.usage.prompt_tokens == chat.usage.prompt_tokens for c in mine)
    assert continuous[-1].usage.completion_tokens == 8
    for options, words in (({"include_usage": "yes"}, "include_usage"), ({"include_usage": True, "every": 1},
                                                                        "every")):
        with pytest.raises(openai.BadRequestError, match=words):  # refused, not read as true or ignored
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hail"}], max_tokens=2,
                                           stream=True, stream_options=options)
    texts = {}  # a prompt list streamed: choice p * n + i
    for c in client.completions.create(model=MODEL, prompt=["JULIET.\n", "ROMEO.\n"], n=2, max_tokens=4,
                                       temperature=0, stream=True):
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=["JULIET.\n", "ROMEO.\n"], n=2, max_tokens=4,
                                      temperature=0)
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]


def test_concurrent_requests_each_get_their_own_answer(client, reference):
    prompts = ["ROMEO.\n", "JULIET.\nO", "HAMLET.\nTo be", "KING.\nWhat"]
    want = [reference(reference.engine.encode(p), 16 + 4 * i) for i, p in enumerate(prompts)]
    got = [None] * len(prompts)

    def ask(i):
        got[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16 + 4 * i,
                                           temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_bad_requests_get_openai_errors(client, server):
    bad = urllib.request.Request(f"{server.base_url}/completions", data=b"{not json",
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="a", max_tokens=4)
    unnamed = urllib.request.Request(f"{server.base_url}/completions",  # no model: the one served, as vLLM takes it
                                     data=json.dumps({"prompt": "a", "max_tokens": 2, "temperature": 0}).encode(),
                                     headers={"content-type": "application/json"})
    assert json.loads(urllib.request.urlopen(unnamed).read())["choices"][0]["text"] == \
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens") as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=100_000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], temperature=-1)
    with pytest.raises(openai.BadRequestError, match="prompt") as e:
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="shorten the prompt") as e:  # a chat's prompt is its messages
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}])
    assert (e.value.body["param"], e.value.body["code"]) == ("messages", "context_length_exceeded")
    assert json.loads(get(f"{server.url}/health")) == {"status": "ok"}
    assert client.models.list().data[0].id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("fields,words", [({"seed": 2**70}, "seed"), ({"max_tokens": True}, "max_tokens"),
                                          ({"n": "2"}, "n"), ({"temperature": float("inf")}, "temperature"),
                                          ({"temperature": True}, "temperature must be a number"),
                                          ({"stop_token_ids": [10**6]}, "stop_token_ids must be token ids"),
                                          ({"presence_penalty": 2.5}, "presence_penalty"),
                                          ({"frequency_penalty": True}, "frequency_penalty must be a number"),
                                          ({"logit_bias": {"x": 1}}, "logit_bias key 'x' is not a token id"),
                                          ({"logit_bias": {"99999999": 1}}, "logit_bias key"),
                                          ({"logit_bias": {"1" * 5000: 1}}, "logit_bias key"),  # past int()'s digits
                                          ({"logit_bias": {"5": 101}}, "in [-100, 100]"),
                                          ({"logit_bias": {"5": "1"}}, "in [-100, 100]"),
                                          ({"logit_bias": [5]}, "logit_bias"),
                                          ({"tools": "weather"}, "tools"),
                                          ({"messages": [{"role": "wizard", "content": "a"}]}, "role"),
                                          ({"messages": [{"role": "user"}]}, "needs content"),
                                          # OpenAI's fields that change no answer, still checked as OpenAI checks them
                                          ({"user": 5}, "user: Input should be a valid string"),
                                          ({"service_tier": "bogus"}, "service_tier: Input should be 'auto'"),
                                          ({"metadata": {"a": 1}}, "metadata: holds at most 16 keys"),
                                          ({"response_format": {"type": "json_schema", "json_schema": {
                                              "schema": {"type": "object"}}}}, "json_schema needs its name"),
                                          ({"messages": [{"role": "user", "content": [
                                              {"type": "text", "text": "a"},
                                              {"type": "image_url", "image_url": {"url": "x"}}]}]},
                                           'messages[0]: a content part of type "image_url" is not supported'),
                                          # named as sent, not as max_tokens with a completion's advice
                                          ({"max_completion_tokens": 0}, "max_completion_tokens=0 generates "
                                           "nothing; send max_completion_tokens >= 1"),
                                          ({"max_completion_tokens": -5}, "max_completion_tokens=-5 must be >= 1")])
def test_malformed_fields_are_refused_with_400(server, fields, words):
    """Values a lax parser would coerce or pass on (a bool as a count, a string as n, an infinite temperature, a
    seed beyond 64 bits, an unknown role, a user message without content) get a 400 naming the field."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, **fields}
    req = urllib.request.Request(f"{server.base_url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and words in error["message"], error


@pytest.mark.parametrize("path,fields,param", [("/completions", {"prompt": [True, False]}, "prompt"),
                                                ("/completions", {"prompt": [[5, True]]}, "prompt"),
                                                ("/completions", {"prompt": [1.0]}, "prompt"),
                                                ("/completions", {"prompt": ["a", 5]}, "prompt"),
                                                ("/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
                                                ("/completions", {"prompt": "a", "temperature": True}, "temperature"),
                                                ("/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                                       "top_p": False}, "top_p")])
def test_a_bool_is_no_token_id_or_number_and_its_error_names_the_field(server, path, fields, param):
    """JSON true is neither token id 1 of a prompt (it ran as [1, 0]) nor a temperature of 1.0; its 400 names the
    field in `param`, as every other field's does (the numbers' had param null)."""
    req = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps({"max_tokens": 2, **fields}).encode(),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and error["param"] == param and "Value error" not in error["message"], error
    assert "prompt.str" not in error["message"] and "a number of alternatives a token" not in error["message"]


def call(server, path: str, body: dict) -> tuple[int, dict]:
    """POST a JSON body to the server's `path`: (status, the answer's JSON)."""
    status, _, answer = post(f"{server.url}{path}", json.dumps(body).encode())
    return status, answer


def test_tokenize_and_detokenize_count_as_the_endpoints_do(server, client, reference):
    """/tokenize and /detokenize, as vLLM's: a prompt's ids are the ones a completion runs, a conversation's the
    ones a chat completion runs (its usage counts them), and ids come back as their text."""
    engine = reference.engine
    status, got = call(server, "/tokenize", {"prompt": "ROMEO.\nBut soft!"})
    assert status == 200 and got["tokens"] == engine.encode("ROMEO.\nBut soft!") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512
    assert client.completions.create(model=MODEL, prompt="ROMEO.\nBut soft!", max_tokens=1).usage.prompt_tokens == \
        got["count"]
    messages = [{"role": "user", "content": "Who goes there?"}]
    status, chat = call(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and chat["count"] == client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    assert call(server, "/detokenize", {"tokens": got["tokens"]}) == (200, {"prompt": "ROMEO.\nBut soft!"})
    for path, body, words in [("/tokenize", {"prompt": "a", "messages": messages}, "either prompt"),
                              ("/tokenize", {}, "either prompt"), ("/tokenize", {"promt": "a"}, "promt"),
                              ("/detokenize", {"tokens": [10**6]}, "token ids in"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens")]:
        status, error = call(server, path, body)
        assert status == 400 and words in error["error"]["message"], (body, error)
    assert call(server, "/tokenize", {"model": "other", "prompt": "a"})[0] == 404


def test_an_api_key_is_required_where_one_is_set():
    """With --api-key, the API answers only "Authorization: Bearer KEY" (the openai client's api_key): a missing or
    wrong key gets a 401 (the client's AuthenticationError) before its body is looked at; probes, metrics and a
    browser's CORS preflight need none."""
    engine = Engine(None, EngineConfig(store="ram", max_seq=128))
    with BackgroundServer(create_app(Scheduler(engine), MODEL, ServerLimits(api_key="s3cret"))) as s:
        ok = openai.OpenAI(base_url=s.base_url, api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        assert ok.models.list().data[0].id == MODEL
        for key in ("wrong", "s3cre", "s3crett"):
            with pytest.raises(openai.AuthenticationError) as e:
                openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2)
            assert e.value.body["code"] == "invalid_api_key" and "--api-key" in e.value.body["message"]
        unread = urllib.request.Request(f"{s.base_url}/completions", data=b"{not json",  # refused before a 400
                                        headers={"content-type": "application/json"})
        for request in (unread, urllib.request.Request(f"{s.base_url}/models")):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request)
            assert e.value.code == 401 and e.value.headers["www-authenticate"] == "Bearer"
        assert json.loads(get(f"{s.url}/health")) == {"status": "ok"} and "expertcache" in get(f"{s.url}/metrics")
        assert call(s, "/tokenize", {"prompt": "a"})[0] == 401
        # a body that comes after its head is read before the 401: a connection closed with it unread or on its
        # way is reset, and the client loses the answer (urllib sends the head and the body in two writes)
        with socket.create_connection((s.host, s.port), timeout=10) as raw:
            raw.sendall(b"POST /tokenize HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 15\r\n\r\n")
            assert select.select([raw], [], [], 0.3)[0] == []  # no answer before the body
            raw.sendall(b'{"prompt": "a"}')
            answer = b"".join(iter(lambda: raw.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer
        with socket.create_connection((s.host, s.port), timeout=10) as raw:  # one waiting for "100 Continue" too
            raw.sendall(b"POST /tokenize HTTP/1.1\r\nHost: a\r\nContent-Length: 15\r\nExpect: 100-continue\r\n\r\n")
            assert raw.recv(65536).startswith(b"HTTP/1.1 401")
        asked = urllib.request.Request(f"{s.url}/tokenize", data=b'{"prompt": "a"}', headers={
            "content-type": "application/json", "authorization": "bearer s3cret"})  # the scheme in any case
        assert urllib.request.urlopen(asked).status == 200
        preflight = urllib.request.Request(f"{s.base_url}/chat/completions", method="OPTIONS", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})
        with urllib.request.urlopen(preflight) as r:
            assert r.status == 200
    engine.close()


def test_a_browser_page_may_call_the_api_and_probes_may_ask_with_head(server):
    """A chat page served from another origin calls the API from a browser: its CORS preflight is answered and
    the answer carries the origin's permission (any origin by default, as vLLM's and llama.cpp's servers);
    health and model probes may ask with HEAD."""
    preflight = urllib.request.Request(f"{server.base_url}/chat/completions", method="OPTIONS", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    with urllib.request.urlopen(preflight) as r:
        assert r.status == 200 and r.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    call = urllib.request.Request(f"{server.base_url}/completions", data=json.dumps(body).encode(),
                                  headers={"content-type": "application/json", "Origin": "http://localhost:3000"})
    with urllib.request.urlopen(call) as r:
        assert r.status == 200 and r.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    for path in (f"{server.url}/health", f"{server.base_url}/models", f"{server.base_url}/models/{MODEL}",
                 f"{server.url}/metrics"):
        with urllib.request.urlopen(urllib.request.Request(path, method="HEAD")) as r:
            assert r.status == 200


def test_unknown_paths_get_openai_errors(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{server.base_url}/nothing-here")
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["message"].startswith(
        "Invalid URL (GET /v1/nothing-here); this server answers /v1/completions")  # OpenAI's words, the way named


def test_a_wrong_method_gets_405_with_the_allowed_ones():
    """HTTP requires a 405 to say which methods the path takes (Allow); the error body stays OpenAI's."""
    from fastapi.testclient import TestClient
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    app = create_app(Scheduler(engine), MODEL)  # its worker is not started: no request reaches it
    r = TestClient(app).get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "GET /v1/completions is not allowed; this path takes POST"
    engine.close()


def test_disconnect_stops_generation_and_metrics(server):
    before = metric(server, 'expertcache_requests_total{outcome="cancelled"}')
    body = {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 400, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{server.base_url}/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        assert r.readline().startswith(b"data: ")
    deadline = time.monotonic() + 30
    while metric(server, 'expertcache_requests_total{outcome="cancelled"}') <= before:
        assert time.monotonic() < deadline, "the generation did not stop after the client left"
        time.sleep(0.1)
    # a whole (not streamed) request's client that leaves while its tokens flow
    before = metric(server, 'expertcache_requests_total{outcome="cancelled"}')
    body = json.dumps({**body, "stream": False, "max_tokens": 480, "ignore_eos": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while metric(server, "expertcache_active_requests") < 1:  # under way, then the client leaves
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while metric(server, 'expertcache_requests_total{outcome="cancelled"}') <= before:
        assert time.monotonic() < deadline, "a whole request's generation did not stop after its client left"
        time.sleep(0.1)
    for name in ["expertcache_cache_hit_rate", "expertcache_tokens_per_second", "expertcache_fetches_per_token",
                 "expertcache_request_latency_seconds_count", "expertcache_queue_length",
                 "expertcache_stall_seconds", "expertcache_substituted_mass_per_call"]:
        assert f"\n{name} " in get(f"{server.url}/metrics")
    assert metric(server, "expertcache_request_latency_seconds_count") > 0


def test_server_doc_python_example_prints_the_servers_answers(server):
    code = re.search(r"```python\n(.*?)```", SERVER_DOC.read_text(), re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code.replace("http://127.0.0.1:8000/v1", server.base_url), {})
    # what the example prints is the server's answers: the greedy chat reply, then the seeded streamed completion
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who goes there?"}],
                                           max_tokens=24, temperature=0).choices[0].message.content
    streamed = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=24, temperature=0.8, top_p=0.95,
                                         seed=1).choices[0].text
    assert reply.strip() and streamed.strip()
    assert out.getvalue() == f"{reply}\n{streamed}"


def test_a_stream_keeps_one_created_and_ends_with_done_after_an_error(monkeypatch):
    """Every chunk of a stream carries the same `created`, as OpenAI's and vLLM's; a generation that fails sends
    its error event and then [DONE], as vLLM's stream does (no usage chunk after the error)."""
    import asyncio
    import types
    from expertcache.engine.generate import StepOutput
    from expertcache.serve import app as app_module
    from expertcache.serve.metrics import ServerMetrics
    from expertcache.serve.scheduler import Request
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    scheduler = Scheduler(engine)  # not started: the stream's items are put by hand
    server = app_module.Server(scheduler, MODEL, ServerMetrics(scheduler))
    clock = iter(range(10**9, 10**9 + 100))  # a second passes between any two readings
    monkeypatch.setattr(app_module, "time", types.SimpleNamespace(time=lambda: next(clock)))

    async def events():
        merged = asyncio.Queue()
        for item in (StepOutput(5, "a", None), StepOutput(6, "b", None), RuntimeError("boom")):
            merged.put_nowait((0, item))
        request = Request([1, 2], SamplingParams(max_tokens=4), lambda item: None)
        return [e async for e in server._stream([request], merged, "cmpl-x", False,
                                                app_module.StreamOptions(include_usage=True), 2)]
    got = asyncio.run(events())
    chunks = [json.loads(e.removeprefix("data: ")) for e in got[:2]]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b"]
    assert chunks[0]["created"] == chunks[1]["created"]
    assert "boom" in json.loads(got[2].removeprefix("data: "))["error"]["message"] and got[3:] == ["data: [DONE]\n\n"]
    engine.close()


def test_failed_fetch_ends_the_request_and_the_server_keeps_serving(tmp_path, reference):
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold", max_seq=256))
    blob = tmp_path / "experts.bin"
    original = blob.read_bytes()
    want = reference(reference.engine.encode("ROMEO.\n"), 8)
    scheduler, failed = Scheduler(engine), []
    scheduler.on_error = lambda request, e: failed.append(e)  # `serve` logs it whole: the client's has no folders
    with BackgroundServer(create_app(scheduler, MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        os.truncate(blob, len(original) // 2)  # the later layers' experts now read short
        with pytest.raises(openai.InternalServerError, match="short read") as refused:
            client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=8, temperature=0)
        assert str(tmp_path) not in str(refused.value)
        assert len(failed) == 1 and f"--out {tmp_path.absolute()}" in str(failed[0]), failed
        with pytest.raises(urllib.error.HTTPError) as health:  # it said ok while every such request failed
            get(f"{s.url}/health")
        status = json.loads(health.value.read())["status"]
        assert health.value.code == 503 and f"experts.bin is {len(original) // 2} bytes" in status, status
        assert str(tmp_path) not in status
        blob.write_bytes(original)
        assert json.loads(get(f"{s.url}/health"))["status"] == "ok"
        got = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=8, temperature=0)
        assert got.choices[0].text == want
        os.replace(tmp_path / "experts.json", tmp_path / "header")  # a store converted again: another file
        shutil.copy(blob, tmp_path / "copy")
        os.replace(tmp_path / "copy", blob)
        with pytest.raises(urllib.error.HTTPError) as health:
            get(f"{s.url}/health")
        assert "replaced since it was opened; restart" in json.loads(health.value.read())["status"]
    engine.close()


def test_a_tokenizer_of_another_model_gets_400_and_token_ids_still_serve(tiny, tmp_path):
    """Text through a tokenizer whose ids go beyond the model's embeddings is refused with a 400 that says so; a
    prompt of token ids is still served."""
    path = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], path)
    shutil.copy(BUILTIN_MODEL / "tokenizer.json", path)
    engine = Engine(path, EngineConfig(initial="cold", max_seq=64))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="beyond its vocabulary"):
            client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4, temperature=0)
        got = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert got.usage.completion_tokens == 4
    engine.close()


def test_without_a_tokenizer_the_text_is_the_ids_joined_by_spaces_whole_streamed_and_echoed(tiny):
    """A checkpoint without tokenizer.json serves prompts of token ids; its completions' text was empty, where its
    echo and text_offset read the ids joined by spaces (Engine.decode)."""
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(store="ram", max_seq=64))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=0)
        got = client.completions.create(**ask).choices[0]
        ids = got.logprobs.tokens
        assert len(ids) == 4 and all(t.isdigit() for t in ids) and got.text == " ".join(ids)
        assert all(got.text[o:o + len(t)] == t for t, o in zip(ids, got.logprobs.text_offset))
        assert "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True)) == got.text
        echoed = client.completions.create(**ask, echo=True).choices[0]
        assert echoed.text == "5 6 7 " + got.text and echoed.logprobs.tokens == ["5", "6", "7", *ids]
        assert all(echoed.text[o:o + len(t)] == t for t, o in zip(echoed.logprobs.tokens, echoed.logprobs.text_offset))
    engine.close()


def test_serve_verb_refuses_a_taken_port(capsys):
    from expertcache import cli
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli.main(["serve", "--store", "ram", "--port", str(taken.getsockname()[1])]) == 2
    assert "choose another --port" in capsys.readouterr().err


def test_sigterm_ends_running_streams_after_the_shutdown_timeout(tmp_path):
    """A stopped server does not wait for a long generation: after --shutdown-timeout it ends its streams and
    exits, within the grace a container runtime gives before it kills. A stream ends with a 503 chunk and [DONE] and
    a whole request with a 503 (a stream was cut off mid-chunk, and the log showed a traceback)."""
    import signal
    import subprocess
    import sys
    import types
    proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "serve", "--store", "ram", "--port", "0",
                             "--shutdown-timeout", "1"], stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:  # a first run's compile notice may come first
            line = proc.stderr.readline()
            assert line, "the server exited before serving"
        url = re.search(r"http://\S+/v1", line).group(0)
        body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
        stream = urllib.request.urlopen(urllib.request.Request(
            f"{url}/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}))
        assert stream.readline().startswith(b"data: ")  # generating
        whole = []  # a whole request's answer: an OpenAI 503, not uvicorn's bare 500 of a cancelled task
        asking = threading.Thread(target=lambda: whole.append(post(f"{url}/completions", json.dumps(
            {**body, "stream": False}).encode())))
        asking.start()
        while metric(types.SimpleNamespace(url=url.removesuffix("/v1")), "expertcache_active_requests") < 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn's shutdown done, it dies of the signal it caught
        assert time.monotonic() - start < 10
        rest = stream.read().decode().strip().split("\n\n")
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == \
            "shutting_down", rest[-2:]
        asking.join(30)
        status, _, error = whole[0]
        assert status == 503 and error["error"]["code"] == "shutting_down"
        log = proc.stderr.read()
        assert "Traceback" not in log and "Exception in ASGI" not in log, log
    finally:
        proc.kill()
        proc.stderr.close()


def test_a_hang_up_drains_the_server_as_sigterm_does():
    """SIGHUP (the terminal or ssh session that started it gone) ended the server at once, the requests in flight cut
    off with tracebacks; it drains them as SIGTERM does, then the process dies of the signal."""
    import signal
    import subprocess
    import sys
    import types
    proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "serve", "--store", "ram", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, "the server exited before serving"
        url = re.search(r"http://\S+/v1", line).group(0)
        answers = []
        asking = threading.Thread(target=lambda: answers.append(post(f"{url}/completions", json.dumps(
            {"prompt": "a", "max_tokens": 200, "ignore_eos": True}).encode())))
        asking.start()
        while metric(types.SimpleNamespace(url=url.removesuffix("/v1")), "expertcache_active_requests") < 1:
            time.sleep(0.02)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == -signal.SIGHUP
        asking.join(30)
        status, _, body = answers[0]
        assert status == 200 and body["usage"]["completion_tokens"] == 200, answers
        log = proc.stderr.read()
        assert "Traceback" not in log, log
    finally:
        proc.kill()
        proc.stderr.close()


def test_a_server_short_of_open_files_serves_fewer_connections_and_says_so_once():
    """Under a low open-files limit (ulimit -n) the server takes as many connections as the limit holds and says
    so in one line; clients past every file wait, said once, not in a traceback per accept (asyncio wrote
    thousands a second), and are served once others close. Too few files for any connection are refused."""
    import resource
    import socket
    import subprocess
    import sys

    def limited(n):
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    serve = [sys.executable, "-m", "expertcache.cli", "serve", "--store", "ram", "--port", "0"]
    proc = subprocess.Popen(serve, stderr=subprocess.PIPE, text=True, preexec_fn=limited(80))
    socks = []
    try:
        line, said = "", []
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, "the server exited before serving"
            said.append(line)
        assert any("open files are allowed (ulimit -n): at most" in x for x in said), said
        url = re.search(r"http://\S+/v1", line).group(0)
        host, port = re.search(r"//([^:/]+):(\d+)", url).groups()
        socks = [socket.create_connection((host, int(port))) for _ in range(120)]  # past the server's 80 files
        time.sleep(2)
        for s in socks:
            s.close()
        socks = []
        assert urllib.request.urlopen(f"{url}/models", timeout=30).status == 200
        proc.terminate()
        log = proc.stderr.read()
        assert "Traceback" not in log and log.count("cannot accept connections") == 1, log[:2000]
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.stderr.close()
    done = subprocess.run(serve, capture_output=True, text=True, preexec_fn=limited(30), timeout=300)
    assert done.returncode == 2 and "too few to serve" in done.stderr.strip().splitlines()[-1], done.stderr


@pytest.mark.parametrize("family,interleaves", [("qwen3_moe", True), ("qwen3_next", False), ("deepseek_v3", False)])
def test_models_with_more_than_kv_state_serve_one_request_at_a_time(tiny, family, interleaves):
    """A turn swaps in a request's keys and values only: a model with MLA's latent cache or
    DeltaNet's recurrent state must not interleave requests, or their states would mix."""
    engine = Engine(tiny[family][0], EngineConfig(initial="cold"))
    scheduler = Scheduler(engine)
    assert scheduler.interleaves is interleaves and (scheduler.max_active > 1) is interleaves
    engine.close()


@pytest.mark.parametrize("family,schedule", [("qwen3_moe", "batch"), ("qwen3_moe", "serial"), ("qwen3_next", "batch"),
                                             ("deepseek_v3", "batch")])
def test_warm_up_runs_a_requests_steps_and_leaves_fresh_counts(tiny, family, schedule):
    """serve's start-up runs the steps requests take (where kernels compile on a first run), for every kind of
    sequence state and schedule; the counts start afresh, and a request after it is answered as without it."""
    from expertcache.engine.sampling import SamplingParams
    from expertcache.serve.scheduler import Request, SchedulerConfig
    engine = Engine(tiny[family][0], EngineConfig(store="ram", initial="cold"))
    want = list(generate(engine, [3, 4, 5], 4))
    scheduler = Scheduler(engine, SchedulerConfig(schedule=schedule))
    scheduler.warm_up()
    assert engine.stats.tokens == 0 and engine.stats.routed == 0
    got, done = [], threading.Event()
    scheduler.start()
    scheduler.submit(Request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True),
                             lambda out: done.set() if out is None else got.append(out.token)))
    assert done.wait(60) and got == want
    scheduler.stop()
    engine.close()
    for max_seq in (1, 4):  # any context a server may be given; 1 is too short to warm up in
        short = Engine(tiny[family][0], EngineConfig(store="ram", max_seq=max_seq))
        Scheduler(short, SchedulerConfig(schedule=schedule)).warm_up()
        short.close()


def test_text_offsets_place_split_characters_stray_bytes_and_special_tokens():
    """Each token's text_offset is where its text starts in the text: the bytes of a split character where that
    character does; a token after a byte that forms no character after its U+FFFD (it was placed on it); a special
    token's text where skip_special_tokens false keeps it (every one was placed at 0)."""
    from tokenizers import Tokenizer

    from expertcache.serve.app import _Offsets
    tokenizer = Tokenizer.from_file(str(BUILTIN_MODEL / "tokenizer.json"))
    context = tokenizer.encode("ROMEO.\n").ids
    end = tokenizer.token_to_id("<|endoftext|>")
    assert _Offsets(tokenizer, context, skip_special=False).of([end] * 3) == [0, 13, 26]
    assert _Offsets(tokenizer, context).of([end] * 3) == [0, 0, 0]
    comma = tokenizer.encode(",").ids[0]
    stray = next(t for t in range(300) if tokenizer.decode([t, comma]) == "\ufffd,")  # a byte of no character
    assert tokenizer.decode([stray, comma] * 3) == "\ufffd,\ufffd,\ufffd,"
    assert _Offsets(tokenizer, context).of([stray, comma] * 3) == [0, 1, 2, 3, 4, 5]
    ids = tokenizer.encode("é€😀 naïve").ids
    text = tokenizer.decode(ids)
    offsets = _Offsets(tokenizer, []).of(ids)
    starts = [text.index(c) for c in "é€😀"]  # the characters split over tokens: each token at its character
    assert offsets[:8] == [starts[0], *[starts[1]] * 3, *[starts[2]] * 4] and offsets == sorted(offsets)
    for token, at in zip(ids, offsets):
        own = tokenizer.decode([token])
        assert own == "\ufffd" or text[at:at + len(own)] == own


def test_text_offsets_stay_in_the_text_past_split_characters(client):
    """A token may end inside a UTF-8 character (its text is U+FFFD); the tokens after it still start where
    text_offset says, echoed or streamed."""
    prompt = "café naïve 日本語 😀 end"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    # a token within a character is named by its bytes, as OpenAI's: the alternatives keep one key each
    assert {"bytes:\\xc3", "bytes:\\xaf", "bytes:\\xf0"} <= set(lp.tokens) and "\ufffd" not in lp.tokens
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    placed = [text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset) if not t.startswith("bytes:")]
    assert all(placed) and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=0, temperature=0,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    pairs = [(t, o) for c in chunks if c.choices[0].logprobs for t, o in zip(c.choices[0].logprobs.tokens,
                                                                              c.choices[0].logprobs.text_offset)]
    assert pairs and all(text[o:o + len(t)] == t for t, o in pairs if not t.startswith("bytes:"))


def test_the_access_log_has_a_line_per_request():
    from expertcache.serve.access_log import AccessLog
    engine = Engine(None, EngineConfig(store="ram", max_seq=128))
    app, lines = create_app(Scheduler(engine), MODEL), []
    app.add_middleware(AccessLog, log=lines.append)
    with BackgroundServer(app) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=4, temperature=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                            stream=True))
        with socket.create_connection((s.host, s.port)) as gone:  # leaves before its body: no fault of the server's
            gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        deadline = time.monotonic() + 30
        while len(lines) < 4:
            assert time.monotonic() < deadline, "its line did not come"
            time.sleep(0.05)
        cut = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=100, temperature=0,
                                        extra_body={"ignore_eos": True}, stream=True)
        read = [next(cut) for _ in range(5)]
        cut.close()  # a client that leaves mid-stream: its line counts what it was sent (it logged 0)
        while len(lines) < 5:
            assert time.monotonic() < deadline, "its line did not come"
            time.sleep(0.05)
    engine.close()
    sent = re.fullmatch(r"POST /v1/completions -> 200, \d+ prompt \+ (\d+) completion tokens, \d+ ms", lines[4])
    assert len(read) == 5 and sent and 5 <= int(sent.group(1)) < 100, lines[4]
    assert re.fullmatch(r"POST /v1/completions -> 200, \d+ prompt \+ 4 completion tokens, \d+ ms", lines[0]), lines
    assert re.fullmatch(r"POST /v1/completions -> 404, \d+ ms", lines[1]), lines
    assert re.fullmatch(r"POST /v1/chat/completions -> 200, \d+ prompt \+ 3 completion tokens, \d+ ms", lines[2])
    assert re.fullmatch(r"POST /v1/completions -> 499, \d+ ms", lines[3]), lines


def _submit(scheduler, prompt, max_tokens):
    """A request whose outputs collect in `.items`; `.done` is set at its end."""
    from expertcache.engine.sampling import SamplingParams
    from expertcache.serve.scheduler import Request
    items, done = [], threading.Event()
    request = Request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                      lambda item: (items.append(item), item is None and done.set()))
    request.items, request.done = items, done
    scheduler.submit(request)
    return request


def test_a_failure_outside_any_step_ends_its_requests_and_the_worker_goes_on(tiny):
    """An exception between steps (here the finish hook, once) ends the requests the round was running with
    an error instead of killing the worker thread (which left every request waiting forever); later requests
    are served, and /health says so."""
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    calls = []

    def on_finish(request, outcome):
        calls.append(outcome)
        if len(calls) == 1:
            raise RuntimeError("a bug in the bookkeeping")
    scheduler = Scheduler(engine, on_finish=on_finish)
    app = create_app(scheduler, MODEL)
    scheduler.on_finish = on_finish  # in place of the metrics' hook
    with BackgroundServer(app) as s:
        short, long = _submit(scheduler, [1, 2, 3], 1), _submit(scheduler, [4, 5, 6], 30)
        assert short.done.wait(60) and long.done.wait(60), "a request waits forever"
        assert isinstance(long.items[-2], RuntimeError)
        later = _submit(scheduler, [1, 2, 3], 4)
        assert later.done.wait(60) and [i.token is not None for i in later.items[:-1]] == [True] * 4
        assert json.loads(get(f"{s.url}/health")) == {"status": "ok"}
    engine.close()


def test_a_failure_the_worker_cannot_recover_from_ends_every_request_and_health_says_so(tiny, monkeypatch):
    """When the repair after a failure fails too, every waiting and later request ends with an error (none
    waits forever), /health answers 503 naming the failure, and on_fatal lets `serve` exit non-zero."""
    from expertcache.serve import scheduler as scheduling
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    scheduler = Scheduler(engine)
    fatal = threading.Event()
    scheduler.on_fatal = lambda e: fatal.set()
    with BackgroundServer(create_app(scheduler, MODEL)) as s:
        monkeypatch.setattr(scheduler, "_round", lambda: (_ for _ in ()).throw(RuntimeError("broken round")))
        monkeypatch.setattr(scheduling, "repair_cache", lambda engine: (_ for _ in ()).throw(OSError("no disk")))
        first = _submit(scheduler, [1, 2, 3], 4)
        assert first.done.wait(60) and fatal.wait(60)
        assert isinstance(first.items[0], RuntimeError)
        later = _submit(scheduler, [1, 2, 3], 4)
        assert later.done.is_set() and "no disk" in str(later.items[0])
        with pytest.raises(urllib.error.HTTPError) as health:
            get(f"{s.url}/health")
        assert health.value.code == 503 and "no disk" in json.loads(health.value.read())["status"]
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError, match="restarted") as refused:
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        assert refused.value.status_code == 503
    engine.close()


def post(url: str, body: bytes) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a POST."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_bodies_past_the_servers_bounds_get_4xx_not_500(server):
    """A body over 8 MiB: 413; nested 100 deep (json.loads recursion): 400; too many or too long stop
    strings, over 128 fields, a string for a flag or a number (pydantic read "yes" as true): 400. The server
    answers the next request."""
    url = f"{server.base_url}/completions"
    import http.client
    conn = http.client.HTTPConnection(server.host, server.port)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(9 * 2**20))
    conn.endheaders()  # refused by its length, before any of it is sent
    refused = conn.getresponse()
    assert refused.status == 413 and "--max-body-bytes" in json.loads(refused.read())["error"]["message"]
    conn.close()
    deep = b'{"model": "%s", "prompt": "hi", "user": %s%s}' % (MODEL.encode(), b"[" * 100, b"]" * 100)
    status, _, body = post(url, deep)
    assert status == 400 and "nests" in body["error"]["message"]
    in_string = json.dumps({"model": MODEL, "prompt": "[" * 100, "max_tokens": 1}).encode()  # brackets in text
    assert post(url, in_string)[0] == 200
    for stop in (["x"] * 17, ["x" * 300]):
        status, _, body = post(url, json.dumps({"model": MODEL, "prompt": "hi", "stop": stop}).encode())
        assert status == 400 and body["error"]["param"] == "stop"
    many = {"model": MODEL, "prompt": "hi", **{f"x{i}": 0 for i in range(200)}}  # each checked for a misspelling
    status, _, body = post(url, json.dumps(many).encode())
    assert status == 400 and "202 fields" in body["error"]["message"]
    for field, value in (("stream", "yes"), ("stream", "false"), ("echo", 1), ("temperature", "0"), ("top_p", "1")):
        status, _, body = post(url, json.dumps({"model": MODEL, "prompt": "hi", field: value}).encode())
        assert status == 400 and body["error"]["param"] == field, (field, value)
    assert post(url, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode())[0] == 200


def test_past_max_connections_a_request_gets_the_apis_503_and_health_its_answer(tiny):
    """uvicorn's limit answered text/plain "Service Unavailable" without Retry-After, /health too: a liveness probe
    could have a server restarted for being busy. Past --max-connections a request gets an OpenAI error body with
    Retry-After, /health its answer, and once connections close requests are served again."""
    from expertcache.serve.limits import ServerLimits
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    app = create_app(Scheduler(engine), MODEL, ServerLimits(max_connections=2))
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    with BackgroundServer(app) as s:
        idle = [socket.create_connection((s.host, s.port)) for _ in range(2)]
        deadline = time.monotonic() + 30
        while app.state.connections.count < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, headers, error = post(f"{s.base_url}/completions", body)
        assert status == 503 and headers.get("retry-after") == "1", (status, error)
        assert error["error"]["code"] == "too_many_connections" and "--max-connections" in error["error"]["message"]
        assert json.loads(get(f"{s.url}/health"))["status"] == "ok"
        for sock in idle:
            sock.close()
        while app.state.connections.count > 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert post(f"{s.base_url}/completions", body)[0] == 200
    engine.close()


def test_a_body_of_a_content_coding_gets_415(server):
    """The server reads bodies as they come: a gzip body got a 400 saying it was not UTF-8, and a plain JSON body
    labelled gzip a 200, as if it had been decoded. Any coding but identity is refused, and the connection
    answers the next request."""
    import gzip
    import http.client
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    conn = http.client.HTTPConnection(server.host, server.port)
    for coding, sent in (("gzip", gzip.compress(body)), ("gzip", body), ("br", body), ("identity", body)):
        conn.request("POST", "/v1/completions", sent, {"Content-Type": "application/json",
                                                        "Content-Encoding": coding})
        got = conn.getresponse()
        answer = json.loads(got.read())
        if coding == "identity":
            assert got.status == 200, answer
        else:
            assert got.status == 415 and f"Content-Encoding '{coding}'" in answer["error"]["message"], answer
    conn.close()


def test_json_depth_reads_strings_as_jsons_scanner_does():
    """The nesting check skips brackets within strings, whose quotes an odd run of backslashes escapes, in linear
    time: a 64 KB body of escaped quotes held the event loop 19 s (a backtracking pattern), 8 MB would have held it
    for days."""
    import random
    from expertcache.serve.limits import json_depth

    def scanned(text: str) -> int:  # json's own rule, a character at a time
        depth = deepest = 0
        inside = escaped = False
        for c in text:
            if inside:
                escaped, inside = (False, True) if escaped else (c == "\\", c != '"')
            elif c == '"':
                inside = True
            elif c in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif c in "]}":
                depth -= 1
        return deepest
    rng = random.Random(0)

    def value(depth: int):
        if depth > 5 or rng.random() < 0.3:
            return rng.choice(["x", "\\", '"', "[", "{", '\\"', "é", "]", "}"]) * rng.randint(0, 4)
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["[", '"', "\\", "k"]) * rng.randint(0, 3) + str(i): value(depth + 1)
                for i in range(rng.randint(0, 3))}
    for _ in range(2000):
        text = json.dumps(value(0), ensure_ascii=rng.random() < 0.5)
        assert json_depth(text.encode()) == scanned(text), text
    for body in (b'{"prompt": "' + b'\\"' * 4 * 2**20, b"[" * 8 * 2**20, b'"' * 8 * 2**20, b"\\" * 8 * 2**20):
        start = time.perf_counter()
        json_depth(body)
        assert time.perf_counter() - start < 5


def test_a_client_that_sends_no_request_or_no_body_frees_its_connection(tiny):
    """uvicorn waits for a request's head forever, and the app waited for its body: --max-connections silent
    clients (or clients gone without a FIN) left every other client a 503. A head late by read_timeout_s closes
    its connection; a body that late gets a 408 (and the connection closes); a slow but timely one is served."""
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" \
        % len(body)
    with BackgroundServer(create_app(Scheduler(engine), MODEL, ServerLimits(read_timeout_s=2))) as s:
        silent, partial, bodyless, slow = (socket.create_connection((s.host, s.port), timeout=20) for _ in range(4))
        partial.sendall(head[:10])
        bodyless.sendall(head)
        time.sleep(1)
        slow.sendall(head)
        time.sleep(1)
        slow.sendall(body)
        assert silent.recv(100) == b"" and partial.recv(100) == b""  # closed
        answer = bodyless.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer
        assert slow.recv(100).startswith(b"HTTP/1.1 200 ")
        for c in (silent, partial, bodyless, slow):
            c.close()
    engine.close()


def test_read_timeout_sets_the_servers_deadlines():
    """`serve --read-timeout` is the limits' read_timeout_s: every deadline a client is given."""
    import argparse

    from expertcache.commands import serve as serve_verb
    p = argparse.ArgumentParser()
    serve_verb.add_arguments(p)
    server = serve_verb.build_app(p.parse_args(["--store", "ram", "--read-timeout", "7.5"])).state.server
    assert server.limits.read_timeout_s == 7.5
    server.scheduler.engine.close()


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_generation_cancelled():
    """uvicorn waits forever on a client whose socket is full: a stream never read held its connection (every
    --max-connections slot, with enough of them) and generated on to max_tokens for nobody. A response that waits
    read_timeout_s on a client that takes none of its bytes is cut off, and its generation cancelled."""
    engine = Engine(None, EngineConfig(store="ram", max_seq=2048))
    scheduler = Scheduler(engine)
    app = create_app(scheduler, MODEL, ServerLimits(read_timeout_s=1))
    ended, observe = [], scheduler.on_finish
    scheduler.on_finish = lambda request, outcome: (ended.append(outcome), observe(request, outcome))
    body = json.dumps({"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 2000, "ignore_eos": True, "logprobs": 5,
                       "stream": True}).encode()
    server = BackgroundServer(app)
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # no kernel buffer of megabytes to fill first
    with server as s, socket.socket() as stalled:  # closed first, should the test fail: else the server waits on it
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((s.host, s.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120
        while not ended:
            assert time.monotonic() < deadline, "the stalled stream's generation did not end"
            time.sleep(0.1)
        assert ended == ["cancelled"]
        stalled.settimeout(20)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := stalled.recv(1 << 16):
                got += chunk
        assert got.startswith(b"HTTP/1.1 200 ") and b"[DONE]" not in got  # cut mid-stream, then closed
        assert post(f"{s.base_url}/completions", json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode())[0] == 200
    engine.close()


def test_a_full_queue_answers_429_with_retry_after(tiny):
    from expertcache.serve.limits import ServerLimits
    from expertcache.serve.scheduler import SchedulerConfig
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    scheduler = Scheduler(engine, SchedulerConfig(max_active=1))
    with BackgroundServer(create_app(scheduler, MODEL, ServerLimits(max_waiting=1))) as s:
        running, waiting = _submit(scheduler, [1, 2, 3], 500), _submit(scheduler, [1, 2, 3], 500)
        status, headers, body = post(f"{s.base_url}/completions",
                                     json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 1}).encode())
        assert status == 429 and headers.get("retry-after") == "1" and body["error"]["code"] == "queue_full"
        running.cancel(), waiting.cancel()
    engine.close()


def test_the_queue_bound_counts_only_what_the_free_slots_do_not_take(tiny):
    """--max-waiting bounds requests that wait for a slot: a burst of --max-active + --max-waiting requests on an idle
    server got 429s for the requests the worker had not yet moved into its free slots (7 of 60 in bursts of 6 with 2
    slots and 4 waiting)."""
    from expertcache.serve.scheduler import SchedulerConfig
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    scheduler = Scheduler(engine, SchedulerConfig(max_active=2))  # not started: nothing admitted
    for _ in range(2):
        _submit(scheduler, [1, 2], 4)
    assert scheduler.queue_length == 2 and scheduler.backlog() == 0 and scheduler.backlog(4) == 4
    assert scheduler._admit() and scheduler.backlog() == 0 and scheduler.backlog(5) == 5
    _submit(scheduler, [1, 2], 4)
    assert scheduler.backlog() == 1
    engine.close()


def test_a_call_larger_than_the_queue_gets_400_not_a_429_to_retry_forever(tiny):
    from expertcache.serve.limits import ServerLimits
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    with BackgroundServer(create_app(Scheduler(engine), MODEL, ServerLimits(max_waiting=2))) as s:
        url = f"{s.base_url}/completions"
        for body in ({"prompt": [[1, 2], [3], [4]], "max_tokens": 1}, {"prompt": [1, 2], "n": 3, "max_tokens": 1}):
            status, headers, error = post(url, json.dumps(body).encode())  # the queue is empty: it can never fit
            assert status == 400 and "retry-after" not in headers and "--max-waiting" in error["error"]["message"]
        assert post(url, json.dumps({"prompt": [1, 2], "n": 2, "max_tokens": 1}).encode())[0] == 200
    engine.close()


def test_one_call_holds_at_most_its_share_of_the_active_slots(tiny):
    """n choices of one call take half of --max-active; a later client's request is admitted beside them."""
    from expertcache.engine.sampling import SamplingParams
    from expertcache.serve.scheduler import Request, SchedulerConfig
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    scheduler = Scheduler(engine, SchedulerConfig(max_active=4))  # not started: admission only
    call = object()
    params = SamplingParams(max_tokens=2)
    choices = [Request([1, 2], params, lambda item: None, group=call) for _ in range(4)]
    other = Request([3, 4], params, lambda item: None, group=object())
    for r in (*choices, other):
        scheduler.submit(r)
    assert scheduler._admit()
    assert scheduler.active == [*choices[:2], other] and list(scheduler.waiting) == choices[2:]
    engine.close()


def test_a_request_whose_client_left_while_waiting_leaves_the_queue_though_every_slot_is_taken(tiny):
    """It held its place (and counted toward --max-waiting's 429s for live clients) until a slot freed."""
    from expertcache.serve.scheduler import Request, SchedulerConfig
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    scheduler = Scheduler(engine, SchedulerConfig(max_active=1))  # not started: rounds by hand
    items = []
    running, gone, live = (Request([1, 2], SamplingParams(max_tokens=4), items.append) for _ in range(3))
    for r in (running, gone, live):
        scheduler.submit(r)
    assert scheduler._admit() and scheduler.active == [running]
    gone.cancel()
    assert scheduler._admit() and list(scheduler.waiting) == [live] and scheduler.queue_length == 1
    scheduler._round()
    assert scheduler.active == [running] and gone.finished is not None and items.count(None) == 1
    engine.close()


@pytest.mark.parametrize("schedule", ["batch", "interleave"])
def test_a_long_prompt_runs_in_parts_while_another_decodes_and_its_tokens_are_the_same(tiny, schedule):
    """While a request decodes, a prompt longer than prefill_chunk runs a part a round, and the decoding request
    gets a token each round; the output is the one the prompt whole gives. Alone, a prompt runs whole."""
    from expertcache.serve.scheduler import SchedulerConfig
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    prompt = [(7 * i) % engine.args.vocab_size for i in range(1, 40)]  # 39 tokens: 4 parts of 8, then 7 and a token
    whole = list(generate(engine, prompt, 4))
    scheduler = Scheduler(engine, SchedulerConfig(schedule=schedule, max_active=2, prefill_chunk=8))
    decoding = _submit(scheduler, [1, 2], 40)
    assert scheduler._admit()
    scheduler._round()
    long = _submit(scheduler, prompt, 4)
    assert scheduler._admit() and len(scheduler.active) == 2
    for parts in range(1, 5):
        scheduler._round()
        assert long.items == [] and long.generation.kv_end == 8 * parts and len(decoding.items) == 1 + parts
    scheduler._round()
    assert [i.token for i in long.items] == whole[:1] and len(decoding.items) == 6
    while not long.done.is_set():
        scheduler._round()
    assert [i.token for i in long.items if i is not None] == whole
    decoding.cancel()
    scheduler._round()
    alone = _submit(scheduler, prompt, 1)
    assert scheduler._admit() and scheduler.active == [alone]
    scheduler._round()
    assert [i.token for i in alone.items if i is not None] == whole[:1]
    engine.close()


def test_a_500_names_the_failure_without_the_servers_paths():
    from expertcache.errors import FetchError
    from expertcache.serve.app import Server
    err = Server._error(FetchError("/home/me/.cache/expertcache/store-1/experts.bin: short read of expert 3"))
    assert err.status == 500 and err.message == "generation failed: experts.bin: short read of expert 3"


def test_a_fault_of_the_servers_own_is_an_openai_500_and_the_server_goes_on(server, monkeypatch):
    """An exception no handler expects (a bug of the server's) answers an OpenAI-style 500, not Starlette's
    text/plain "Internal Server Error"."""
    def fail(body):
        raise RuntimeError("a bug")
    monkeypatch.setattr(server.server.config.app.state.server, "completion_prompts", fail)
    url, body = f"{server.base_url}/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    status, _, answer = post(url, body)
    assert status == 500 and answer["error"]["type"] == "server_error" and "RuntimeError" in answer["error"]["message"]
    monkeypatch.undo()
    assert post(url, body)[0] == 200


def test_a_call_holding_an_integer_past_ints_digits_is_read_not_raised():
    """json.loads raises a ValueError, not a JSONDecodeError, on an integer of more than 4,300 digits (a looping
    model's): such a JSON call stays text, as a call that does not parse, and GLM-4.5's value stays a string."""
    from expertcache.serve.reasoning import split_reply
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    digits = "1" * 5000
    hermes = f'<tool_call>\n{{"name": "ls", "arguments": {{"depth": {digits}}}}}\n</tool_call>'
    assert split_reply(hermes, tools=tools)[1:] == (hermes, [])
    glm = f"<tool_call>ls\n<arg_key>depth</arg_key>\n<arg_value>{digits}</arg_value>\n</tool_call>"
    (call,) = split_reply(glm, tools=tools)[2]
    assert json.loads(call["function"]["arguments"]) == {"depth": digits}


def test_completions_refuse_chats_top_logprobs(server):
    status, _, body = post(f"{server.base_url}/completions",
                           json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "top_logprobs": 3}).encode())
    assert status == 400 and body["error"]["param"] == "top_logprobs"


def test_a_prompt_list_without_max_tokens_gives_each_prompt_its_own_room(client):
    """A completion's default of 16 new tokens is capped by each prompt's own room in the context, as vLLM caps it:
    the room after the longest prompt capped every prompt."""
    got = client.completions.create(model=MODEL, prompt=[[5] * 505, [5, 6]], temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert [len(c.logprobs.tokens) for c in sorted(got.choices, key=lambda c: c.index)] == [7, 16]
