"""Sampling parameters, the sampler, incremental detokenization and stop strings."""
import pytest
import torch
from tokenizers import Tokenizer

from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.engine.sampling import IncrementalDetokenizer, Sampler, SamplingError, SamplingParams, StopStrings
from expertcache.errors import BadInput, CheckpointError


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(BUILTIN_MODEL / "tokenizer.json"))


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("min_p", 2.0), ("repetition_penalty", 0.0), ("max_tokens", 0),
                                         ("stop", ("",)), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("frequency_penalty", float("nan")), ("logit_bias", ((-1, 1.0),)),
                                         ("logit_bias", ((3, 101.0),)), ("min_tokens", 17), ("min_tokens", -1),
                                         # types, which failed the range checks with a TypeError, or ran: 2.5 tokens
                                         ("max_tokens", 2.5), ("max_tokens", "3"), ("max_tokens", None),
                                         ("temperature", "1"), ("top_p", None), ("seed", 1.5), ("seed", "a"),
                                         ("top_k", 2.0), ("logprobs", True), ("logit_bias", ((3, "1"),))])
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(SamplingError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_numpy_integers_are_taken_as_ints():
    """A seed, a whole-number field, a stop token or a logit_bias token as a NumPy integer is held as an int: a seed
    failed in torch's manual_seed with a TypeError, and a logit_bias token was refused with a message that named
    nothing wrong."""
    import numpy as np
    params = SamplingParams(temperature=1.0, seed=np.int64(7), max_tokens=np.int32(4), top_k=np.int64(5),
                            stop_token_ids=[np.int64(3)], logit_bias={np.int64(2): 5.0})
    assert (params.seed, params.max_tokens, params.top_k, params.stop_token_ids, params.logit_bias) == \
        (7, 4, 5, (3,), ((2, 5.0),))
    assert all(type(v) is int for v in (params.seed, params.max_tokens, params.top_k, params.stop_token_ids[0],
                                        params.logit_bias[0][0]))
    logits = torch.randn(10, generator=torch.Generator().manual_seed(0))
    assert Sampler(params)(logits, None) == Sampler(SamplingParams(temperature=1.0, seed=7, top_k=5,
                                                                  logit_bias={2: 5.0}))(logits, None)
    with pytest.raises(SamplingError, match="logit_bias True: 1.0 must map a token id"):
        SamplingParams(logit_bias={True: 1.0})


def test_an_empty_stop_string_is_named_alone():
    """The message shows the string at fault, as `--stop ""` or a request's list gave it, not the tuple it is kept in."""
    with pytest.raises(SamplingError, match=r"^stop='' must be a non-empty string$"):
        SamplingParams(stop=("end", ""))


def test_one_stop_string_is_taken_whole_and_other_types_are_named():
    """A stop given as one string (as OpenAI's API and vLLM's SamplingParams take it) was iterated as stop strings of
    one character each: the output ended at its first "e". None, or a logit_bias dict, failed with a TypeError."""
    assert SamplingParams(stop="end").stop == ("end",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
    none = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)  # vLLM's defaults
    assert (none.stop, none.stop_token_ids, none.logit_bias) == ((), (), ())
    assert SamplingParams(logit_bias={3: -100, 5: 2.5}).logit_bias == ((3, -100), (5, 2.5))  # OpenAI's form
    for field, value in (("stop", ["a", 5]), ("stop_token_ids", "3"), ("stop_token_ids", [True]),
                         ("stop_token_ids", 3)):
        with pytest.raises(SamplingError, match=f"^{field}=.* must be a list of"):
            SamplingParams(**{field: value})
    for value in (3, [3], "ab"):
        with pytest.raises(SamplingError, match="must map token ids to biases"):
            SamplingParams(logit_bias=value)


def test_sampler_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    none = torch.zeros(4, dtype=torch.bool)
    assert Sampler(SamplingParams())(logits, none) == 0
    # top_k=1, a tiny top_p, or a min_p near 1 all leave only the best token, at any temperature
    # (a top_p below float32's range once dropped every token)
    for params in [SamplingParams(temperature=5, top_k=1, seed=1), SamplingParams(temperature=5, top_p=0.01, seed=1),
                   SamplingParams(temperature=5, top_p=1e-300, seed=1),
                   SamplingParams(temperature=5, min_p=0.99, seed=1)]:
        sampler = Sampler(params)
        assert {sampler(logits, none) for _ in range(20)} == {0}
    seen = torch.tensor([True, False, False, False])
    assert Sampler(SamplingParams(repetition_penalty=4.0))(logits, seen) == 1  # 3/4 < 2
    def draws(**kw):
        sampler = Sampler(SamplingParams(**{"temperature": 1.0, "seed": 7, **kw}))
        return [sampler(logits, none) for _ in range(64)]
    assert draws() == draws()  # a seed makes sampling repeatable
    assert draws(seed=8) != draws()  # and it is the seed that draws
    # all of a 64-bit seed: torch's generator keeps 32 bits, and seeds 2**32 apart drew alike
    assert len({tuple(draws(seed=s)) for s in (7, 2**32 + 7, 2**63 + 7, -2**32 + 7)}) == 4
    assert draws(seed=-1) == draws(seed=2**64 - 1)  # a negative seed is its 64 bits, as torch reads it
    assert draws(temperature=0.1).count(0) > draws(temperature=5.0).count(0)  # colder: the best token more often
    assert set(draws(top_k=2)) == {0, 1} and len(set(draws())) > 2


def test_presence_frequency_penalties_and_logit_bias_are_openais():
    """presence: once for a token the output has; frequency: once per occurrence; the bias is added to the logit,
    greedy or sampled, and -100 bans a token."""
    logits = torch.tensor([3.0, 2.5, 1.0, 0.0])
    counts = torch.tensor([2, 0, 0, 0], dtype=torch.int32)  # the output has token 0 twice
    pick = lambda counts=counts, **kw: Sampler(SamplingParams(**kw))(logits, None, counts)  # noqa: E731
    assert pick(presence_penalty=0.4) == 0 and pick(presence_penalty=0.6) == 1  # 3 - 0.6 < 2.5
    assert pick(frequency_penalty=0.2) == 0 and pick(frequency_penalty=0.3) == 1  # 3 - 2 x 0.3 < 2.5
    assert pick(frequency_penalty=0.3, counts=torch.zeros(4, dtype=torch.int32)) == 0  # nothing in the output yet
    assert pick(presence_penalty=-2.0) == 0
    assert pick(frequency_penalty=-2.0, counts=counts.flip(0)) == 3  # negative: encouraged, 0 + 2 x 2 > 3
    assert pick(logit_bias=((2, 2.1),)) == 2 and pick(logit_bias=((2, 2.1), (2, 0.0))) == 0  # the last bias given
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias=((0, -100.0), (1, -100.0))))
    assert {sampler(logits, None) for _ in range(50)} == {2, 3}  # banned, at any temperature


