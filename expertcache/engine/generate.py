"""Autoregressive generation through the engine, one token per step: sampling, EOS and stop
strings, incremental text. A `TextGeneration` may own its KV cache, so that a scheduler can
interleave the steps of several requests over one engine and one expert cache, or run them
as one batched forward (`batch_logits`)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import BadInput, CheckpointError, truth, whole_number
from ..policies import MissPolicy
from .engine import Engine
from .sampling import IncrementalDetokenizer, Sampler, SamplingParams, StopStrings
from .structured import Constraint, grammar_of


def eos_token_ids(engine: Engine) -> frozenset[int]:
    """The checkpoint's end-of-sequence ids: the eos_token_id (an id or a list) of config.json and of
    generation_config.json (where releases list their end-of-turn ids), and tokenizer_config.json's eos_token."""
    found = engine.checkpoint.eos_token_ids(engine.args.vocab_size)
    token = tokenizer_config(engine).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and not isinstance(token, str):  # the tokenizer's TypeError was a traceback
        raise CheckpointError(f"{engine.path}: tokenizer_config.json's eos_token is {token!r}, not a token's text; "
                              "restore the file from the model's release")
    if token and engine.tokenizer is not None and engine.tokenizer.token_to_id(token) is not None:
        found.add(engine.tokenizer.token_to_id(token))
    return frozenset(found)


def tokenizer_config(engine: Engine) -> dict:
    """The checkpoint's tokenizer_config.json, or {} when it has none."""
    return engine.checkpoint.side_json("tokenizer_config.json")


def check_length(engine: Engine, prompt_len: int, max_tokens: int) -> None:
    """Raise BadInput unless a prompt and its new tokens fit the engine's max_seq."""
    if prompt_len < 1:
        raise BadInput("generation needs a prompt of at least one token")
    if prompt_len + max_tokens > engine.model.max_seq:
        raise BadInput(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed max_seq="
                         f"{engine.model.max_seq}; shorten them or raise --max-seq")


def prefill(engine: Engine, prompt: list[int], policy: MissPolicy | None = None, every: bool = False,
            start: int = 0) -> torch.Tensor:
    """One forward over the prompt -> logits of its last position [V] (with `every`, of every position [T, V]).
    With `policy`, the prompt's misses are decided by it instead of the engine's policy (prefill protection).
    `start`: positions [0, start) of the engine's cache already hold the prompt's keys and values; the forward runs
    the rest."""
    assert not (every and start), "scoring every position needs the whole prompt's forward"
    decode_policy = engine.runner.policy
    if policy is not None:
        engine.runner.policy = engine.bind_policy(policy)
    try:
        # a prefill policy of its own decides the prompt as asked, token by token (prefill protection)
        logits = engine.forward(torch.tensor(prompt[start:]), start, last=not every, prompt=policy is None)
        return logits if every else logits[-1]
    finally:
        engine.runner.policy = decode_policy


@dataclass
class StepOutput:
    """What one step produced: the token, the text it adds, and why generation ended (None while
    it goes on)."""
    token: int | None  # None: a step that sampled nothing (max_tokens 0, scoring the prompt)
    text: str  # new text to show (may be '' while a character or a stop string is incomplete)
    finish_reason: str | None  # None, "stop" (EOS or a stop string) or "length"
    logprob: float | None = None  # with SamplingParams.logprobs: the token's log-probability under the model
    top: tuple[tuple[int, float], ...] = ()  # and the most likely tokens with theirs (SamplingParams.logprobs of them)
    prompt: tuple | None = None  # the first step's, with SamplingParams.prompt_logprobs: the prompt's tokens as
    # StepOutputs (no text) with their log-probabilities (None for the first token, which nothing predicts)


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under the model's distribution (the softmax of its logits [V], before
    temperature, penalties and truncation shape the sampling), and the `n` most likely tokens with theirs."""
    logp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(logp, n) if n else None
    alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return float(logp[token]), alternatives


def prompt_scores(logits: torch.Tensor, prompt: list[int], n: int) -> tuple[StepOutput, ...]:
    """The prompt's tokens scored by the prefill's logits [T, V]: token j by position j - 1's distribution."""
    first = StepOutput(prompt[0], "", None)
    return (first, *(StepOutput(t, "", None, *token_logprobs(logits[j - 1], t, n)) for j, t in enumerate(prompt)
                     if j))


