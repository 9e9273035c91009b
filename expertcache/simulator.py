"""Replay miss policies on a router-logit trace (instrument 2).

The replay runs the engine's own decision loop (`moe.decide_layer`) on a virtual cache:
the same policies, eviction orders and statistics, without weights or transfers. Routing
never diverges in a replay: after a substitution the engine's later routing changes (the
hidden state differs), the trace's does not. With fetch-every-miss the counts equal the
engine's exactly on the same text and windows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import CacheConfig, ExpertCache
from .moe import decide_layer
from .policies import make_policy
from .stats import RunStats
from .stores import ExpertShape
from .trace import Trace


@dataclass
class Replay:
    policy: str
    cache_fraction: float
    stats: RunStats
    seconds: float  # wall time of the replay itself
    events: int  # (token, layer, selected expert) events replayed
    extra: dict = field(default_factory=dict)

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def _route(logits: np.ndarray, top_k: int, norm: bool):
    """logits [T, E] -> probs [T, E], weights [T, k], ids [T, k], as moe.route does in fp32."""
    probs = torch.softmax(torch.from_numpy(np.array(logits, dtype=np.float32)), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return probs.numpy(), w.numpy(), ids.numpy()


def replay(trace: Trace, policy: str, cache: CacheConfig = CacheConfig(), eviction: str | None = None,
           counts: np.ndarray | None = None, fetch_dtype_bytes: int = 2) -> Replay:
    """Replay `policy` over the trace's windows in order; `counts` [L, E] gives a warm start."""
    h = trace.header
    L, E, k = h["num_layers"], h["num_experts"], h["top_k"]
    hidden, numel = h["hidden_size"], h["expert_params"]
    shape = ExpertShape(L, E, (2 * (numel // (3 * hidden)), hidden), (hidden, numel // (3 * hidden)))
    pol = make_policy(policy)
    cfg = CacheConfig(fraction=cache.fraction, bytes=cache.bytes, quota=cache.quota,
                      eviction=eviction or pol.eviction)
    vc = ExpertCache(cfg, None, k, None, torch.float32, shape=shape, fetch_bytes=numel * fetch_dtype_bytes)
    if counts is not None:
        vc.warm(counts)
    stats = RunStats()
    nothing = lambda *a: None  # noqa: E731
    context, N = h["context"], trace.num_tokens
    start = time.perf_counter()
    for w0 in range(0, N, context):
        window = np.asarray(trace.logits[w0:w0 + context])
        for layer in range(L):
            probs, weights, ids = _route(window[:, layer], k, h["norm_topk_prob"])
            decide_layer(vc, pol, stats, layer, probs, weights, ids, w0, nothing)
        stats.tokens += len(window)
    seconds = time.perf_counter() - start
    return Replay(policy, cache.fraction, stats, seconds, N * L * k)