def test_incremental_detokenizer_matches_full_decode(tokenizer):
    text = "ROMEO.\nBut soft! what light — «ça» 日本語 through yonder window breaks? 🙂 It is the east."
    ids = tokenizer.encode(text).ids
    prompt, out = ids[:3], ids[3:]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.push(t) for t in out] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(out)
    assert not any("\ufffd" in p for p in pieces)  # split characters were held back, not shown broken


def test_stop_strings_cut_before_the_stop_across_pieces():
    stops = StopStrings(("END", "\n\n"))
    shown, hit = [], False
    for piece in ["Hello", " wor", "ld E", "N", "D and more"]:
        out, hit = stops.feed(piece)
        shown.append(out)
        if hit:
            break
    assert hit and "".join(shown) == "Hello world "
    stops = StopStrings(("END",))
    assert stops.feed("abcdE")[0] + stops.flush() == "abcdE"  # a held prefix comes out at the end
    stops = StopStrings(("ab", "abc", "x"), include=True)  # vLLM's include_stop_str_in_output
    assert stops.feed("1abcde") == ("1abc", True)  # of the stop strings in the text, the first to start, the longest
    stops = StopStrings(("ab",), include=True)
    assert stops.feed("1a") == ("1", False) and stops.feed("bc") == ("ab", True)  # across pieces


