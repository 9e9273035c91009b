"""OpenAI's Responses API (/v1/responses), live on a loopback port, driven by the official openai client: the same
answers as the chat path, whole and streamed, function calls out and back in, text formats, reasoning items, and
the fields it cannot take refused with 400s that name them."""
import json
import re
import shutil
import sys
from types import SimpleNamespace

import openai
import pytest
from test_serve import MODEL, THINKING_TEMPLATE, TOOL_TEMPLATE, call

from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from expertcache.serve.app import create_app
from expertcache.serve.background import BackgroundServer
from expertcache.serve.responses import Envelope, ResponsesBody, messages, stream
from expertcache.serve.scheduler import Scheduler

TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": {
          "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
          "additionalProperties": False}}]


def test_a_response_is_the_chats_answer_whole_and_streamed(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who goes there?"}])
    ask = dict(model=MODEL, instructions="Be brief.", input="Who goes there?", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**ask)
    assert whole.output_text == chat.choices[0].message.content and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 20)
    assert [item.type for item in whole.output] == ["message"] and whole.id.startswith("resp_")
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens == 20
    with client.responses.stream(**ask) as stream:  # the client's helper, which ends on response.completed
        assert stream.get_final_response().output_text == whole.output_text
    typed = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Who goes"}, {"type": "input_text", "text": "there?"}]}],
        instructions="Be brief.", max_output_tokens=20, temperature=0)
    parts = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[  # joined by a newline
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who goes\nthere?"}])
    assert typed.output_text == parts.choices[0].message.content != whole.output_text


def test_a_function_call_comes_back_as_an_item_and_its_output_goes_back_in(client):
    ask = dict(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=60)
    whole = client.responses.create(**ask, tool_choice={"type": "function", "name": "get_weather"})
    (item,) = whole.output
    assert item.type == "function_call" and item.name == "get_weather" and whole.status == "completed"
    assert set(json.loads(item.arguments)) == {"city"} and item.call_id.startswith("call_")
    events = list(client.responses.create(**ask, tool_choice="required", stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and isinstance(json.loads(done[0].arguments), dict)
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [done[0].arguments]
    back = [{"role": "user", "content": "Weather in Paris?"}, item.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": item.call_id, "output": "rain"}]
    answer = client.responses.create(model=MODEL, input=back, tools=TOOLS, max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": item.call_id, "type": "function", "function": {
            "name": item.name, "arguments": item.arguments}}]},
        {"role": "tool", "tool_call_id": item.call_id, "content": "rain"}])
    assert answer.output_text == chat.choices[0].message.content


