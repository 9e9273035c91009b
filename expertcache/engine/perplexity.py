"""Teacher-forced perplexity in windows of a fixed context; the expert cache carries over
from window to window (one long run), the KV cache restarts at each window."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadInput
from .engine import Engine

EVAL_TEXT = Path(__file__).parents[1] / "data" / "eval.txt"


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean next-token negative log-likelihood (nats)
    stderr: float  # standard error of ppl (delta method over token NLLs)
    tokens: int  # scored tokens
    window_nll: list[float] = field(default_factory=list)  # mean NLL per window, for paired comparisons
    window_stats: list[dict] = field(default_factory=list)  # per window: calls, substituted mass, fetches
    token_nll: np.ndarray | None = None
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll, "stderr": self.stderr, "tokens": self.tokens,
                "window_nll": self.window_nll, "window_stats": self.window_stats, "stats": self.stats}


def windows(n_tokens: int, context: int) -> list[tuple[int, int]]:
    """Non-overlapping [start, end) spans of at most context+1 tokens sharing one boundary token."""
    return [(s, min(s + context + 1, n_tokens)) for s in range(0, n_tokens - 1, context)]


def perplexity(engine: Engine, ids: list[int], context: int = 512, reset: bool = True,
               progress: Callable[[int], None] | None = None) -> PerplexityResult:
    if len(ids) < 2:
        raise BadInput("perplexity needs at least 2 tokens of text")
    if reset:
        engine.reset()
    x = torch.tensor(ids, dtype=torch.long)
    nll_parts, window_nll, window_stats = [], [], []
    s = engine.stats
    for start, end in windows(len(ids), context):
        before = (s.moe_calls, s.substituted_mass, s.substitutions, s.sync_fetches)
        logits = engine.forward(x[start:end - 1], 0)
        window_stats.append({"moe_calls": s.moe_calls - before[0], "substituted_mass": s.substituted_mass - before[1],
                             "substitutions": s.substitutions - before[2], "sync_fetches": s.sync_fetches - before[3]})
        nll = F.cross_entropy(logits, x[start + 1:end], reduction="none")
        nll_parts.append(nll)
        window_nll.append(nll.mean().item())
        if progress:
            progress(end - 1 - start)
    token_nll = torch.cat(nll_parts).numpy()
    mean = float(token_nll.mean())
    se = float(token_nll.std(ddof=1) / math.sqrt(len(token_nll))) if len(token_nll) > 1 else 0.0
    return PerplexityResult(math.exp(mean), mean, math.exp(mean) * se, len(token_nll), window_nll,
                            window_stats, token_nll, engine.stats.to_dict())