def check_token_ids(engine, params: SamplingParams) -> None:
    """BadInput for `params`' token ids outside the engine's vocabulary: a stop id is never sampled (a stop that
    silently never ends), a bias on no token is silently without effect."""
    vocab = engine.args.vocab_size
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise BadInput(f"stop_token_ids {list(params.stop_token_ids)} must be token ids in [0, {vocab})")
    if any(t >= vocab for t, _ in params.logit_bias):
        raise BadInput(f"logit_bias names token {max(t for t, _ in params.logit_bias)}; token ids are in [0, {vocab})")


class TextGeneration:
    """One sequence being generated: call `step()` until `finish_reason` is set.

    own_kv: the sequence keeps its KV cache in its own buffers, swapped into the transformer for each step, so other
    sequences can run steps in between on the same engine (not where the model has latent or linear attention, whose
    state is the engine's: there one generation runs to its end before the next steps). cached: the engine's own
    cache already holds the keys and values of the prompt's first `cached` tokens (a chat's earlier turns, `kv_end`
    of the generation before), so the prefill runs only the rest; `kv_end` counts the positions this one leaves
    written."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams, own_kv: bool = False,
                 prefill_policy: MissPolicy | None = None, cached: int = 0):
        if not isinstance(engine, Engine) or not isinstance(params, SamplingParams):  # else an AttributeError
            raise BadInput(f"TextGeneration takes an Engine and a SamplingParams, e.g. SamplingParams(max_tokens=16), "
                           f"not {type(engine).__name__} and {type(params).__name__}")
        prompt = engine.token_ids(prompt, empty=True).tolist()  # a tensor, an array or a list, checked once
        own_kv = truth(own_kv, "own_kv")
        cached = whole_number(cached, "cached")  # a float failed at the prefill's slice, a string in the comparison
        check_length(engine, len(prompt), params.max_tokens)
        if not 0 <= cached < len(prompt) or cached and (own_kv or params.prompt_logprobs is not None):
            raise BadInput(f"cached={cached} must leave at least one of the prompt's {len(prompt)} tokens to run, "
                           "on the engine's own cache, without prompt_logprobs")
        held = engine.kv_ids
        # the cache must hold these tokens (else the generation silently continues another text), and a recurrent
        # state all of what it holds, which cannot be cut back
        if cached and (held[:cached] != prompt[:cached] or engine.model.linear and len(held) != cached):
            shared = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
            fit = 0 if engine.model.linear else min(shared, cached)
            raise BadInput(f"cached={cached}, but the engine's KV cache holds {shared} of the prompt's first tokens "
                           f"(its last forward ran {'another' if shared < len(held) else 'a shorter'} text); give "
                           f"cached={fit}" + (", or 0" if fit else ""))
        self.kv_end = cached
        self.kv_mark = engine.kv_writes  # the engine's forwards when its KV cache last held this sequence's keys
        vocab = engine.args.vocab_size
        check_token_ids(engine, params)
        self.engine, self.prompt, self.params = engine, prompt, params
        self.prefill_policy = prefill_policy and engine.bind_policy(prefill_policy)  # refused here, not mid-step
        self.sampler = Sampler(params)
        self.eos = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids(engine))
        # barred before min_tokens (an end id of a config's past the vocabulary is never sampled anyway)
        self.eos_ids = torch.tensor(sorted(t for t in self.eos if t < vocab), dtype=torch.long)
        self.detok = None if engine.tokenizer is None else \
            IncrementalDetokenizer(engine.tokenizer, prompt, skip_special=params.skip_special_tokens)
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        grammar = grammar_of(params)
        self.constraint = Constraint(engine, grammar) if grammar is not None else None
        self.tokens: list[int] = []  # the output's tokens, not the end token that ended it
        self.end_token: int | None = None  # the end token sampled last, where one ended it
        self.finish_reason: str | None = None
        self.scored: tuple[StepOutput, ...] | None = None  # the prompt's tokens with their logprobs, once prefilled
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(engine.args.vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(prompt)] = True
        self.counts = torch.zeros(vocab, dtype=torch.int32) if params.counts_output else None  # the output's
        self.kv = None
        if own_kv:
            m = engine.model
            shape = (*m.k_cache.shape[:2], len(prompt) + params.max_tokens, m.k_cache.shape[3])
            self.kv = (torch.zeros(shape, dtype=m.k_cache.dtype, device=m.k_cache.device),
                       torch.zeros(shape, dtype=m.v_cache.dtype, device=m.v_cache.device))

    def _on_kv(self, run):
        """run() over this sequence's keys and values: its own buffers, swapped in for the call only (a generation
        on the engine's cache must not write into them), or the engine's cache, refused where another forward ran
        over it since this sequence's last (it wrote its own keys over these: silently another continuation)."""
        m = self.engine.model
        if self.kv is not None:
            # latent attention's cache and linear attention's state are the engine's, not swapped: another
            # sequence's steps in between leaked into this one's logits (10-50% of them on tiny models)
            if m.state_beyond_kv and self.kv_end and self.engine.kv_writes != self.kv_mark:
                raise BadInput("another sequence ran on the engine since this generation's last step, and this "
                               "model's latent or linear attention state is the engine's, not a sequence's own; "
                               "finish one generation before the next starts")
            keep, (m.k_cache, m.v_cache) = (m.k_cache, m.v_cache), self.kv
            swapped, self.engine.kv_swapped = self.engine.kv_swapped, True
            try:
                return run()
            finally:
                self.kv, (m.k_cache, m.v_cache) = (m.k_cache, m.v_cache), keep
                self.engine.kv_swapped = swapped
                self.kv_mark = self.engine.kv_writes
        if self.kv_end and self.engine.kv_writes != self.kv_mark:
            raise BadInput("another forward ran over the engine's KV cache since this generation's last step (a "
                           "generation or perplexity on the same engine); finish one generation before the next "
                           "starts, or give each its own KV cache (TextGeneration(..., own_kv=True))")
        try:
            return run()
        finally:
            self.kv_mark = self.engine.kv_writes

    def _logits(self) -> torch.Tensor:
        return self._on_kv(self._run)

    def _run(self) -> torch.Tensor:
        if not self.tokens:
            n = self.params.prompt_logprobs
            if n is None:  # the rest of the prompt: from `cached`, or from where prefill_part stopped
                logits = prefill(self.engine, self.prompt, self.prefill_policy, start=self.kv_end)
            else:
                logits = prefill(self.engine, self.prompt, self.prefill_policy, every=True)
                self.scored = prompt_scores(logits, self.prompt, n)
                logits = logits[-1]
            self.kv_end = len(self.prompt)
            return logits
        logits = self.engine.forward(torch.tensor(self.tokens[-1:]), self.position)[-1]
        self.kv_end = self.position + 1
        return logits

    def can_prefill_part(self, n: int) -> bool:
        """Whether `prefill_part(n)` may run: the prompt has more than `n` tokens left to run, none sampled yet,
        and its logprobs are not asked (they take the whole prompt's forward)."""
        return not self.tokens and self.params.prompt_logprobs is None and len(self.prompt) - self.kv_end > n

    def prefill_part(self, n: int) -> None:
        """Run the prompt's next `n` tokens into the KV cache, sampling nothing: a long prompt taken in parts, so
        that other sequences' steps run in between; `step()` runs the rest and samples."""
        if not self.can_prefill_part(n):
            raise BadInput(f"prefill_part({n}) needs more than {n} prompt tokens left to run, and no prompt_logprobs")
        self._on_kv(lambda: prefill(self.engine, self.prompt[:self.kv_end + n], self.prefill_policy,
                                    start=self.kv_end))
        self.kv_end += n

    @property
    def position(self) -> int:
        """The position of the last sampled token, which the next decode step feeds (after the prefill)."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def decoding(self) -> bool:
        """Whether the prompt is done and the next step decodes one token (it can join a batch)."""
        return bool(self.tokens) and self.finish_reason is None

    def step(self) -> StepOutput:
        """Run the model for one new token and sample it."""
        if self.finish_reason is not None:
            raise BadInput(f"step() after the generation finished ({self.finish_reason}); start a new "
                           "TextGeneration to generate again")
        first = not self.tokens
        if self.params.max_tokens == 0:  # scoring the prompt only: no token is sampled
            self._logits()
            self.finish_reason = "length"
            out = StepOutput(None, "", "length")
        else:
            out = self.advance(self._logits())
        if first and self.scored is not None:
            out.prompt = self.scored
        return out

    @property
    def completion_tokens(self) -> int:
        """The tokens sampled: the output's and the end token that ended it (listed in logprobs too), as vLLM
        counts them; never more than max_tokens."""
        return len(self.tokens) + (self.end_token is not None)

    def advance(self, logits: torch.Tensor) -> StepOutput:
        """Sample the next token from this sequence's logits [V] and apply EOS, max_tokens and stop strings."""
        early = len(self.tokens) < self.params.min_tokens  # min_tokens: no end token yet
        barred = logits.index_fill(0, self.eos_ids.to(logits.device), float("-inf")) if early else logits
        if self.constraint is not None:
            barred = self.constraint.mask(barred)
        token = self.sampler(barred, self.seen, self.counts)
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1
        # a complete value ends at an end id of the grammar's even under ignore_eos, which would keep it as text
        kept = not (token in self.eos or self.constraint is not None and token in self.constraint.ends)
        if not kept:
            self.finish_reason, self.end_token = "stop", token
        else:
            self.tokens.append(token)
            if self.constraint is not None:
                self.constraint.consume(token)
            if self.constraint is not None and self.constraint.closed:  # nothing but an end id could follow
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.params.max_tokens:
                self.finish_reason = "length"
        text = ""
        if self.detok is not None:
            text = self.detok.push(token) if token not in self.eos else ""
            if self.finish_reason is not None:
                text += self.detok.flush()
        elif kept:  # no tokenizer: the ids joined by spaces, as Engine.decode writes them
            text = ("" if len(self.tokens) == 1 else " ") + str(token)
        # nor a stop string that ends before the min_tokens-th token's text (vLLM reads them from that token on)
        text, stopped = self.stops.feed(text, match=len(self.tokens) >= self.params.min_tokens)
        if stopped:
            self.finish_reason = "stop"
        elif self.finish_reason is not None:
            text += self.stops.flush()
        if self.params.logprobs is None:  # an end token is scored too (as OpenAI's and vLLM's logprobs list it)
            return StepOutput(token, text, self.finish_reason)
        return StepOutput(token, text, self.finish_reason, *token_logprobs(logits, token, self.params.logprobs))

    def __iter__(self) -> Iterator[StepOutput]:
        while self.finish_reason is None:
            yield self.step()


