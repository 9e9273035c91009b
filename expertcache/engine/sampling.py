"""Sampling parameters, the sampler (logits -> next token) and an incremental detokenizer
whose work per token is bounded, so streaming costs time linear in the output length."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import BadInput

MAX_LOGPROBS = 20  # alternatives a token, as OpenAI's top_logprobs allows
NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
WHOLE = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
OPTIONAL = ("seed", "logprobs", "prompt_logprobs")  # None: no seed, no log-probabilities
STRUCTURES = ("json_schema", "regex", "choice", "grammar")  # what may keep the output to a form


def short(text: str, width: int = 60) -> str:
    """`text` for an error's one line: its repr (newlines escaped), cut to about `width` characters."""
    return repr(text if len(text) <= width else text[:width - 3] + "...")


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it ends. temperature 0 is greedy."""
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 (or -1, as vLLM writes it): no limit
    min_p: float = 0.0  # drop tokens below min_p * the most likely token's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output (CTRL rule)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output has (OpenAI's rule)
    frequency_penalty: float = 0.0  # subtracted from a token's logit once for each time the output has it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to that token's logit before sampling
    seed: int | None = None  # None: a fresh random seed per request
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the output before this many tokens
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first occurrence
    include_stop_str_in_output: bool = False  # vLLM's: the output ends after the stop string instead
    stop_token_ids: tuple[int, ...] = ()  # ids that end the output as EOS does (also with ignore_eos)
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's log-probability and this many most likely alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (scoring); then max_tokens may be 0
    json_schema: str | None = None  # the output is a JSON value of this schema (a dict or its JSON text, held as
    # canonical JSON; '{"type": "object"}' is OpenAI's json_object); it ends where the value is complete
    regex: str | None = None  # the output matches this regular expression whole (vLLM's guided_regex)
    choice: tuple[str, ...] | None = None  # the output is one of these strings (vLLM's guided_choice)
    grammar: str | None = None  # the output is a sentence of this context-free grammar, in GBNF (llama.cpp's grammar,
    # vLLM's guided_grammar) or llguidance's Lark syntax
    skip_special_tokens: bool = True  # vLLM's: the output's text leaves out special tokens' (GPT-OSS's <|channel|>...)

    def __post_init__(self):
        # the forms OpenAI's and vLLM's APIs take (one stop string, lists, a {token: bias} dict, None for none), held
        # as tuples: a string was iterated as stop strings of one character each (the output ended at its first
        # "e"), and a dict or None failed with a TypeError
        bias = self.logit_bias
        object.__setattr__(self, "logit_bias", () if bias is None else tuple(bias.items()) if isinstance(bias, dict)
                           else bias)
        for name, kind in (("stop", str), ("stop_token_ids", numbers.Integral)):
            value = getattr(self, name)
            items = ((value,) if isinstance(value, str) else () if value is None
                     else tuple(value) if isinstance(value, (list, tuple)) else None)
            if items is None or not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
                raise SamplingError(name, f"{name}={value!r} must be a list of "
                                          f"{'strings' if kind is str else 'token ids'}")
            object.__setattr__(self, name, items)
        for name in NUMBERS + WHOLE:  # a string or None would fail the range checks below with a TypeError
            value, whole = getattr(self, name), name in WHOLE
            kind = numbers.Integral if whole else numbers.Real
            if not (value is None and name in OPTIONAL) and (isinstance(value, bool) or not isinstance(value, kind)):
                raise SamplingError(name, f"{name}={value!r} must be a {'whole ' * whole}number, "
                                          f"not {type(value).__name__}")
            if value is not None:  # a NumPy integer as an int: torch's manual_seed refused np.int64; a Fraction or
                # a Decimal as a float: the sampler's tensor arithmetic refused them
                object.__setattr__(self, name, int(value) if whole else float(value))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (0 <= self.temperature < math.inf, "temperature", "must be a finite number >= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be >= 1, or 0 or -1 to disable it"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (0 < self.repetition_penalty < math.inf, "repetition_penalty",
             "must be a finite number > 0 (1 disables it)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2] (0 disables it)"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2] (0 disables it)"),
            (self.seed is None or -2**63 <= self.seed < 2**64, "seed", "must be a whole number in [-2**63, 2**64)"),
            (self.max_tokens >= (0 if self.prompt_logprobs is not None else 1), "max_tokens",
             "must be >= 1 (0 only when scoring the prompt)"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be >= 0 and at most max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be in [0, {MAX_LOGPROBS}] alternatives a token"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"must be in [0, {MAX_LOGPROBS}] alternatives a token"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise SamplingError(name, f"{name}={getattr(self, name)!r} {rule}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):  # "no" would read as true
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(name, f"{name}={getattr(self, name)!r} must be true or false")
        if "" in self.stop:  # named alone: the tuple the field holds is no form a user wrote
            raise SamplingError("stop", "stop='' must be a non-empty string")
        if not isinstance(self.logit_bias, (list, tuple)) or \
                not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in self.logit_bias):
            raise SamplingError("logit_bias", f"logit_bias={self.logit_bias!r} must map token ids to biases")
        for token, bias in self.logit_bias:
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0 or \
                    not isinstance(bias, numbers.Real) or not -100 <= bias <= 100:
                raise SamplingError("logit_bias", f"logit_bias {token!r}: {bias!r} must map a token id (an int "
                                                  ">= 0) to a bias in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple((int(t), b) for t, b in self.logit_bias))
        self._check_structure()

    @property
    def constrained(self) -> bool:
        """Whether the output is kept to a JSON schema, regex, choice or grammar."""
        return any(getattr(self, name) is not None for name in STRUCTURES)

    def _check_structure(self) -> None:
        """json_schema, regex, choice and grammar: at most one, each one llguidance can follow, and none with
        min_tokens."""
        from .structured import TooLarge, cfg_grammar, choice_grammar, regex_grammar, schema_text
        given = [name for name in STRUCTURES if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingError(given[1], f"{' and '.join(given)} each constrain the output; give one")
        if self.json_schema is not None:
            try:
                object.__setattr__(self, "json_schema", schema_text(self.json_schema))
            except ValueError as e:
                hint = "" if isinstance(e, TooLarge) else '; give a JSON schema such as {"type": "object"}'
                raise SamplingError("json_schema", f"the JSON schema {e}{hint}") from None
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise SamplingError("regex", f"regex={self.regex!r} must be a non-empty string")
            try:
                regex_grammar(self.regex)
            except ValueError as e:
                raise SamplingError("regex", f"regex={short(self.regex)} {e}") from None
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise SamplingError("grammar", f"grammar={self.grammar!r} must be a non-empty string, e.g. "
                                               "'root ::= \"yes\" | \"no\"'")
            try:
                cfg_grammar(self.grammar)
            except ValueError as e:
                raise SamplingError("grammar", f"grammar={short(self.grammar)} {e}") from None
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not isinstance(choice, (list, tuple)) or not choice or \
                    not all(isinstance(c, str) and c for c in choice):
                raise SamplingError("choice", f"choice={short(repr(self.choice))} must be a list of non-empty "
                                              "strings")
            object.__setattr__(self, "choice", tuple(choice))
            try:
                choice_grammar(self.choice)
            except ValueError as e:
                raise SamplingError("choice", f"choice {e}") from None
        if given and self.min_tokens:  # barring the end past a complete text would leave no token to sample
            raise SamplingError("min_tokens", f"min_tokens={self.min_tokens} cannot be combined with {given[0]}, "
                                              "which decides where the output ends; leave one out")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the most likely one (temperature 0)."""
        return self.temperature == 0

    @property
    def counts_output(self) -> bool:
        """Whether sampling needs how often the output has each token (presence and frequency penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class SamplingError(BadInput):
    """A sampling parameter out of range; `param` names it (for OpenAI-style error bodies)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def generator_seed(seed: int) -> int:
    """The seed the host generator takes for a request's `seed` (a whole number in [-2**63, 2**64), a negative one
    read as its 64 bits, as torch reads it): itself below 2**32; past that mixed down to 32 bits (splitmix64's
    finalizer), since torch's CPU generator keeps only a seed's low 32 bits, and seeds 2**32 apart drew the same
    tokens."""
    s = seed % 2**64
    if s < 2**32:
        return s
    s = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    s = (s ^ (s >> 27)) * 0x94D049BB133111EB % 2**64
    return (s ^ (s >> 31)) >> 32