def test_a_stop_string_must_end_after_min_tokens_text():
    """Text fed unmatched (the tokens before vLLM's min_tokens) ends no stop string, but a stop string that starts
    in it and ends after it does, as vLLM reads stop strings over the text before each new token's."""
    stops = StopStrings(("my lord",))
    assert stops.feed("ROMEO. my lord, my", match=False) == ("ROMEO. my lo", False)  # the tail is held back
    assert stops.feed(" lord", match=True) == ("rd, ", True)  # the second one: the first ended early
    stops = StopStrings(("my lord",))
    assert stops.feed("ROMEO. my", match=False) == ("ROM", False)
    assert stops.feed(" lord, my lord") == ("EO. ", True)  # it started early and ends now
    stops = StopStrings(("ab",), include=True)
    assert stops.feed("xab", match=False) == ("xa", False) and stops.feed("cab") == ("bcab", True)


def test_min_tokens_reads_a_stop_string_that_ends_on_its_last_token():
    """The min_tokens-th token's text is read for stop strings (vLLM checks from the output's min_tokens-th token),
    and one that began before it counts."""
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    prompt = engine.encode("ROMEO.\n")
    steps = list(TextGeneration(engine, prompt, SamplingParams(max_tokens=24)))
    text, ends = "", []
    for step in steps:  # the text after each token
        text += step.text
        ends.append(len(text))
    stop = text[ends[2] - 2:ends[3]]  # a stop string that starts in token 3's text and ends with token 4's
    assert stop and text.find(stop) == ends[2] - 2
    for min_tokens in (3, 4):  # the stop ends with token 4's text: read
        gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=24, min_tokens=min_tokens, stop=(stop,)))
        out = list(gen)
        assert "".join(s.text for s in out) == text[:ends[2] - 2] and gen.finish_reason == "stop" and len(out) == 4
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=24, min_tokens=5, stop=(stop,)))
    assert "".join(s.text for s in gen).startswith(text[:ends[3]])  # it ended with token 4's text: not read


def test_generation_stops_at_eos_and_reads_prompt_from_stdin(monkeypatch, capsys):
    import io

    from expertcache import cli
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration, eos_token_ids
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    assert eos_token_ids(engine) == {0}  # config.json's eos_token_id and tokenizer_config's eos_token
    prompt = engine.encode("ROMEO.\n")
    first = TextGeneration(engine, prompt, SamplingParams(max_tokens=4)).step()
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=4))
    gen.eos = frozenset({first.token})  # the greedy first token plays EOS
    out = gen.step()
    assert out.finish_reason == "stop" and out.text == "" and gen.tokens == []
    engine.close()
    monkeypatch.setattr("sys.stdin", io.StringIO("JULIET.\n"))
    assert cli.main(["generate", "--store", "ram", "-n", "4", "-p", "-"]) == 0
    assert capsys.readouterr().out.startswith("JULIET.\n")
    assert cli.main(["generate", "--store", "ram", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err  # the CLI's flag, not the server's field


def test_a_json_schema_is_held_as_canonical_json_and_checked_when_given():
    """A dict or its JSON text; what llguidance cannot follow is refused as the params are made, naming the field,
    not in the middle of a request."""
    assert SamplingParams(json_schema={"type": "object"}).json_schema == '{"type": "object"}'
    assert SamplingParams(json_schema=' {"type":"object"} ').json_schema == '{"type": "object"}'
    for schema, words in (("{nope", "is not JSON"), ([1], "is a JSON list"), (True, "is a JSON bool"),
                          ({"type": "bogus"}, "cannot be followed"),
                          ({"x": float("nan")}, "is not JSON")):
        with pytest.raises(SamplingError, match=words) as e:
            SamplingParams(json_schema=schema)
        assert e.value.param == "json_schema"
    with pytest.raises(SamplingError, match="min_tokens=1 cannot be combined"):
        SamplingParams(json_schema={"type": "object"}, min_tokens=1)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_generation_with_a_json_schema_is_a_value_of_it(ignore_eos):
    """Greedy and sampled, the output is a JSON value of the schema and ends where the value does (an end id the
    grammar allows ends it even under ignore_eos, which would otherwise keep it as text); max_tokens cuts it."""
    import json

    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    engine = Engine(None, EngineConfig(store="ram", max_seq=256))
    prompt = engine.encode("ROMEO.\n")
    schemas = [{"type": "array", "items": {"type": "integer"}, "maxItems": 3},
               {"type": "object", "properties": {"who": {"enum": ["ROMEO", "JULIET"]}, "act": {"type": "integer"}},
                "required": ["who", "act"], "additionalProperties": False},
               {"type": "number"}]
    for schema in schemas:
        for temperature in (0.0, 1.0):
            gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=60, json_schema=schema, seed=2,
                                                                temperature=temperature, ignore_eos=ignore_eos))
            text = "".join(out.text for out in gen)
            if gen.finish_reason == "length":  # a number of 60 digits: cut where max_tokens ends it
                assert schema == {"type": "number"} and len(gen.tokens) == 60
                continue
            value = json.loads(text)
            assert gen.finish_reason == "stop" and engine.tokenizer.decode(gen.tokens) == text
            if schema["type"] == "object":
                assert value["who"] in ("ROMEO", "JULIET") and isinstance(value["act"], int)
            else:
                assert isinstance(value, list if schema["type"] == "array" else (int, float))
    cut = TextGeneration(engine, prompt, SamplingParams(max_tokens=3, json_schema=schemas[1]))
    assert "".join(out.text for out in cut).startswith('{"') and cut.finish_reason == "length"
    engine.close()


