"""Replay miss policies on a router-logit trace (instrument 2).

The replay runs the engine's own decision kernel (`decisions.decide_token`) on a virtual
cache: the same policies, eviction orders and counters, without weights or transfers. A
trace is routed once (`route_trace`: top-k, gate weights and a ranked prefix of each row,
with the engine's routing code); each policy then replays in one compiled call. A window
decides as decoding would: what is admitted for token t is resident from token t + 1, as
in the engine, and every transfer has landed by the next layer call. Routing never
diverges in a replay: after a substitution the engine's later routing changes (the hidden
state differs), the trace's does not. With fetch-every-miss the
counts equal the engine's exactly on the same text and windows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..engine.cache import CacheConfig, ExpertCache
from ..engine.quant import SMALL_FORMAT, ExpertFormat, encoded_bytes
from ..engine.stats import RunStats
from ..engine.stores import ExpertShape
from ..errors import BadInput
from ..kernel.cache_state import LOGGING, CacheState
from ..kernel.policy import Scratch
from ..kernel.replay import replay_window, route_all, route_all_biased, route_all_selection
from ..kernel.routing import HALF_TO_FLOAT, Router
from ..policies import eviction_order, make_policy
from .trace import Trace, header_problem


@dataclass
class Replay:
    """One policy's replay of a trace: its counters and how fast the replay ran."""
    policy: str
    cache_fraction: float
    stats: RunStats
    seconds: float  # wall time of the replay itself
    events: int  # (token, layer, selected expert) events replayed
    extra: dict = field(default_factory=dict)

    @property
    def events_per_second(self) -> float:
        """Replayed (token, layer, selected expert) events per second of wall time."""
        return self.events / self.seconds if self.seconds else 0.0


@dataclass
class Routes:
    """A trace's routing, computed once and shared by every replay of the trace."""
    ranked: np.ndarray  # [L, N, R] the R >= k best experts in rank order, the first k routed
    weights: np.ndarray  # [L, N, k] float32 gate weights (layer-major: the replay's order)
    seconds: float  # time it took


def logit_rows(trace: Trace) -> tuple[np.ndarray, np.ndarray | None]:
    """The trace's logits as the kernel reads them: float16 as bit patterns with their table."""
    logits = np.asarray(trace.logits)
    if logits.dtype == np.float16:
        return logits.view(np.uint16), HALF_TO_FLOAT
    # float32 as it is; any other dtype (a caller's float64 array) as float32: the compiled routing read float64
    # rows into other routes than the same logits' in float32, and the replay counted those
    return np.asarray(logits, np.float32), None


def check_trace(trace: Trace) -> tuple[int, int, int]:
    """(L, E, k) of a trace whose logits [N, L, E] fit its header, 1 <= k <= E; BadInput
    otherwise (the compiled routing and replay check no bounds)."""
    h = trace.header
    if (problem := header_problem(h)) is not None:
        raise BadInput(f"the trace header {problem}; record the trace again with `expertcache trace`")
    L, E, k = h["num_layers"], h["num_experts"], h["top_k"]
    shape = np.shape(trace.logits)
    if len(shape) != 3 or shape[1:] != (L, E) or not 1 <= k <= E:
        raise BadInput(f"trace logits of shape {shape} do not fit its header ({L} layers, {E} experts, "
                       f"top-k {k}); record the trace again with `expertcache trace`")
    return L, E, k


def trace_router(trace: Trace) -> Router:
    """The Router a trace's header records, checked against its shape (the compiled loops check no bounds)."""
    h = trace.header
    L, E, _ = check_trace(trace)
    router = Router.from_header(h)
    if router.bias is not None and router.bias.shape != (L, E):
        raise BadInput(f"the trace's router bias of shape {router.bias.shape} does not fit its {L} layers x {E} "
                       "experts; record the trace again with `expertcache trace`")
    if router.selects and not (1 <= router.topk_group <= router.n_group and E % router.n_group == 0):
        raise BadInput(f"the trace's router groups (n_group={router.n_group}, topk_group={router.topk_group}) do not "
                       f"fit its {E} experts; record the trace again with `expertcache trace`")
    return router