def test_a_stored_response_is_continued_by_its_id_as_the_whole_conversation_would_be(client):
    """store (OpenAI's default) keeps a response, whole or streamed: a request naming it by previous_response_id
    answers as the conversation sent whole does (the earlier instructions not carried, a call's output in the next
    request), GET returns it and DELETE drops it; store false keeps none, and an id not kept is a 404 naming the
    fix (previous_response_id was a 400)."""
    ask = dict(model=MODEL, max_output_tokens=6, temperature=0)
    first = client.responses.create(**ask, input="Who goes there?", instructions="Be brief.")
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    then = client.responses.create(**ask, input="Speak.", previous_response_id=first.id)
    whole = client.responses.create(**ask, store=False, input=[
        {"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Speak."}])
    assert then.output_text == whole.output_text and then.previous_response_id == first.id and whole.store is False
    with client.responses.stream(**ask, input="And?", previous_response_id=then.id) as stream:
        streamed = stream.get_final_response()
    again = client.responses.create(**ask, store=False, input=[
        {"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Speak."}, {"role": "assistant", "content": then.output_text},
        {"role": "user", "content": "And?"}])
    assert streamed.output_text == again.output_text and client.responses.retrieve(streamed.id).id == streamed.id
    called = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=60,
                                     tool_choice="required")
    (item,) = called.output
    answer = client.responses.create(**ask, tools=TOOLS, previous_response_id=called.id, input=[
        {"type": "function_call_output", "call_id": item.call_id, "output": "rain"}])
    sent = client.responses.create(**ask, tools=TOOLS, store=False, input=[
        {"role": "user", "content": "Weather in Paris?"}, item.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": item.call_id, "output": "rain"}])
    assert answer.output_text == sent.output_text
    client.responses.delete(streamed.id)
    for gone in (streamed.id, whole.id, "resp_1"):
        with pytest.raises(openai.NotFoundError, match="is kept here.*send the whole conversation in input"):
            client.responses.create(**ask, input="x", previous_response_id=gone)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)


def test_the_kept_responses_are_bounded_by_what_they_hold_not_by_their_text():
    """KEPT_BYTES bounds the kept responses' Python objects: 64 MiB of JSON text in one-character messages held 246
    MiB."""
    from expertcache.serve import responses
    items = json.loads(json.dumps([{"type": "message", "role": "user", "content": "x"}] * 1000))
    kept = responses.KeptResponses(10)
    kept.keep({"id": "resp_1", "status": "completed", "output": []}, [], ResponsesBody(input=items))
    assert kept.bytes >= 1000 * sys.getsizeof(items[0]) > 2 * len(json.dumps(items))
    # anything but JSON's containers is counted alone: not followed into what it holds, its class or its module
    assert responses.held_bytes({"x": SimpleNamespace(rows=[0] * 100_000)}) < 1000


def test_the_kept_responses_are_the_newest_within_their_bounds(monkeypatch):
    """At most `limit` responses, and KEPT_BYTES of what they hold, the oldest dropped first; none with limit 0."""
    from expertcache.serve import responses
    body = lambda text, store=None: ResponsesBody(input=text, store=store)  # noqa: E731
    answer = lambda i: {"id": f"resp_{i}", "status": "completed", "output": []}  # noqa: E731
    kept = responses.KeptResponses(2)
    for i in range(3):
        kept.keep(answer(i), [], body(f"turn {i}"))
    kept.keep(answer(3), [], body("not kept", store=False))
    kept.keep({**answer(4), "status": "failed"}, [], body("failed"))
    assert list(kept.kept) == ["resp_1", "resp_2"] and kept.conversation("resp_2")[0]["content"] == "turn 2"
    monkeypatch.setattr(responses, "KEPT_BYTES", 300)
    kept.keep(answer(5), kept.conversation("resp_2"), body("x" * 200))
    assert list(kept.kept) == ["resp_5"] and len(kept.conversation("resp_5")) == 2
    none = responses.KeptResponses(0)
    none.keep(answer(6), [], body("y"))
    assert not none.kept and not none.stores(body("y"))
    with pytest.raises(Exception, match="keeps none"):
        none.conversation("resp_6")


def test_a_function_tool_is_strict_unless_turned_off_and_a_call_cut_short_is_incomplete(client):
    """OpenAI's Responses take a function tool as strict where it does not say (its chat's are not): no key beyond
    the listed ones. A call cut at max_output_tokens is an incomplete item, whole and streamed."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "required": ["x"], "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "string", "maxLength": 5}}}}
    ask = dict(model=MODEL, input="Hi", tool_choice="required", max_output_tokens=60, temperature=1)
    keys = lambda t, seed: set(json.loads(client.responses.create(  # noqa: E731
        **ask, tools=[t], extra_body={"seed": seed}).output[0].arguments))
    assert all(keys(tool, seed) <= {"x", "y"} for seed in range(3))
    echoed = client.responses.create(**ask, tools=[tool, {**tool, "name": "g", "strict": False}]).tools
    assert [(t.name, t.strict) for t in echoed] == [("f", True), ("g", False)]  # as they ran, as OpenAI echoes them
    assert any(keys({**tool, "strict": False}, seed) - {"x", "y"} for seed in range(3))  # the model's own keys
    unbounded = {**tool, "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
    cut = dict(model=MODEL, input="Hi", tools=[unbounded], tool_choice="required", max_output_tokens=30, temperature=0)
    whole = client.responses.create(**cut)  # the built-in model writes digits without end
    assert whole.status == "incomplete"
    assert [(i.type, i.status) for i in whole.output] == [("function_call", "incomplete")]
    done = [e.item for e in client.responses.create(**cut, stream=True) if e.type == "response.output_item.done"]
    assert [(i.type, i.status, i.arguments) for i in done] == \
        [("function_call", "incomplete", whole.output[0].arguments)]


def test_input_items_become_the_chats_messages():
    body = ResponsesBody(instructions="Be brief.", input=[
        {"type": "message", "role": "user", "content": "Rain?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "1", "output": "wet"},
        {"type": "function_call_output", "call_id": "2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "3", "name": "weather", "arguments": "{\"day\": 2}"}])
    calls = lambda *c: [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}  # noqa: E731
                        for i, n, a in c]
    assert messages(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rain?"},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "look",
         "tool_calls": calls(("1", "weather", "{}"), ("2", "time", "{}"))},
        {"role": "tool", "tool_call_id": "1", "content": "wet"},
        {"role": "tool", "tool_call_id": "2", "content": "noon"},
        {"role": "assistant", "content": None, "tool_calls": calls(("3", "weather", "{\"day\": 2}"))}]


def test_the_input_renders_through_the_template_as_hf_renders_the_chat(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    chat = [{"role": "user", "content": "Rain?"},
            {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
            {"role": "tool", "content": "wet", "tool_call_id": "1"}]
    tools = [{"type": "function", "name": "weather", "description": "the day's rain", "parameters": {"type": "object"}}]
    want = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        chat, tools=[{"type": "function", "function": {**{k: v for k, v in tools[0].items() if k != "type"},
                                                       "strict": True}}],  # Responses' tools are strict by default
        tokenize=False, add_generation_prompt=True, reasoning_effort="low")
    assert "<think>look it up</think>" in want and "<call>weather({})</call>" in want and "EFFORT low." in want
    engine = Engine(path, EngineConfig(store="ram", max_seq=256))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        items = [{"role": "user", "content": "Rain?"},
                 {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look it up"}]},
                 {"type": "function_call", "call_id": "1", "name": "weather", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "1", "output": "wet"}]
        got = client.responses.create(model=MODEL, tools=tools, max_output_tokens=1, reasoning={"effort": "low"},
                                      input=items)
        assert got.usage.input_tokens == len(engine.encode(want, special=False))
    engine.close()


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(client):
    """truncation "auto" (OpenAI's): an input longer than the context loses its oldest items, the instructions and
    the last item kept, where "disabled" (the default) is a 400 that says the context is exceeded; an input whose
    last item alone is too long is that 400 under auto too."""
    long = "ROMEO. " * 50  # ~100 tokens of the built-in model's; the test server's context is 512
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {long}"} for i in range(6)]
    items.append({"role": "user", "content": "Who goes there?"})
    ask = dict(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.responses.create(**ask)
    kept = client.responses.create(**ask, truncation="auto")
    assert kept.truncation == "auto" and kept.usage.output_tokens == 4
    for first in range(1, len(items)):  # the longest tail of the input that fits
        try:
            fits = client.responses.create(**dict(ask, input=items[first:]))
            break
        except openai.BadRequestError:
            continue
    assert 1 < first < len(items) - 1 and kept.usage.input_tokens == fits.usage.input_tokens
    assert kept.output_text == fits.output_text
    with pytest.raises(openai.BadRequestError, match="context"):
        client.responses.create(**dict(ask, input=[{"role": "user", "content": long * 5}]), truncation="auto")


def test_a_text_format_keeps_the_output_to_its_schema(client):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "w": {"type": "string", "maxLength": 6}},
              "required": ["n", "w"], "additionalProperties": False}
    for seed in range(3):
        got = client.responses.create(model=MODEL, input="A number:", max_output_tokens=60, text={"format": {
            "type": "json_schema", "name": "number", "schema": schema, "strict": True}}, extra_body={"seed": seed})
        value = json.loads(got.output_text)
        assert got.status == "completed" and set(value) == {"n", "w"} and value["n"] in (1, 2, 3)


def test_reasoning_comes_back_as_its_own_item(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    writes = {"grammar": f"start: {json.dumps('<think>They greet me.</think>Hello!')}"}
    engine = Engine(path, EngineConfig(store="ram", max_seq=256))
    with BackgroundServer(create_app(Scheduler(engine), MODEL)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        ask = dict(model=MODEL, input="Hi", max_output_tokens=40, extra_body=writes)
        whole = client.responses.create(**ask)
        assert [i.type for i in whole.output] == ["reasoning", "message"] and whole.output_text == "Hello!"
        assert whole.output[0].content[0].text == "They greet me."
        events = list(client.responses.create(**ask, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "They greet me."
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello!"
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
        # the reasoning's tokens among the output's (they read 0)
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
        assert events[-1].response.usage.output_tokens_details.reasoning_tokens == \
            whole.usage.output_tokens_details.reasoning_tokens
        cut = dict(ask, max_output_tokens=6)  # inside the reasoning: it is cut short, whole and streamed
        streamed = list(client.responses.create(**cut, stream=True))[-1].response
        for response in (client.responses.create(**cut), streamed):
            assert response.status == "incomplete" and [i.status for i in response.output] == ["incomplete"] * 2
    engine.close()


@pytest.mark.parametrize("fields, words, param", [
    ({"conversation": "conv_1"}, "conversation is not supported here; send it in input", "conversation"),
    ({"max_tokens": 5}, "chat completion's field.*send max_output_tokens", "max_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens=100000 .* exceeds the context", "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens must be at least 1", "max_output_tokens"),
    ({"max_output_token": 5}, "did you mean max_output_tokens", "max_output_token"),
    ({"temprature": 1}, "did you mean temperature", "temprature"),
    ({"top_k": "many"}, "top_k: Input should be a valid integer", "top_k"),
    ({"tools": [{"type": "web_search"}]}, "type 'web_search' is not supported", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "at the top", "tools"),
    ({"tool_choice": {"type": "file_search"}}, "is not one", "tool_choice"),
    ({"tool_choice": "any"}, r'is "none", "auto", "required" or \{"type": "function", "name"', "tool_choice"),
    ({"tool_choice": 5}, "tool_choice: must be", "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs its schema", "text"),
    ({"text": {"format": {"type": "xml"}}}, "text.format type 'xml' is not supported", "text"),
    ({"input": []}, "input is empty", "input"),
    ({"input": [5]}, r"input\[0\] must be an object", "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "has role 'robot', not one of user", "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "a tool's output is a function_call_output item", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input_text part's text must be", "input"),
    ({"input": [{"type": "reasoning", "summary": "x"}, "Hi"]}, "lists of text parts", "input"),
    # echoed as sent: what JSON cannot carry was a 500 (and NaN a stream's invalid JSON)
    ({"user": "\ud800"}, "what JSON cannot carry", "user"),
    ({"metadata": {"k": float("nan")}}, "what JSON cannot carry", "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "at most 16 keys", "metadata"),
    ({"text": {"formt": {"type": "json_object"}}}, "text.formt is not a field of it; did you mean format", "text"),
    ({"reasoning": {"efort": "high"}}, "did you mean effort", "reasoning"),
    ({"tools": [{"type": "function", "name": "f", "parameter": {}}]}, "did you mean parameters", "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}], "tool_choice": "required"},
     r"tools\[0\]\.parameters is not a JSON schema", "tools"),
    ({"text": {"format": {"type": "text", "schema": {"type": "object"}}}}, "text.format gives schema", "text"),
    ({"stream": True, "stream_options": {"include_usage": False}}, "include_obfuscation only", "stream_options"),
    ({"top_logprobs": 2}, "not supported on /v1/responses", "top_logprobs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text", "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs call_id", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "1"}]}, "needs output", "input"),
    ({"input": {"role": "user", "content": "Hi"}}, "must be a text or a list of items", "input"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "needs its name", "tools"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "an item_reference is not supported", "input"),
    ({"background": True}, "background responses are not supported", "background"),
    ({"include": ["message.output_text.logprobs"]}, "include .* is not supported", "include"),
    ({"service_tier": "bogus"}, "service_tier: Input should be 'auto'", "service_tier"),
    ({"input": [{"type": "function_call_output", "call_id": "zz", "output": "1"}]},
     'no function_call item with call_id "zz" comes before this output', "input"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "json_schema needs its name",
     "text"),
    ({"model": "gpt-5"}, "does not exist", "model")])
def test_what_cannot_be_answered_is_a_400_naming_the_field(server, fields, words, param):
    status, body = call(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, **fields})
    assert status == (404 if param == "model" else 400), body
    assert re.search(words, body["error"]["message"]) and body["error"]["param"] == param, body


def test_the_server_goes_on_after_a_bad_stream_and_a_client_that_left(server, client):
    status, body = call(server, "/v1/responses", {"input": "Hi", "stream": True, "max_output_tokens": 10 ** 6})
    assert status == 400 and body["error"]["param"] == "max_output_tokens"
    events = client.responses.create(model=MODEL, input="Hi", max_output_tokens=200, stream=True)
    next(iter(events))
    events.close()  # the generation ends with the client
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=3).usage.output_tokens == 3


def test_a_generation_that_fails_ends_its_stream_with_an_error_and_a_failed_response():
    import asyncio

    async def chat():
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
        yield 'data: {"error": {"message": "generation failed: boom", "type": "server_error", "code": "X"}}\n\n'
        yield "data: [DONE]\n\n"

    async def events():
        return [e async for e in stream(chat(), Envelope(ResponsesBody(input="Hi"), MODEL))]
    got = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(events())]
    assert [e["type"] for e in got][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert got[-2]["message"] == "generation failed: boom" and got[-1]["response"]["status"] == "failed"
    assert got[-1]["response"]["error"] == {"code": "X", "message": "generation failed: boom"}
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == "Hi"