def test_a_json_schema_needs_the_models_tokenizer(tiny):
    """A checkpoint without tokenizer.json (the tiny ones) gives no token's text for the grammar: refused."""
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    from expertcache.errors import BadInput
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    with pytest.raises(BadInput, match="has no tokenizer.json, which structured output needs"):
        TextGeneration(engine, [1, 2, 3], SamplingParams(json_schema={"type": "object"}))
    engine.close()


def test_a_regex_or_a_choice_is_followed_and_checked_when_given():
    """vLLM's guided_regex and guided_choice as SamplingParams' regex and choice: the output matches whole or is one
    of the strings; one constraint at a time; a regex that does not parse is one line naming it; a regex whose
    grammar exceeds llguidance's limits fails its request in one line, not with the parser's state."""
    import re

    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    from expertcache.errors import BadInput
    assert SamplingParams(choice="yes").choice == ("yes",) and SamplingParams(choice=["a", "b"]).choice == ("a", "b")
    unclosed = r"regex='\(' is not a regular expression .*\(unclosed group\)$"
    for kw, param, words in ((dict(regex="("), "regex", unclosed),
                             (dict(regex=""), "regex", "non-empty"), (dict(choice=[]), "choice", "non-empty strings"),
                             (dict(choice=["a", 1]), "choice", "non-empty strings"),
                             (dict(regex="a", json_schema={}), "regex", "json_schema and regex each constrain"),
                             (dict(choice=["a"], min_tokens=1), "min_tokens", "cannot be combined with choice")):
        with pytest.raises(SamplingError, match=words) as e:
            SamplingParams(**kw)
        assert e.value.param == param and "\n" not in str(e.value)
    engine = Engine(None, EngineConfig(store="ram", max_seq=128))
    prompt = engine.encode("ROMEO.\n")
    for temperature in (0.0, 1.0):
        gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=30, regex="[A-Z]{2,6}[.] [a-z]+!", seed=3,
                                                            temperature=temperature))
        text = "".join(out.text for out in gen)
        assert gen.finish_reason == "stop" and re.fullmatch("[A-Z]{2,6}[.] [a-z]+!", text), text
        gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=30, choice=("ROMEO", "JULIET", "NURSE"),
                                                            temperature=temperature, seed=3))
        assert "".join(out.text for out in gen) in ("ROMEO", "JULIET", "NURSE") and gen.finish_reason == "stop"
    with pytest.raises(BadInput, match=r"^the structured output's grammar is too large to follow \(.*\); send") as e:
        list(TextGeneration(engine, prompt, SamplingParams(max_tokens=4, regex="a{99999999}")))
    assert "\n" not in str(e.value)
    engine.close()