class Sampler:
    """Picks the next token from logits [V] (on any device) given the ids seen so far (prompt + output) and how
    often the output has each token; the random draw is made on the host with a host generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(generator_seed(params.seed))
        bias = dict(params.logit_bias)  # a token given twice takes its last bias
        self.bias = (torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()))) if bias else None

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor | None = None) -> int:
        """The next token from logits [V]: the penalties (repetition over `seen`, presence and frequency over
        `counts` [V], the output's occurrences of each token) and the logit bias, then greedy or sampled."""
        p = self.params
        if p.repetition_penalty != 1.0 and seen.numel():
            seen = seen.to(logits.device)
            prev = logits[seen]
            logits = logits.clone()
            logits[seen] = torch.where(prev > 0, prev / p.repetition_penalty, prev * p.repetition_penalty)
        if counts is not None and p.counts_output:
            counts = counts.to(logits.device, logits.dtype)
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        if self.bias is not None:
            ids, bias = self.bias
            logits = logits.index_add(0, ids.to(logits.device), bias.to(logits.device, logits.dtype))
        if p.greedy:
            return int(logits.argmax())
        # within float32's range, or inf - inf and -inf / inf make NaN: a logit that a tiny repetition penalty sent to
        # +inf, a temperature that rounds to 0 or to inf. Shifted first: a tiny temperature gives -inf, not inf - inf
        f32 = torch.finfo(torch.float32)
        logits = logits.float().clamp(max=f32.max)
        logits = (logits - logits.max()) / min(max(p.temperature, f32.tiny), f32.max)
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep a token if the mass before it is below top_p (the first token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop[0] = False  # even where top_p rounds to 0 in float32 (1e-300)
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        # drawn on the generator's device (the host): a seed gives the same tokens on every device
        return int(torch.multinomial(probs.to(self.generator.device), 1, generator=self.generator))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, decoding only a short tail window
    per token (a few ids), and holding back text that ends in an incomplete UTF-8 sequence
    (byte-level BPE tokens can split a character)."""

    def __init__(self, tokenizer, prompt: list[int] | None = None, context: int = 4, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = list(prompt[-context:]) if prompt else []
        # text of ids[prefix:read] was emitted; ids[read:] are pending
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, token: int) -> str:
        """Add one token; returns the new text it completes ('' while a character is split)."""
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back at the end of the output (a split character stays replaced)."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):]


class StopStrings:
    """Cuts streamed text at the first stop string, holding back a tail that could be the
    start of one so no stop text is ever emitted (with `include`, the text ends with the stop string)."""

    def __init__(self, stop: tuple[str, ...], include: bool = False):
        self.stop, self.include = stop, include
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.barred = 0  # a stop string must end past this many characters of `pending` (text fed unmatched)

    def feed(self, text: str, match: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached). With `match` False (the tokens before
        vLLM's min_tokens) no stop string may end in `text`; one that starts in it and ends in later text still
        counts, as vLLM reads stop strings over the text before the new token's too."""
        if not self.stop:
            return text, False
        self.pending += text
        if not match:
            self.barred = len(self.pending)
        found = [(i, -len(s)) for s in self.stop
                 if (i := self.pending.find(s, max(0, self.barred - len(s) + 1))) >= 0] if match else []
        if found:
            cut, minus_length = min(found)  # the first to start; of those, the longest
            out, self.pending, self.barred = self.pending[:cut - minus_length if self.include else cut], "", 0
            return out, True
        keep = len(self.pending) - self.hold
        if keep <= 0:
            return "", False
        out, self.pending, self.barred = self.pending[:keep], self.pending[keep:], max(0, self.barred - keep)
        return out, False

    def flush(self) -> str:
        """The held-back tail, emitted when the stream ends without a stop string."""
        out, self.pending = self.pending, ""
        return out
