"""Structured output: a generation whose text is a JSON value of a given JSON schema (OpenAI's response_format
json_object and json_schema), a match of a regular expression, one of given strings (vLLM's guided_regex and
guided_choice), or a sentence of a context-free grammar (llama.cpp's GBNF grammar, vLLM's guided_grammar), by
masking each step's logits to the tokens the grammar allows next. The grammars and their token masks are
llguidance's, over the model's own tokenizer."""
from __future__ import annotations

import json
import weakref
from functools import lru_cache

import numpy as np
import torch

from ..errors import BadInput

JSON_OBJECT = '{"type": "object"}'  # OpenAI's response_format json_object: any JSON object
# written as json.dumps writes it: free whitespace let a model pad a value with newlines and tabs up to max_tokens
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The grammar builders are cached: SamplingParams checks a request's grammar as it is made, and each of its
# generations (n choices) builds it again; a large schema takes ~0.2 s each time.
GRAMMARS = 32
# A grammar is built while every other request waits, and its build grows faster than its text: 6.6 MB of choices
# took 150 s, 60,000 grammar alternatives 6.4 s, 3,000 schema properties 0.9 s (and past ~65,000 alternatives
# llguidance panics). The caps keep a build to seconds at worst and are far above what a person or a tool list
# writes: a tool list with descriptions spends its characters where they cost little (617 KB built in 0.2 s).
MAX_GRAMMAR_CHARS = 500_000
MAX_CHOICE_CHARS = 100_000  # choices are all alternatives: 100 KB of them build in 0.05 s


class TooLarge(ValueError):
    """A grammar's source past its cap."""


def bounded(text: str, what: str = "is", limit: int = MAX_GRAMMAR_CHARS) -> str:
    """`text`, the source of a grammar; TooLarge past `limit` characters (`what`: how the message begins)."""
    if len(text) > limit:
        raise TooLarge(f"{what} {len(text):,} characters long, over the {limit:,} a structured output may take; "
                       "send a smaller one")
    return text


@lru_cache(GRAMMARS)
def grammar(schema: str) -> str:
    """llguidance's grammar of the JSON values of `schema` (a schema's own x-guidance options win over LAYOUT)."""
    from llguidance import LLMatcher
    return LLMatcher.grammar_from_json_schema(bounded(schema), defaults=LAYOUT)


def one_line(problem: str) -> str:
    """llguidance's message on one line: a regex's parse error spans lines, a caret under the pattern; a panic's
    backtrace is left out."""
    text = str(problem).split("<backtrace>")[0].split("stack backtrace:")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    line = named[0] if named else " ".join(lines)
    return line if len(line) <= 300 else line[:297] + "..."


@lru_cache(GRAMMARS)
def regex_grammar(pattern: str) -> str:
    """llguidance's grammar of the texts that match `pattern` whole (Rust's regex syntax, as vLLM's guided_regex);
    ValueError naming what is wrong when it cannot be followed."""
    from llguidance import LLMatcher
    bounded(pattern)
    try:
        text = LLMatcher.grammar_from_regex(pattern)
    except ValueError as e:
        raise ValueError(f"is not a regular expression ({one_line(e)})") from None
    if problem := LLMatcher.validate_grammar(text):
        raise ValueError(f"is not a regular expression llguidance can follow ({one_line(problem)})")
    return text


@lru_cache(GRAMMARS)
def choice_grammar(choices: tuple[str, ...]) -> str:
    """llguidance's grammar of exactly one of `choices` (vLLM's guided_choice)."""
    from llguidance import LLMatcher
    return LLMatcher.grammar_from_lark(bounded("start: " + " | ".join(json.dumps(c) for c in choices),
                                               f"is {len(choices):,} choices,", MAX_CHOICE_CHARS))