def test_a_structured_output_past_its_size_is_refused_before_it_builds():
    """A grammar builds while every other request waits, and its build grows faster than its text (6.6 MB of
    choices held a server up for 150 s): choices past 100,000 characters and a schema, regex or grammar past
    500,000 are refused at once in one line, before any is built; llguidance's panic text loses its backtrace."""
    from expertcache.engine.structured import one_line
    from expertcache.serve.tools import call_grammar
    cases = ((dict(choice=[f"choice number {i}" for i in range(300_000)]), "choice",
              r"^choice is 300,000 choices, 7,388,894 characters long, over the 100,000 "),
             (dict(regex="a" * 500_001), "regex", r"is 500,001 characters long, over the 500,000 "),
             (dict(grammar="root ::= " + " | ".join(f'"{i}"' for i in range(80_000))), "grammar", "over the 500,000"),
             (dict(json_schema={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(30_000)}}),
              "json_schema", r"^the JSON schema is .* characters long, over the 500,000 .*; send a smaller one$"))
    for kw, param, words in cases:
        with pytest.raises(SamplingError, match=words) as e:
            SamplingParams(**kw)
        assert e.value.param == param and "\n" not in str(e.value) and len(str(e.value)) < 300
    assert SamplingParams(choice=[f"choice number {i}" for i in range(4_000)]).choice[-1] == "choice number 3999"
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "string", "description": "x" * 400} for j in range(20)}}}} for i in range(70)]
    with pytest.raises(ValueError, match=r"^the grammar of a call to the tools is .* over the 500,000 "):
        call_grammar(tools, "required")
    assert SamplingParams(grammar=call_grammar(tools[:40], "required")).grammar  # a long tool list is no grammar's size
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX <backtrace>\n  0: <unknown>\n  1: clone3"
    assert one_line(panic) == "panic: assertion failed: grammar.symbols.len() < u16::MAX"

def test_the_documented_python_generation_runs(capsys):
    """docs/architecture.md's text-generation example, as written, prints a JSON object that ends the output."""
    import json
    import re
    from pathlib import Path
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", doc, re.S) if "TextGeneration" in block)
    exec(compile(example, "architecture.md", "exec"), {})
    text, reason = capsys.readouterr().out.rstrip("\n").rsplit(" ", 1)
    assert reason == "stop" and isinstance(json.loads(text), dict)


