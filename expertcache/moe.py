"""The MoE layer: route -> decide (policy) -> fetch/admit -> rewrite ids to slots ->
expert compute over slots -> combine.

Tokens are decided in order, so the cache a token sees reflects only the tokens before
it, also when a whole window runs in one call. Compute is deferred and batched; a slot
that a later token's fetch would overwrite first has its pending work computed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .cache import ExpertCache
from .models.args import ModelArgs
from .policies import MissPolicy, Route
from .predictors import Predictor
from .stats import RunStats


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool):
    """x [T, H], router [E, H] -> probs [T, E] (fp32), weights [T, k], ids [T, k]."""
    probs = F.softmax(x @ router.t(), dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return probs, weights, ids


def experts_one_token(x, slots, weights, w13, w2):
    """Decode: one token, k matrix-vector products straight from the slots (no gather copy).
    x [1, H], slots [1, k] (long), weights [1, k] -> [1, H]."""
    xv, ids = x[0], slots[0].tolist()
    g, u = torch.stack([w13[s] @ xv for s in ids]).chunk(2, dim=-1)  # [k, F] each
    act = F.silu(g) * u * weights[0].unsqueeze(-1).to(x.dtype)
    out = w2[ids[0]] @ act[0]
    for j in range(1, len(ids)):
        out.addmv_(w2[ids[j]], act[j])
    return out.unsqueeze(0)


def experts_grouped(x, slots, weights, w13, w2):
    """Large batches: sort assignments by slot and run one matmul pair per used slot."""
    n, k = slots.shape
    flat = slots.reshape(-1).to(x.device)
    order = flat.argsort(stable=True)
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token = order // k
    xs = x[token]
    out_rows, start = [], 0
    for s, c in zip(used.tolist(), counts.tolist()):
        g, u = (xs[start:start + c] @ w13[s].t()).chunk(2, dim=-1)
        out_rows.append((F.silu(g) * u) @ w2[s].t())
        start += c
    y = torch.cat(out_rows) * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def experts_compute(x, slots, weights, w13, w2):
    """slots: a host tensor (the decode path reads it without a device sync)."""
    return experts_one_token(x, slots, weights, w13, w2) if x.shape[0] == 1 else \
        experts_grouped(x, slots, weights, w13, w2)


@dataclass
class LayerPlan:
    slots: np.ndarray  # [T, k] cache slots to run; padded entries have gate 0
    experts: np.ndarray  # [T, k] executed expert ids
    gates: np.ndarray  # [T, k]
    owed_from: int  # tokens [owed_from, T) still need their expert work


def decide_layer(cache: ExpertCache, policy: MissPolicy, stats: RunStats, layer: int, probs_h: np.ndarray,
                 weights_h: np.ndarray, ids_h: np.ndarray, token_base: int,
                 compute: Callable[[int, int, np.ndarray, np.ndarray], None]) -> LayerPlan:
    """Decide one layer's tokens in order: the policy's decision, synchronous fetches, background
    admissions, eviction bookkeeping and statistics. Shared by the engine and the simulator
    (whose cache is virtual and whose `compute` does nothing).

    Expert work is deferred: `compute(begin, end, slots, gates)` is called for tokens
    [begin, end) before a slot they use is overwritten; the work of tokens [plan.owed_from, T)
    is left to the caller, which can first start the next layer's prefetches.
    """
    T, k = ids_h.shape
    slots_h = np.zeros((T, k), dtype=np.int64)
    exec_h = np.zeros((T, k), dtype=np.int64)
    gates_h = np.zeros((T, k), dtype=np.float32)
    owes = np.zeros(cache.num_slots, dtype=bool)  # slots with deferred compute
    seg = 0

    def flush(end: int) -> None:
        nonlocal seg
        if end > seg:
            compute(seg, end, slots_h, gates_h)
            stats.segments += 1
        seg, owes[:] = end, False

    def load(t: int, e: int, kind: str) -> int:
        slot = cache.victim(layer)
        if owes[slot]:  # its old expert still owes work to earlier tokens: do it first
            flush(t)
        cache.start(layer, e, kind, slot)
        return slot

    cache.poll()
    slot_of, fast = cache.slot_of[layer], policy.hits_run_as_routed
    for t in range(T):
        cache.eviction.clock = token_base + t
        if fast:  # every routed expert resident: no decision to make
            slots = slot_of[ids_h[t]]
            if (slots >= 0).all() and not (cache.pending and any(s in cache.pending for s in slots.tolist())):
                stats.moe_calls += 1
                stats.routed += k
                stats.hits += k
                cache.eviction.touch_many(slots)
                slots_h[t], exec_h[t], gates_h[t] = slots, ids_h[t], weights_h[t]
                owes[slots] = True
                continue
        r = Route(layer, ids_h[t], weights_h[t], probs_h[t])
        hits = sum(cache.is_resident(layer, e) for e in r.experts.tolist())
        d = policy.decide(r, cache)
        stats.moe_calls += 1
        stats.routed += k
        stats.hits += hits
        stats.misses += k - hits
        if d.substituted:
            stats.substitutions += d.substituted
            stats.substituted_calls += 1
            stats.substituted_mass += d.substituted_mass
        cache.protected[:] = False
        for e in d.experts:
            if cache.slot_of[layer, e] >= 0:
                cache.protected[cache.slot_of[layer, e]] = True
        for e in d.fetch:
            if cache.slot_of[layer, e] < 0:
                cache.protected[load(t, e, "fetch")] = True
                stats.sync_fetches += 1
                stats.sync_fetch_bytes += cache.fetch_bytes
        for e in d.admit:
            if cache.slot_of[layer, e] < 0:
                load(t, e, "admit")
                stats.background_fetches += 1
                stats.background_bytes += cache.fetch_bytes
        for j, (e, w) in enumerate(zip(d.experts, d.weights)):
            slot = cache.slot_of[layer, e]
            stats.stall_s += cache.wait(slot)  # fetched now, or still arriving from a prefetch
            cache.eviction.touch(slot)
            slots_h[t, j], exec_h[t, j], gates_h[t, j] = slot, e, w
            owes[slot] = True
        for j in range(len(d.experts), k):  # fewer executed than routed: zero-weight padding
            slots_h[t, j], exec_h[t, j], gates_h[t, j] = slots_h[t, 0], exec_h[t, 0], 0.0
    stats.segments += 1  # the caller computes tokens [seg, T)
    return LayerPlan(slots_h, exec_h, gates_h, seg)


@dataclass(frozen=True)
class PrefetchConfig:
    predictor: str = "quasi-hidden"  # router-ahead | quasi-hidden | estimator | hybrid
    mode: str = "prefetch"  # prefetch: the true router decides; speculative: the prediction runs
    budget: int | None = None  # prefetches per token and layer (default: top-k)


class MoELayerRunner:
    """Runs every MoE layer of a model against one cache and one policy; with a predictor,
    requests layer l+1's experts before layer l's experts compute."""

    def __init__(self, args: ModelArgs, cache: ExpertCache, policy: MissPolicy, stats: RunStats):
        self.args, self.cache, self.policy, self.stats = args, cache, policy, stats
        self.token_base = 0  # index in the run of the first token of the current forward
        self.predictor: Predictor | None = None
        self.prefetch = PrefetchConfig()
        self.resid: torch.Tensor | None = None  # residual after the current layer's attention
        self.predicted: tuple | None = None  # (probs, weights, ids) predicted for the next layer

    def observe_residual(self, layer: int, h: torch.Tensor) -> None:
        """The transformer's hook after each layer's attention."""
        self.resid = h

    def _predict_next(self, layer: int, x: torch.Tensor, exec_ids: np.ndarray, gates: np.ndarray) -> None:
        a, cache = self.args, self.cache
        dev = x.device
        logits = self.predictor.logits(layer, self.resid, x, torch.from_numpy(exec_ids).to(dev),
                                       torch.from_numpy(gates).to(dev))
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(a.top_k, dim=-1)
        if a.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        self.predicted = (probs, weights, ids)
        if x.shape[0] != 1:  # prefetching ahead is a decode-time pipeline
            return
        budget = self.prefetch.budget or a.top_k
        for e in ids[0, :budget].tolist():
            if cache.slot_of[layer + 1, e] < 0:
                cache.start(layer + 1, e, "prefetch")
                self.stats.prefetch_fetches += 1
                self.stats.prefetch_bytes += cache.fetch_bytes

    def __call__(self, layer: int, x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed MoE input) -> routed experts' combined output [T, H]."""
        a, cache, stats = self.args, self.cache, self.stats
        if self.prefetch.mode == "speculative" and layer > 0 and self.predicted is not None:
            probs, weights, ids = self.predicted  # the true router is skipped
        else:
            probs, weights, ids = route(x, router, a.top_k, a.norm_topk_prob)
        self.predicted = None
        # The one host sync of the layer: decisions need the routes on the host.
        probs_h, weights_h, ids_h = probs.cpu().numpy(), weights.cpu().numpy(), ids.cpu().numpy()
        T = ids_h.shape[0]
        out = torch.empty_like(x)

        def experts_out(begin: int, end: int, slots_h: np.ndarray, gates_h: np.ndarray) -> torch.Tensor:
            return experts_compute(x[begin:end], torch.from_numpy(slots_h[begin:end]),
                                   torch.from_numpy(gates_h[begin:end]).to(x.device), cache.w13, cache.w2)

        def compute(begin: int, end: int, slots_h: np.ndarray, gates_h: np.ndarray) -> None:
            out[begin:end] = experts_out(begin, end, slots_h, gates_h)

        plan = decide_layer(cache, self.policy, stats, layer, probs_h, weights_h, ids_h, self.token_base, compute)
        if self.predictor is not None and layer + 1 < a.num_layers:
            self._predict_next(layer, x, plan.experts, plan.gates)  # this token's slots stay protected
        cache.protected[:] = False
        if T == 1:  # decode: nothing was computed early, no need to go through `out`
            return experts_out(0, 1, plan.slots, plan.gates)
        compute(plan.owed_from, T, plan.slots, plan.gates)
        return out