def batch_logits(engine: Engine, generations: list[TextGeneration]) -> torch.Tensor:
    """The next-token logits [B, V] of several sequences from one batched forward (Engine.forward_batch), for
    each to `advance` with its own sampling. Every generation must own its KV cache and be decoding."""
    if any(g.kv is None or not g.decoding for g in generations):
        raise BadInput("a batched step takes generations that own their KV cache and are past their prompt")
    ids = torch.tensor([g.tokens[-1] for g in generations])
    return engine.forward_batch(ids, [g.position for g in generations], [g.kv for g in generations])


def generate(engine: Engine, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, stop: int | None = None) -> Iterator[int]:
    """Yield new token ids (ids only, no EOS handling unless `stop` names a token, which is
    yielded before the end): one forward over the prompt, then one per token (KV cache). Its arguments are checked
    at the call, not at the first token."""
    if not isinstance(max_new_tokens, bool) and isinstance(max_new_tokens, int) and max_new_tokens < 1:
        raise BadInput(f"max_new_tokens={max_new_tokens} must be >= 1")  # SamplingParams would name max_tokens
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_new_tokens, ignore_eos=True)
    gen = TextGeneration(engine, prompt, params)
    if stop is not None and not 0 <= whole_number(stop, "stop") < engine.args.vocab_size:  # else never met, silently
        raise BadInput(f"stop={stop} must be a token id in [0, {engine.args.vocab_size}), or None")
    gen.detok = None  # ids only: no text to build
    return _tokens(gen, stop)


def _tokens(gen: TextGeneration, stop: int | None) -> Iterator[int]:
    """generate's tokens, one a step: its checks ran at the call, before the first `next`."""
    while gen.finish_reason is None:
        token = gen.step().token
        yield token
        if token == stop:
            return