def test_a_grammar_is_followed_and_checked_when_given(tmp_path, capsys):
    """A context-free grammar (llama.cpp's GBNF, or llguidance's Lark syntax), through SamplingParams and generate's
    --grammar (its text or a file): the output is a sentence of it, whole; a grammar that does not parse is one line
    naming the problem."""
    import re

    from expertcache import cli
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    from expertcache.errors import BadInput
    gbnf = 'root ::= name ", " name "!"\nname ::= [A-Z] [a-z]{1,5}'
    for kw, words in ((dict(grammar="root ::= name"), "Rule 'name' not found"), (dict(grammar=" "), "non-empty"),
                      (dict(grammar='root ::= ("a"'), "is not a grammar"),
                      (dict(grammar=gbnf, regex="a"), "regex and grammar each constrain")):
        with pytest.raises(SamplingError, match=words) as e:
            SamplingParams(**kw)
        assert e.value.param == "grammar" and "\n" not in str(e.value)
    engine = Engine(None, EngineConfig(store="ram", max_seq=128))
    for grammar in (gbnf, 'start: NAME ", " NAME "!"\nNAME: /[A-Z][a-z]{1,5}/'):
        for temperature in (0.0, 1.0):
            gen = TextGeneration(engine, engine.encode("ROMEO.\n"), SamplingParams(max_tokens=30, grammar=grammar,
                                                                                  temperature=temperature, seed=2))
            text = "".join(out.text for out in gen)
            assert gen.finish_reason == "stop" and re.fullmatch("[A-Z][a-z]{1,5}, [A-Z][a-z]{1,5}!", text), text
    for endless in ("root ::= x\nx ::= x", 'root ::= "a" x\nx ::= x'):  # ended at once, empty, as if complete
        with pytest.raises(BadInput, match="no text that continues from here"):
            list(TextGeneration(engine, engine.encode("ROMEO.\n"), SamplingParams(max_tokens=8, grammar=endless)))
    engine.close()
    (tmp_path / "g.gbnf").write_text('root ::= "ay" | "nay"')
    for grammar in (str(tmp_path / "g.gbnf"), 'root ::= "ay" | "nay"'):
        assert cli.main(["generate", "--store", "ram", "-p", "Vote:", "--grammar", grammar]) == 0
        assert capsys.readouterr().out.removeprefix("Vote:").rstrip("\n") in ("ay", "nay")
    for argv, words in ((["--grammar", "root ::= x"], "--grammar 'root ::= x' is not a grammar (Rule 'x' not found)"),
                        (["--grammar", 'root ::= "a"', "--json-schema", "{}"],
                         "--json-schema and --grammar each constrain the output")):
        assert cli.main(["generate", "--store", "ram", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


def test_generate_takes_a_json_schema_as_text_or_file(tmp_path, capsys):
    import json

    from expertcache import cli
    (tmp_path / "s.json").write_text('{"type": "array", "items": {"type": "integer"}, "maxItems": 2}')
    for schema in (str(tmp_path / "s.json"), '{"type": "array", "items": {"type": "integer"}, "maxItems": 2}'):
        assert cli.main(["generate", "--store", "ram", "-p", "ROMEO.", "--json-schema", schema]) == 0
        value = json.loads(capsys.readouterr().out.removeprefix("ROMEO."))
        assert isinstance(value, list) and len(value) <= 2 and all(isinstance(v, int) for v in value)
    for schema, words in ((str(tmp_path / "none.json"), "neither a JSON schema nor a readable file"),
                          ('{"type": "bogus"}', "--json-schema: the JSON schema cannot be followed")):
        assert cli.main(["generate", "--store", "ram", "--json-schema", schema]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err


def test_prompt_scoring_and_logprobs_of_every_output_token():
    """prompt_logprobs scores the prompt's tokens by the prefill's logits (max_tokens 0 samples nothing); logprobs
    scores every sampled token, an end token included (its text is not output)."""
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    prompt = engine.encode("ROMEO.\nWhat light")
    with torch.no_grad():
        want = torch.log_softmax(engine.forward(torch.tensor(prompt), 0), -1)
    engine.reset()
    out = TextGeneration(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=2)).step()
    assert out.token is None and out.finish_reason == "length" and out.text == ""
    assert [s.token for s in out.prompt] == prompt and out.prompt[0].logprob is None
    assert [s.logprob for s in out.prompt[1:]] == pytest.approx([float(want[j - 1, t]) for j, t in enumerate(prompt)
                                                                 if j], abs=1e-5)
    assert [s.top[0][0] for s in out.prompt[1:]] == want[:-1].argmax(-1).tolist()
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=4, logprobs=1))
    first = gen.step()
    assert first.token == int(want[-1].argmax()) and first.logprob == pytest.approx(float(want[-1].max()), abs=1e-5)
    assert first.prompt is None and first.top == ((first.token, first.logprob),)
    ending = TextGeneration(engine, prompt, SamplingParams(max_tokens=4, logprobs=0))
    ending.eos = frozenset({first.token})  # the greedy first token plays EOS
    last = ending.step()
    assert last.finish_reason == "stop" and last.text == "" and last.logprob == pytest.approx(first.logprob)
    with pytest.raises(BadInput, match=r"step\(\) after the generation finished \(stop\); start a new"):
        ending.step()  # a RuntimeError, where every misuse of the API is a BadInput that names the fix
    with pytest.raises(SamplingError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    engine.close()


def test_a_chat_turn_prefills_only_what_its_prompt_adds(monkeypatch, capsys):
    """A turn's keys and values stay in the engine's cache: the next turn's prefill runs from the first token its
    prompt does not share with them, and gives the logits a whole prefill gives; chat's turns after the first reuse
    them; a model with a recurrent state reuses only a prompt that extends them."""
    import io
    import types

    from expertcache import cli
    from expertcache.commands import chat
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration, prefill
    from expertcache.errors import BadInput
    engine, fresh = (Engine(None, EngineConfig(store="ram", max_seq=256)) for _ in range(2))
    first = engine.encode("USER.\nWho goes there?\n\nASSISTANT.\n")
    gen = TextGeneration(engine, first, SamplingParams(max_tokens=8, ignore_eos=True))
    list(gen)
    held = (first + gen.tokens)[:gen.kv_end]
    assert gen.kv_end == len(first) + 7  # the last token sampled was never run
    second = held + engine.encode("\n\nUSER.\nNay, answer me.\n\nASSISTANT.\n")
    reused = prefill(engine, second, start=chat.reusable(engine, held, second))
    torch.testing.assert_close(reused, prefill(fresh, second), atol=1e-4, rtol=0)
    with pytest.raises(BadInput, match="cached=3 must leave"):
        TextGeneration(engine, first[:3], SamplingParams(), cached=3)
    engine.close(), fresh.close()
    recurrent = types.SimpleNamespace(model=types.SimpleNamespace(linear={1: None}))
    assert chat.reusable(recurrent, [1, 2, 3], [1, 2, 3, 4]) == 3
    assert chat.reusable(recurrent, [1, 2, 3], [1, 2, 4]) == 0  # its state holds token 3, which the prompt drops
    real, cached = chat.reusable, []
    monkeypatch.setattr(chat, "reusable", lambda *a: cached.append(real(*a)) or cached[-1])
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\nNay, answer me.\n"))
    assert cli.main(["chat", "--store", "ram", "-n", "6"]) == 0
    capsys.readouterr()
    assert cached[0] == 0 and cached[1] >= len(first)  # the first turn's prompt at least


def test_a_generation_that_says_it_continues_the_cache_must_find_its_tokens_there():
    """TextGeneration(cached=k) on an engine whose KV cache holds another text (or none) continued that text in
    silence; it is refused, naming the tokens the cache shares with the prompt. A sequence's own cache swapped in
    leaves the engine's record as it was."""
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration
    from expertcache.errors import BadInput
    engine = Engine(None, EngineConfig(store="ram", max_seq=256))
    prompt = engine.encode("USER.\nWho goes there?\n\nASSISTANT.\n")
    with pytest.raises(BadInput, match="holds 0 of the prompt's first tokens .* give cached=0"):
        TextGeneration(engine, prompt, SamplingParams(max_tokens=2), cached=4)  # a fresh engine
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    list(gen)
    held = (prompt + gen.tokens)[:gen.kv_end]
    assert engine.kv_ids == held
    list(TextGeneration(engine, engine.encode("ROMEO."), SamplingParams(max_tokens=2), own_kv=True))
    assert engine.kv_ids == held  # its own cache: the engine's holds what it held
    more = held + engine.encode("\n\nUSER.\nNay.\n\nASSISTANT.\n")
    assert len(list(TextGeneration(engine, more, SamplingParams(max_tokens=2, ignore_eos=True), cached=len(held))))
    engine.forward(engine.encode("JULIET. Ay me!"), 0)  # another text over the cache
    with pytest.raises(BadInput, match="its last forward ran another text"):
        TextGeneration(engine, more, SamplingParams(max_tokens=2), cached=len(held))
    engine.close()


def test_chat_verb_answers_each_stdin_line(monkeypatch, capsys):
    import io

    from expertcache import cli
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\n\nStand and unfold yourself.\n"))
    assert cli.main(["chat", "--store", "ram", "-n", "6"]) == 0
    replies = capsys.readouterr().out.split("\n")
    assert len([r for r in replies if r.strip()]) >= 2
    # a conversation that outgrows --max-seq goes on without its oldest exchanges
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\nStand and unfold yourself.\nLong live the king!\n"))
    assert cli.main(["chat", "--store", "ram", "-n", "30", "--ignore-eos", "--max-seq", "80",
                     "--system", "A play."]) == 0
    assert "exchange(s) left the context" in capsys.readouterr().err


def test_side_files_where_releases_put_them(tmp_path, capsys):
    """generation_config.json's end-of-turn ids stop generation; a chat template in chat_template.jinja (what
    transformers 5 saves) is found; an unreadable tokenizer_config.json is one line naming the file."""
    import json

    from expertcache import cli
    from expertcache.engine.chat import ChatTemplate
    from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
    from expertcache.engine.generate import TextGeneration, eos_token_ids
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(BUILTIN_MODEL / name)
    tok_config = json.loads((BUILTIN_MODEL / "tokenizer_config.json").read_text())
    template = tok_config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (tmp_path / "chat_template.jinja").write_text(template)
    engine = Engine(tmp_path, EngineConfig(store="ram", max_seq=64))
    messages = [{"role": "user", "content": "Who goes there?"}]
    assert ChatTemplate.of(engine).render(messages) == ChatTemplate(template).render(messages)
    prompt = engine.encode("ROMEO.\n")
    first = TextGeneration(engine, prompt, SamplingParams(max_tokens=4)).step().token
    assert first not in eos_token_ids(engine)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [True, first]}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id .True, "):
        eos_token_ids(engine)  # true is no token id (it was read as token 1, then left out in silence)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, first]}))
    gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=4))
    assert gen.eos == eos_token_ids(engine) == {0, first}
    assert gen.step().finish_reason == "stop" and gen.tokens == []
    engine.close()
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",')
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(tmp_path), "--store", "ram", "-n", "2", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer_config.json is not valid JSON" in err, err