def check_finite(trace: Trace, chunk: int = 2**24) -> None:
    """BadInput naming the first router logit of the trace that is NaN or infinite (a corrupt file: the exact
    model's router gives none), read `chunk` logits at a time: the compiled routing ranks such a row into
    whatever order its comparisons give, and the replay printed counts of routes no model made."""
    logits = trace.logits
    step = max(1, chunk // max(1, int(np.prod(np.shape(logits)[1:]))))
    for t0 in range(0, len(logits), step):
        bad = ~np.isfinite(np.asarray(logits[t0:t0 + step]))
        if bad.any():
            t, layer, e = (int(i) for i in np.argwhere(bad)[0])
            value = logits[t0 + t, layer, e]
            raise BadInput(f"{trace.path or 'the trace'}: router logit {value} of token {t0 + t}, MoE layer {layer}, "
                           f"expert {e} is not finite (a corrupt trace); record it again with `expertcache trace`")


def route_trace(trace: Trace, ranks: int = 32) -> Routes:
    """Route every token at every layer, ranking `ranks` experts (at least the top-k): the
    ranks past the top-k are where substitutes and cache-conditional choices come from."""
    L, E, k = check_trace(trace)
    check_finite(trace)
    logits, table = logit_rows(trace)
    N = logits.shape[0]
    R = min(E, max(ranks, k))
    ranked = np.empty((L, N, R), np.int16 if E < 2**15 else np.int32)
    weights = np.empty((L, N, k), np.float32)
    router = trace_router(trace)
    start = time.perf_counter()
    work = (np.empty(R), np.empty(E, np.int64), np.empty(E // 16 + 1, np.int64))
    if router.selects:
        route_all_selection(logits, table, router.norm_topk, ranked, weights, *work, router.bias_table(L, E),
                            router.n_group, router.topk_group, router.scoring, np.empty(E, np.float32),
                            np.empty(E, np.float32), np.empty(router.n_group, np.float32))
    elif router.logit_bias:
        route_all_biased(logits, table, router.norm_topk, ranked, weights, *work, router.bias_table(L, E),
                         np.empty(E, np.float32))
    else:
        route_all(logits, table, router.norm_topk, ranked, weights, *work)
    return Routes(ranked, weights, time.perf_counter() - start)


def trace_shape(header: dict) -> ExpertShape:
    """The expert shape a trace's header records (its layers, experts, hidden size and parameters an expert)."""
    hidden, numel = header["hidden_size"], header["expert_params"]
    F = numel // (3 * hidden)
    return ExpertShape(header["num_layers"], header["num_experts"], (2 * F, hidden), (hidden, F))


def replay(trace: Trace, policy: str, cache: CacheConfig = CacheConfig(), eviction: str | None = None,
           counts: np.ndarray | None = None, fetch_dtype_bytes: int = 2, routes: Routes | None = None,
           window: int | None = None, small_format: ExpertFormat = SMALL_FORMAT,
           slot_format: ExpertFormat | None = None,
           predictions: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> Replay:
    """Replay `policy` over the trace in windows of `window` tokens (default: the trace's
    context, as `ppl` runs; 1: decode order); `counts` [L, E] gives a warm start; `routes`
    (route_trace) saves routing the trace again. A fetch moves the expert at `fetch_dtype_bytes`
    per parameter, one of a low-precision copy its bytes in `small_format` (unaligned).
    `slot_format`: the fast tier's, which sizes a cache given in bytes as the engine does (default:
    float slots of `fetch_dtype_bytes`); quantized slots fetch their encoded blobs.
    A policy with '+prefetch/PREDICTOR[:budget=N,fetched=1,confidence=W]' prefetches in decode order what `predictions`
    (`lab.prediction.prediction_routes` over the trace's tokens) gives for its predictor, as the engine does;
    every token's predictions are counted (the engine makes them in windows too, without prefetching)."""
    from .bench import parse_variant
    h = trace.header
    L, E, k = check_trace(trace)
    N = np.shape(trace.logits)[0]
    spec, (policy, pre) = policy, parse_variant(policy)
    if pre is not None and pre.mode != "prefetch":
        raise BadInput(f"the replay cannot run {pre.mode} execution (its routing would leave the trace's); "
                       "replay '+prefetch/...' or time it with `expertcache bench`")
    if pre is not None and (predictions is None or pre.predictor not in predictions):
        raise BadInput(f"replaying '+prefetch/{pre.predictor}' needs that predictor's predictions over the trace's "
                       "tokens, which simulate does not make; `expertcache tune` replays prefetching, and `bench` "
                       "times it")
    budget = 0 if pre is None else pre.budget or k
    if not 0 <= budget <= k:
        raise BadInput(f"prefetch budget {budget} is beyond the {k} experts a prediction ranks; give budget=1..{k}")
    pred_ids, pred_w = (np.full((1, 1, 1), -1, np.int64), np.zeros((1, 1, 1), np.float32)) if pre is None \
        else predictions[pre.predictor]
    if pre is not None and (pred_ids.shape != (L, N, k) or pred_w.shape != (L, N, k)
                            or pred_ids[1:].min(initial=0) < 0 or pred_ids.max(initial=0) >= E):
        raise BadInput(f"predicted routes of shape {pred_ids.shape} do not fit the trace ({L} layers, {N} tokens, "
                       f"{E} experts, top-k {k}); compute them over the trace's own tokens")
    shape, numel = trace_shape(h), h["expert_params"]
    pol = make_policy(policy).fit(k, E, bool(h["norm_topk_prob"]))
    window = int(window or h["context"])
    if window < 1:
        raise BadInput(f"window {window} must be at least 1 token; e.g. --window 1 (decode order)")
    if counts is not None and np.shape(counts) != (L, E):
        raise BadInput(f"routing counts of shape {np.shape(counts)} do not fit the trace's {L} layers x {E} experts; "
                       "run `expertcache calibrate --model MODEL` on the trace's model")
    if routes is not None:
        R = routes.ranked.shape[-1]
        if routes.ranked.shape[:2] != (L, N) or not k <= R <= E or routes.weights.shape != (L, N, k) \
                or routes.ranked.min() < 0 or routes.ranked.max() >= E:
            raise BadInput(f"routes of shape {routes.ranked.shape} do not fit the trace ({L} layers, {N} tokens, "
                           f"{E} experts, top-k {k}); pass route_trace(trace) of this trace")
    cfg = CacheConfig(fraction=cache.fraction, bytes=cache.bytes, quota=cache.quota,
                      eviction=eviction_order(pol, eviction, cache.eviction))
    slots = slot_format or ExpertFormat.parse("fp16" if fetch_dtype_bytes == 2 else "fp32")
    fetch_bytes = encoded_bytes(shape.parts, slots) if slots.quantized else numel * fetch_dtype_bytes
    vc = ExpertCache(cfg, None, k, None, slots, shape=shape, fetch_bytes=fetch_bytes,
                     lowbit_bytes=encoded_bytes(shape.parts, small_format))
    if counts is not None:
        vc.warm(counts)
    st = vc.state
    st.misc[LOGGING] = 0  # nothing carries actions out
    routes = routes or route_trace(trace)
    router = trace_router(trace)
    params, account, scratch = pol.params(), pol.bind(L, E), Scratch.make(k, E)
    work = (np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.float32), router.selects,
            router.scoring, router.logit_bias,
            router.bias_table(L, E), router.n_group, router.topk_group, np.empty(E, np.float32),
            np.empty(router.n_group, np.float32), pred_ids, pred_w, budget, bool(pre and pre.fetched),
            float(pre.confidence if pre else 0.0), np.empty(k, np.int64))
    # the first call in a process loads the compiled replay from its cache, ~0.1 s that halved the first policy's
    # events/s: one token is replayed first, untimed, on copies of the state
    replay_window(CacheState(*(a.copy() for a in st)), params, account.copy(), Scratch.make(k, E),
                  np.asarray(trace.logits[:1]).astype(np.float32), 0, routes.ranked, routes.weights, *work)
    start = time.perf_counter()
    failed = -1
    for w0 in range(0, N, window):  # a window's logits widened to float32 (exact), a copy the kernel may read
        rows = np.asarray(trace.logits[w0:w0 + window]).astype(np.float32)
        failed = replay_window(st, params, account, scratch, rows, w0, routes.ranked, routes.weights, *work)
        if failed >= 0:
            break
    seconds = time.perf_counter() - start
    if failed >= 0:
        raise vc.too_small(failed)
    stats = RunStats(tokens=trace.num_tokens, predictions=0 if pre is None else trace.num_tokens * (L - 1))
    stats.absorb(st, vc.fetch_bytes, vc.lowbit_bytes)
    fraction = cache.fraction if cache.fraction is not None else vc.per_layer / E  # the default's size
    return Replay(spec, fraction, stats, seconds, trace.num_tokens * L * k)
