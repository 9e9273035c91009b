"""Teacher-forced perplexity in windows of a fixed context; the expert cache carries over
from window to window (one long run), the KV cache restarts at each window."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ..choices import EVAL_TEXT  # noqa: F401 (re-exported)
from ..errors import BadInput, truth, whole_number
from .engine import Engine, check_context, max_seq_limit


@dataclass
class PerplexityResult:
    """Perplexity of a text with its standard error, per-window NLLs and the run's counters."""
    ppl: float
    nll: float  # mean next-token negative log-likelihood (nats)
    stderr: float  # standard error of ppl (delta method over token NLLs); NaN for one token
    tokens: int  # scored tokens
    window_nll: list[float] = field(default_factory=list)  # mean NLL per window, for paired comparisons
    window_stats: list[dict] = field(default_factory=list)  # per window: calls, substituted mass, fetches
    token_nll: np.ndarray | None = None
    stats: dict = field(default_factory=dict)
    interrupted: bool = False  # a Ctrl-C ended the run early: the windows scored before it

    def to_dict(self) -> dict:
        """The result as JSON-ready values (without per-token NLLs)."""
        return {"ppl": self.ppl, "nll": self.nll, "stderr": self.stderr, "tokens": self.tokens,
                "window_nll": self.window_nll, "window_stats": self.window_stats, "stats": self.stats,
                "interrupted": self.interrupted}


def windows(n_tokens: int, context: int, segments: list[int] | None = None) -> list[tuple[int, int]]:
    """Non-overlapping [start, end) spans of at most context+1 tokens sharing one boundary token; with `segments`
    (the offsets where texts joined one after another start, 0 first), within each text: none ends in the next."""
    if whole_number(context, "context") < 1:
        raise BadInput(f"context {context} must be at least 1 token; e.g. --context 512")
    bounds = [*(segments or [0]), n_tokens]
    return [(s, min(s + context + 1, b)) for a, b in zip(bounds, bounds[1:]) for s in range(a, b - 1, context)]


def teacher_forced(forward: Callable[[torch.Tensor], torch.Tensor], ids: list[int] | torch.Tensor, context: int,
                   progress: Callable[[int], None] | None = None, score: bool = True,
                   segments: list[int] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The one teacher-forced loop: for each window of `windows`, forward(inputs [T]) -> logits
    [T, V] with the KV cache restarted, yielded with the targets [T] (the next tokens, on the logits'
    device). With
    score=False every token is an input (calibration records them all) and the last window's
    targets are one short."""
    x = torch.as_tensor(ids, dtype=torch.long)
    for start, end in windows(len(x) + (not score), context, segments):
        logits = forward(x[start:end - 1])
        assert logits.shape[0] == end - 1 - start, (tuple(logits.shape), start, end)
        yield logits, x[start + 1:end].to(logits.device)
        if progress:
            progress(end - 1 - start)


def perplexity(engine: Engine, ids: list[int], context: int = 512, reset: bool = True,
               progress: Callable[[int], None] | None = None, partial_on_interrupt: bool = False,
               segments: list[int] | None = None) -> PerplexityResult:
    """Score `ids` teacher-forced in windows of `context` under the engine's cache and policy
    (reset first unless `reset` is False: then the cache carries over from earlier runs). `segments`: where texts
    joined in `ids` start (0 first; each ends with the token that follows its last scored one), windows kept within
    each. With `partial_on_interrupt`, a Ctrl-C after the first window returns the windows scored so far
    (`interrupted` set) instead of raising."""
    if not hasattr(engine, "token_ids"):  # a path or None: an AttributeError inside
        raise BadInput(f"perplexity takes an Engine, not {type(engine).__name__}; make one with Engine(path)")
    ids = engine.token_ids(ids, empty=True)  # every id: the last is only a target, which no forward checks
    context, reset = whole_number(context, "context"), truth(reset, "reset")
    if progress is not None and not callable(progress):  # else a TypeError after the first window ran
        raise BadInput(f"progress={progress!r} must be a function of the tokens scored, or None")
    if len(ids) < 2:
        raise BadInput(f"perplexity needs at least 2 tokens of text, got {len(ids)}; give a longer text")
    if segments is not None and not (list(segments)[:1] == [0] and all(
            type(b) is int and a + 2 <= b <= len(ids) - 2 for a, b in zip(segments, list(segments)[1:]))):
        raise BadInput(f"segments={list(segments)[:8]} must be increasing offsets into ids, 0 first, each text "
                       "at least 2 tokens")
    check_context(context, engine.args)
    if min(context, len(ids) - 1) > engine.model.max_seq:  # the forward's refusal would name --max-seq alone
        limit = max_seq_limit(engine.args)
        raise BadInput(f"--context {context} is longer than --max-seq {engine.model.max_seq}; lower --context" +
                       (f", or raise --max-seq where the verb takes it (at most {limit}, the model's context)"
                        if engine.model.max_seq < limit else f" (the model's context is {limit})"))
    if reset:
        engine.reset()
    nll_parts, window_nll, window_stats = [], [], []
    counted = ("moe_calls", "substituted_mass", "substitutions", "sync_fetches")
    scored = replace(engine.stats)  # the statistics of the windows scored, to go back to when one is cut short
    interrupted = False
    try:
        for logits, targets in teacher_forced(lambda x: engine.forward(x, 0), ids, context, progress,
                                              segments=segments):
            nll = F.cross_entropy(logits, targets, reduction="none")
            window_stats.append({c: getattr(engine.stats, c) - getattr(scored, c) for c in counted})
            nll_parts.append(nll)
            window_nll.append(float(nll.double().mean()))
            scored = replace(engine.stats)
    except KeyboardInterrupt:
        if not (partial_on_interrupt and nll_parts):
            raise
        interrupted = True
        del window_stats[len(nll_parts):]
        # the window cut short counted its fetches and calls but no token: fetches a token and time a token came out
        # inflated, over tokens it did not score (the engine's runner holds the same object: updated in place)
        vars(engine.stats).update(vars(scored))
    token_nll = torch.cat(nll_parts).cpu().numpy()
    mean = float(token_nll.mean(dtype=np.float64))  # a float32 mean resolves perplexity to ~1e-6 only
    # one token has no spread to estimate: NaN (null in JSON), not a standard error of 0
    se = float(token_nll.std(ddof=1, dtype=np.float64) / math.sqrt(len(token_nll))) if len(token_nll) > 1 else math.nan
    return PerplexityResult(exp(mean), mean, exp(mean) * se, len(token_nll), window_nll,
                            window_stats, token_nll, engine.stats.to_dict(), interrupted)


def exp(nll: float) -> float:
    """A perplexity from a mean negative log-likelihood: inf past what a float holds (a model that predicts
    nothing, ~710 nats a token), not OverflowError."""
    return math.exp(nll) if nll < math.log(np.finfo(np.float64).max) else math.inf