def test_tiny_temperatures_and_vllm_top_k_sample(monkeypatch, capsys):
    """A temperature too small to divide by (1e-45) samples the most likely token instead of overflowing to NaN;
    top_k -1 (vLLM's 'no limit') is top_k 0. The CLI refuses an empty prompt and a chat line that is not UTF-8
    in one line each, and reads a Windows line end as a plain one."""
    import io

    from expertcache import cli
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0 - 1e-6])
    for t in (1e-45, 1e-38):
        assert Sampler(SamplingParams(temperature=t, seed=0))(logits, torch.tensor([], dtype=torch.long)) == 1
    assert SamplingParams(top_k=-1).top_k == -1
    # 1e-300 rounds to 0 and 1e300 to inf in float32; a tiny repetition penalty sends seen logits to +inf; an -inf
    # (an end token barred before min_tokens) stays barred: none of them may make NaN
    barred, seen = torch.cat([logits, torch.tensor([float("-inf")])]), torch.tensor([0, 1])
    for t, rep, want in [(1e-300, 1.0, {1}), (1e300, 1.0, {0, 1, 2, 3}), (1.0, 1e-40, {0, 1})]:
        sampler = Sampler(SamplingParams(temperature=t, repetition_penalty=rep, seed=0))
        assert {sampler(barred, seen) for _ in range(100)} == want
    with pytest.raises(SamplingError, match="top_k"):
        SamplingParams(top_k=-2)
    assert cli.main(["generate", "--store", "ram", "-p", ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("caf\udcff\n"))  # stdin's surrogateescape of a stray byte
    assert cli.main(["chat", "--store", "ram", "-n", "2"]) == 2
    *banner, err = capsys.readouterr().err.strip().splitlines()  # the chat's banner, then one line of error
    assert [b.startswith("expertcache chat:") for b in banner] == [True] and "not valid UTF-8" in err, err
    replies = {}
    for end in ("\n", "\r\n"):
        monkeypatch.setattr("sys.stdin", io.StringIO(f"Who goes there?{end}"))
        assert cli.main(["chat", "--store", "ram", "-n", "6"]) == 0
        replies[end] = capsys.readouterr().out
    assert replies["\n"] == replies["\r\n"]