@lru_cache(GRAMMARS)
def cfg_grammar(text: str) -> str:
    """llguidance's grammar of a context-free grammar written in GBNF (llama.cpp's) or in llguidance's Lark syntax;
    ValueError naming what is wrong when it cannot be followed."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark
    bounded(text)
    try:
        lark = any_to_lark(text)
    except Exception as e:  # the converter raises plain Exceptions too (a rule used but never defined)
        raise ValueError(f"is not a grammar ({one_line(e)})") from None
    text = LLMatcher.grammar_from_lark(lark)
    if problem := LLMatcher.validate_grammar(text):
        raise ValueError(f"is not a grammar llguidance can follow ({one_line(problem)})")
    return text


def grammar_of(params) -> str | None:
    """The grammar that SamplingParams `params` keep the output to (json_schema, regex, choice or grammar), or
    None."""
    if params.json_schema is not None:
        return grammar(params.json_schema)
    if params.regex is not None:
        return regex_grammar(params.regex)
    if params.grammar is not None:
        return cfg_grammar(params.grammar)
    return choice_grammar(params.choice) if params.choice is not None else None


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_VALUES = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if", "then",
                 "else", "contains", "propertyNames", "unevaluatedItems")  # a schema, or a list of them


def closed(schema):
    """`schema` with every object schema that lists its properties and says nothing of others taking none beyond
    them (additionalProperties false), at any depth: OpenAI's `strict: true`, where JSON Schema's own default
    lets a model add keys of its choosing. Only schemas are walked (not a const's, an enum's or a default's
    values, nor a property's name). A copy; `schema` is left as it is."""
    if isinstance(schema, list):
        return [closed(part) for part in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(part) for name, part in out[key].items()}
    for key in SCHEMA_VALUES:
        if key in out:
            out[key] = closed(out[key])
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def schema_text(schema) -> str:
    """A JSON schema (a dict or its JSON text) as the canonical JSON text SamplingParams keeps; ValueError naming
    what is wrong for anything llguidance cannot follow (a boolean schema neither: llguidance takes objects)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:  # not JSON, or an integer of more digits than int() takes
            raise ValueError(f"is not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"is a JSON {type(schema).__name__}, not a schema (an object such as {JSON_OBJECT})")
    try:
        text = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:  # a dict of values JSON has no form for
        raise ValueError(f"is not JSON ({e})") from None
    from llguidance import LLMatcher
    problem = LLMatcher.validate_grammar(grammar(text))
    if problem:
        raise ValueError(f"cannot be followed ({one_line(problem)})")
    return text


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its grammar tokenizer


def grammar_tokenizer(engine):
    """llguidance's view of the engine's tokenizer, made once an engine (its token masks span the model's
    vocabulary; the model's end ids end a value)."""
    if engine not in _TOKENIZERS:
        if engine.tokenizer is None:
            raise BadInput(f"{engine.path} has no tokenizer.json, which structured output needs to know each token's "
                           f"text; {engine.checkpoint.tokenizer_fix()}")
        from llguidance import LLTokenizer

        from .generate import eos_token_ids
        _TOKENIZERS[engine] = LLTokenizer(engine.tokenizer.to_str(), n_vocab=engine.args.vocab_size,
                                          eos_token=sorted(eos_token_ids(engine)) or None)
    return _TOKENIZERS[engine]


class Constraint:
    """One generation's place in its grammar: `mask` leaves the logits of the tokens it allows next (an end id,
    `ends`, once the text is complete), `consume` moves past a sampled one; `closed` once nothing but an end can
    follow."""

    def __init__(self, engine, grammar_text: str):
        from llguidance import LLMatcher
        tokenizer = grammar_tokenizer(engine)
        self.matcher = LLMatcher(tokenizer, grammar_text, log_level=0)
        if self.matcher.is_error():  # SamplingParams checked it without the tokenizer
            raise BadInput(f"the structured output's grammar cannot be followed with this model's tokenizer "
                           f"({one_line(self.matcher.get_error())})")
        self.ends = frozenset(tokenizer.eos_tokens)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar does not allow next at -inf."""
        allowed = torch.from_numpy(np.frombuffer(self.matcher.compute_logit_bias(), np.uint8)[:logits.numel()] > 0)
        if self.matcher.is_error() and self.matcher.get_error().startswith("NoExtensionBias"):
            # it allows an end, which would end the output silently: rules that lead nowhere from here
            raise BadInput("the structured output's grammar has no text that continues from here (a rule that only "
                           "refers to itself never ends, e.g. x ::= x); give each rule an alternative that ends")
        if self.matcher.is_error() or not allowed.any():  # sampling would pick a token at random
            self._failed()
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        """Move past `token`, one that `mask` allowed."""
        if not self.matcher.consume_token(token):
            self._failed()

    def _failed(self):
        # the tokens are the mask's: what stops the matcher is the grammar's size against llguidance's parser limits
        # (a schema of 2,000 properties passed its check and exceeded them at its first key)
        error = (self.matcher.get_error().strip().splitlines() or ["no token allowed"])[0]  # then the parser's state
        raise BadInput(f"the structured output's grammar is too large to follow ({error}); send a smaller one")

    @property
    def closed(self) -> bool:
        return self.matcher.is_stopped()
