"""The MoE layer: route -> decide (policy) -> fetch/admit -> rewrite ids to slots ->
expert compute over slots -> combine.

Tokens are decided in order, so the cache a token sees reflects only the tokens before
it, also when a whole window runs in one call. Compute is deferred and batched; a slot
that a later token's fetch would overwrite first has its pending work computed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..choices import PREDICTORS
from ..errors import BadInput, UnknownName, did_you_mean, real_number, whole_number
from ..kernel.cache_state import (EXPOSED_PREFETCHES, HITS, MISSES, MOE_CALLS, N_LOG, PREFETCHES, ROUTED,
                                 SYNC_FETCHES)
from ..kernel.dense_decode import EMPTY, gemv, gemv_pair
from ..kernel.policy import would_fetch
from ..kernel.routing import Router, Routing
from ..models.args import ModelArgs
from ..policies import MissPolicy
from .cache import ExpertCache
from .experts import KERNEL_VIEWS, CompiledExperts, ExpertKind, experts_compute, kernel_view
from .quant import decode_plan
from .stats import RunStats

if TYPE_CHECKING:  # predictors route with router_logits below
    from .predictors import Predictor

# a window's flush of one slot runs up to this many tokens through decode's compiled kernel, one call each
# (~20 us here); more go through the window's compiled call (~55 us, then ~2 us a token). The decision
# kernel counts every flush's entries at a per-entry cost (decisions._flush), which this path is: a lower
# bound would need that count to follow it
FLUSH_ROWS = 16


def router_logits(x: torch.Tensor, weight: torch.Tensor, router: Router) -> torch.Tensor:
    """x [T, H], the router's weight [E, H] -> logits [T, E] float32, without the router's bias
    (`router.route` adds it); a selection router's computed in float32, as HF does."""
    assert x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1], \
        f"x must be [T, H] and the router's weight [E, H], got {tuple(x.shape)} and {tuple(weight.shape)}"
    if router.selects or x.dtype != weight.dtype:  # a 16-bit weight under fp32 activations: widened exactly
        return x.float() @ weight.float().t()
    return (x @ weight.t()).float()


def decode_router_logits(x: torch.Tensor, weight: torch.Tensor, ahead: torch.Tensor | None = None
                         ) -> np.ndarray | None:
    """One decode token's router logits [1, E] as one compiled product, no torch op, where x [1, H] is
    fp32 on the CPU and the router's weight [E, H] fp32, fp16 or bf16 there; None otherwise. With `ahead`
    (the next layer's router weight, the same kind), [2, E]: its logits on the same x too, in the same call."""
    weights = (weight,) if ahead is None else (weight, ahead)
    if x.shape[0] != 1 or x.device.type != "cpu" or x.dtype != torch.float32 or \
            any(w.dtype not in KERNEL_VIEWS for w in weights):
        return None
    logits = np.empty((len(weights), weight.shape[0]), np.float32)
    if ahead is None:
        gemv(kernel_view(weight), x.numpy()[0], EMPTY, logits[0])
    else:
        gemv_pair(kernel_view(weight), kernel_view(ahead), x.numpy()[0], logits[0], logits[1])
    return logits


def route(x: torch.Tensor, weight: torch.Tensor, router: Router, layer: int) -> Routing:
    """x [T, H], the router's weight [E, H] at MoE layer `layer` -> its Routing, on the host."""
    logits = decode_router_logits(x, weight)
    if logits is None:
        logits = router_logits(x, weight, router).cpu().numpy()
    return router.route(logits, layer)


@dataclass
class LayerPlan:
    """One layer call's decided work: which slot, expert and gate each token's k entries run with."""
    slots: np.ndarray  # [T, k] cache slots to run; padded entries have gate 0
    experts: np.ndarray  # [T, k] executed expert ids
    gates: np.ndarray  # [T, k]


def decide_layer(cache: ExpertCache, policy: MissPolicy, stats: RunStats, layer: int, routing: Routing,
                 token_base: int, flush: Callable[[int, int, np.ndarray, np.ndarray], None],
                 started: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 landed: Callable[[set[int], np.ndarray, np.ndarray], None] | None = None) -> LayerPlan:
    """Decide one layer's tokens in order (the compiled decision kernel, shared with the
    simulator) and carry out its actions: transfers, waits, and expert work that must run
    before a slot it uses is overwritten (`flush(slot, end, slots, gates)`: the slot's entries
    among tokens [0, end)). `started(experts, gates)` (the decided [T, k] arrays) runs as soon as
    the layer's transfers are under way, before any wait: the next layer's prefetches then
    overlap this layer's fetches as well as its compute. `landed(later, slots, gates)` runs after it and
    after each wait (ExpertCache.carry_out). The work that no flush ran is left to
    the caller. The kernel's counters stay in the cache state until the caller absorbs them
    into `stats` (the engine does, once per forward)."""
    T, k = routing.ids.shape
    slots_h = np.empty((T, k), dtype=np.int64)  # the kernel writes every entry
    exec_h = np.empty((T, k), dtype=np.int64)
    gates_h = np.empty((T, k), dtype=np.float32)
    if cache.pending:
        cache.poll()
    cache.decide_routed(policy, layer, routing, token_base, slots_h, exec_h, gates_h)
    begun = None if started is None else (lambda: started(exec_h, gates_h))
    if cache.state.misc[N_LOG]:
        stats.stall_s += cache.carry_out(lambda slot, end: flush(slot, end, slots_h, gates_h), begun,
                                         None if landed is None else
                                         lambda later: landed(later, slots_h, gates_h))
    elif begun is not None:
        begun()
    return LayerPlan(slots_h, exec_h, gates_h)


class LandingExperts:
    """A decode token's experts, or each token's of a decode batch, run as they become resident
    (CompiledExperts.some): those already resident while the reads are in flight, each read one once its wait
    returns, so that their compute hides under the reads still to land rather than following the last one.
    Each token's sum is its one call's, bit for bit."""

    def __init__(self, compiled: CompiledExperts, x: torch.Tensor, cache: ExpertCache, k: int):
        self.compiled, self.x, self.cache = compiled, x, cache
        self.done = np.zeros((x.shape[0], k), np.bool_)  # whether token t's expert j of the plan has run
        self.stopped = False  # a flush ran experts the caller's way: the call's output is not this one's

    @property
    def ran(self) -> bool:
        """Whether any expert has run."""
        return bool(self.done.any())

    def landed(self, later: set[int], slots_h: np.ndarray, gates_h: np.ndarray) -> None:
        """ExpertCache.carry_out's hook: run the plan's experts whose slots hold them now (not in flight, and no
        load of the call still to start on them)."""
        if self.stopped:
            return
        blocked = np.fromiter(self.cache.pending.keys() | later, np.int64)
        ready = ~self.done & ~np.isin(slots_h, blocked)
        for t in np.flatnonzero(ready.any(1)):
            which = np.flatnonzero(ready[t])
            self.compiled.some(self.x[t:t + 1], slots_h[t], gates_h[t], which, not self.done[t].any(), int(t))
            self.done[t, which] = True

    def total(self, slots_h: np.ndarray, gates_h: np.ndarray) -> torch.Tensor:
        """The tokens' outputs [T, H]: the experts not run yet, then each token's sum."""
        rows = []
        for t, (slots, gates, done) in enumerate(zip(slots_h, gates_h, self.done)):
            if not done.all():
                self.compiled.some(self.x[t:t + 1], slots, gates, np.flatnonzero(~done), not done.any(), t)
            rows.append(self.compiled.total(slots, gates, t))
        return torch.cat(rows)


def check_predictor(name: object) -> None:
    """UnknownName unless `name` is one of the predictors (PREDICTORS)."""
    if name not in PREDICTORS:
        raise UnknownName(f"unknown predictor {name!r}{did_you_mean(name, PREDICTORS)}; choose one of "
                          f"{', '.join(PREDICTORS)}")


@dataclass(frozen=True)
class PrefetchConfig:
    """How the next layer's experts are predicted and what the prediction does."""
    predictor: str = "quasi-hidden"  # router-ahead | quasi-hidden | estimator | hybrid
    mode: str = "prefetch"  # prefetch: the true router decides; speculative: the prediction runs
    budget: int | None = None  # prefetches per token and layer (default: top-k)
    drop: bool = True  # drop queued prefetches that the layer's routes turn out not to need, unread
    fetched: bool = False  # only the predicted experts the policy would fetch were they misses (by rank and weight)
    confidence: float = 0.0  # only the predicted experts of at least this predicted gate weight (the sure ones)

    def __post_init__(self):
        check_predictor(self.predictor)
        if self.mode not in ("prefetch", "speculative"):
            raise UnknownName(f"unknown prefetch mode {self.mode!r}; choose prefetch or speculative")
        # the compiled prefetch takes them as they are (a string failed there mid-decode, NaN prefetched nothing);
        # the budget's range against the model's top-k in Engine.set_prefetch
        if self.budget is not None:
            whole_number(self.budget, "prefetch budget")
        for name in ("drop", "fetched"):  # "no" would read as true, and fail where the variant is named
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"prefetch {name}={getattr(self, name)!r} must be True or False")
        if not 0 <= real_number(self.confidence, "prefetch confidence") <= 1:
            raise BadInput(f"prefetch confidence={self.confidence} must be a gate weight in [0, 1], e.g. 0.1")

    def __str__(self) -> str:
        """As a policy spec writes it after its '+': mode/predictor, then the options that are not the defaults."""
        default = PrefetchConfig()
        keys = ("budget", "drop", "fetched", "confidence")
        options = [f"{k}={int(v) if isinstance(v, bool) else f'{v:g}'}"
                   for k in keys if (v := getattr(self, k)) != getattr(default, k)]
        return f"{self.mode}/{self.predictor}" + (":" + ",".join(options) if options else "")


class MoELayerRunner:
    """Runs every MoE layer of a model against one cache and one policy; with a predictor,
    requests layer l+1's experts before layer l's experts compute."""

    def __init__(self, args: ModelArgs, router: Router, cache: ExpertCache, policy: MissPolicy, stats: RunStats):
        self.args, self.router, self.cache, self.policy, self.stats = args, router, cache, policy, stats
        self.kind = ExpertKind.of(args)
        self.token_base = 0  # index in the run of the first token of the current forward
        self.decoding = False  # the current forward is a decode batch: one token of each of several sequences
        # the current forward is a prompt whose MoE layers run expert by expert (run_by_expert); `exact`: the
        # fetch-all policy that brings their missing experts in
        self.by_expert = False
        self.exact: MissPolicy | None = None
        self.predictor: Predictor | None = None
        self.prefetch = PrefetchConfig()
        self.resid: torch.Tensor | None = None  # residual after the current layer's attention
        self.predicted: Routing | None = None  # predicted for the next layer
        # per MoE layer, the routed ids and weights of the last token of the sequence last run, which a predictor
        # takes for the next token's `prev`; `follows`: the current forward is one token continuing that sequence
        self.previous: list[tuple[np.ndarray, np.ndarray] | None] = [None] * args.num_moe_layers
        self.follows = False
        self.sequence: tuple[int, int] | None = None  # (sequence, next position) the routes in `previous` lead to
        # a decode token of large experts runs each one as soon as it is resident, while its other reads land
        # (LandingExperts); False: all of them in one call after its last wait (benchmarks compare the two)
        self.as_landed = True
        self.compiled = None  # the compiled expert calls over CPU slots, float or quantized
        if CompiledExperts.applies(cache.w13):
            self.compiled = CompiledExperts.of_floats(cache.w13, cache.w2, cache.b13, cache.b2, self.kind)
        elif cache.blobs is not None:
            plan = decode_plan(cache.shape.parts, cache.format)
            self.compiled = CompiledExperts.of_blobs(cache.blobs, plan, self.kind)

    def observe_residual(self, layer: int, h: torch.Tensor) -> None:
        """The transformer's hook after each layer's attention."""
        self.resid = h

    def start_forward(self, sequence: int | None, pos: int, tokens: int) -> None:
        """A forward of `tokens` tokens of `sequence` (an id of its keys and values; None: several sequences, a
        decode batch) from position `pos`: a single token that continues the sequence last run takes that
        sequence's last routes as `prev`."""
        self.follows = tokens == 1 and sequence is not None and self.sequence == (sequence, pos)
        self.sequence = None

    def end_forward(self, sequence: int | None, pos: int) -> None:
        """The forward started by `start_forward` has run; its sequence's next token is at `pos`."""
        self.sequence = None if sequence is None else (sequence, pos)

    def _run_by_expert(self, layer: int, routing: Routing, add: Callable) -> None:
        """A prompt's MoE layer expert by expert: the resident experts run on their tokens, then the missing ones
        are fetched k at a time (under the fetch-all policy `exact`) and each runs on all its tokens at once. Every
        missing expert is read once a call, where deciding the tokens in order reads one again each time it was
        evicted since: with a quarter of the experts cached, a prompt was read at decode's pace. Every routed
        expert runs at full precision, whatever the decode policy (the prompt is exact); the tokens' hits and
        misses count as routed. `add(tokens, slots, gates)` adds those entries' expert outputs."""
        cache, stats = self.cache, self.stats
        ids, weights = routing.ids, routing.weights
        T, k = ids.shape
        stats.stall_s += cache.finish_all()  # transfers in flight land: a mapped slot is then a resident expert
        before = cache.state.counts.copy()
        held_in = cache.slot_of[layer][ids]  # [T, k] each route's slot, -1 where its expert is missing
        resident = held_in >= 0
        t, j = np.nonzero(resident)
        if len(t):
            add(t, held_in[t, j], weights[t, j])
        missing = np.unique(ids[~resident])
        groups = [missing[g0:g0 + k] for g0 in range(0, len(missing), k)]
        # the next group's reads run under this group's compute, where the slots hold both
        ahead = cache.usable >= 2 * k
        rows, clock = np.zeros((1, cache.shape.num_experts), np.float32), self.token_base + T - 1
        for i, group in enumerate(groups):
            row = group
            if len(row) < k:  # the last group: the row is filled with resident experts, at gate 0
                held = np.setdiff1d(np.flatnonzero(cache.slot_of[layer] >= 0), row)
                row = np.concatenate([row, held[:k - len(row)]])
            gates = np.zeros((1, k), np.float32)
            gates[0, :len(group)] = 1.0 / k
            decide_layer(cache, self.exact, stats, layer, Routing(rows, rows, gates, row[None].astype(np.int64)),
                         clock, lambda *_: None)  # one row: no slot of its changes hands
            if ahead and i + 1 < len(groups):
                stats.stall_s += cache.prefetch_routed(layer, groups[i + 1], clock, hold=group)
            t, j = np.nonzero(np.isin(ids, group))
            add(t, cache.slot_of[layer][ids[t, j]], weights[t, j])
        counts = cache.state.counts  # the tokens' routes as the layer's, not the rows of experts fetched
        made = counts - before
        hits = int(resident.sum())
        # the reads a group started under the one before's compute are the prompt's fetches, not predictions
        for index, n in ((MOE_CALLS, T), (ROUTED, T * k), (HITS, hits), (MISSES, T * k - hits),
                         (SYNC_FETCHES, made[SYNC_FETCHES] + made[PREFETCHES]), (PREFETCHES, 0),
                         (EXPOSED_PREFETCHES, 0)):
            counts[index] += n - made[index]

    def _predict_next(self, layer: int, x: torch.Tensor, exec_ids: np.ndarray, gates: np.ndarray) -> None:
        a, cache = self.args, self.cache
        prev = self.previous[layer + 1] if self.follows else None
        start = time.perf_counter()
        logits = self.predictor.decode_logits(layer, self.resid, x, exec_ids[0], gates[0], prev) \
            if x.shape[0] == 1 else None
        if logits is not None and not self.router.selects and self.router.bias is None:
            self.stats.predict_s += time.perf_counter() - start
            # a decode token: routing, the policy's filter and the prefetch in one compiled call
            ids, w, stall = cache.prefetch_predicted(self.policy.params(), layer + 1, logits[0], self.router.norm_topk,
                                                     self.prefetch.budget or a.top_k, self.prefetch.fetched,
                                                     self.prefetch.confidence,
                                                     self.token_base)
            self.predicted = Routing(logits, logits, w[None], ids[None])
            self.stats.predictions += 1
            self.stats.stall_s += stall
            return
        if logits is None:
            ids, weights = torch.from_numpy(exec_ids), torch.from_numpy(gates)
            if x.device.type != "cpu":
                ids, weights = ids.to(x.device), weights.to(x.device)
            if prev is not None:
                prev = tuple(torch.from_numpy(p[None]).to(x.device) for p in prev)
            logits = self.predictor.logits(layer, self.resid, x, ids, weights, prev)
            want = (x.shape[0], a.num_experts)
            assert logits.shape == want, \
                f"{self.predictor.name} gave logits {tuple(logits.shape)}, expected [T, E] = {want}"
            logits = logits.float().cpu().numpy()
        self.stats.predict_s += time.perf_counter() - start
        self.predicted = self.router.route(logits, layer + 1)
        self.stats.predictions += x.shape[0]
        if x.shape[0] != 1 and not self.decoding:  # prefetching ahead is a decode-time pipeline
            return
        budget = self.prefetch.budget or a.top_k
        if x.shape[0] == 1:  # a decode token: the compiled path's filter and prefetch
            self.stats.stall_s += cache.prefetch_ranked(
                self.policy.params(), layer + 1, np.ascontiguousarray(self.predicted.ids[0], np.int64),
                np.ascontiguousarray(self.predicted.weights[0], np.float32), budget, self.prefetch.fetched,
                self.prefetch.confidence, self.token_base)
            return
        # a decode batch: the `budget` experts most of its tokens predict (ties: best rank)
        wanted = self.predicted.ids[:, :budget]
        keep = None
        if self.prefetch.fetched:  # what the policy would substitute is not worth a read
            keep, p = np.empty(wanted.shape, np.bool_), self.policy.params()
            for t in range(wanted.shape[0]):
                would_fetch(p, layer + 1, self.predicted.weights[t, :budget], keep[t])
        if self.prefetch.confidence:  # a prediction of a small weight is often wrong: not worth a read
            sure = self.predicted.weights[:, :budget] >= self.prefetch.confidence
            keep = sure if keep is None else keep & sure
        experts, first, counts = np.unique(wanted.T.ravel() if keep is None else wanted.T[keep.T],
                                           return_index=True, return_counts=True)
        chosen = experts[np.lexsort((first, -counts))][:budget]
        hold = chosen  # the predictions that stay resident while these load
        chosen = chosen[cache.slot_of[layer + 1, chosen] < 0]  # most predictions are resident: nothing to start
        if chosen.size:
            self.stats.stall_s += cache.prefetch_routed(layer + 1, chosen, self.token_base, hold)

    def __call__(self, layer: int, x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed MoE input) of MoE layer `layer` -> routed experts' combined output
        [T, H] (times the routed scaling factor)."""
        a, cache, stats = self.args, self.cache, self.stats
        ahead = self.predictor is not None and layer + 1 < a.num_moe_layers
        if self.prefetch.mode == "speculative" and layer > 0 and self.predicted is not None:
            routing = self.predicted  # the true router is skipped
        else:  # the one host sync of the layer: decisions need the routes on the host (a predictor may route)
            routing = self.predictor.route(layer, x, router, self.router) if ahead else None
            if routing is None:
                routing = route(x, router, self.router, layer)
        self.predicted = None
        T = routing.ids.shape[0]
        if self.predictor is not None:  # the next token's `prev` (start_forward decides whether it applies)
            self.previous[layer] = (routing.ids[-1].copy(), routing.weights[-1].astype(np.float32))
        if self.prefetch.drop and self.predictor is not None and cache.pending and cache.transfers.queues_prefetches():
            stats.prefetch_dropped += cache.drop_prefetches(layer, routing.ids)
        # decode computes once, after its decisions; a window adds up the parts that flushes run before
        # slots change hands, and the rest at the end
        out = None
        # the compiled expert calls run (fp32 on the CPU): a decode token's, one per token of a decode batch
        # (which shares few experts between its tokens), and a window's, one over all its slots (float or
        # quantized) where PyTorch takes ~10 operations per expert
        compiled = self.compiled is not None and x.dtype == torch.float32
        per_token = self.decoding and compiled

        def experts_out(xs: torch.Tensor, slots_h: np.ndarray, gates_h: np.ndarray) -> torch.Tensor:
            if per_token:
                return torch.cat([self.compiled(xs[t:t + 1], slots_h[t], gates_h[t]) for t in range(len(xs))])
            if compiled:
                return self.compiled.window(xs, slots_h, gates_h)
            gates = torch.from_numpy(gates_h)
            return experts_compute(xs, torch.from_numpy(slots_h), gates if xs.device.type == "cpu" else
                                   gates.to(xs.device), cache.w13, cache.w2, cache.b13, cache.b2, self.kind)

        def add(tokens, slots, gates) -> None:
            """out[t] += g * expert_s(x[t]) for each entry (t, s, g) of the three sequences: a plan of width one,
            grouped by slot."""
            index = torch.as_tensor(np.asarray(tokens, np.int64), device=x.device)
            out.index_add_(0, index, experts_out(x[index], np.asarray(slots, np.int64)[:, None],
                                                 np.asarray(gates, np.float32)[:, None]))

        def decode_out(slots_h: np.ndarray, gates_h: np.ndarray) -> torch.Tensor:
            if compiled:
                return self.compiled(x, slots_h[0], gates_h[0])
            return experts_out(x, slots_h, gates_h)

        by_slot: dict[int, list] = {}  # windows, from the first flush: each slot's entries (token, gate) not yet run

        def flush(slot: int, end: int, slots_h: np.ndarray, gates_h: np.ndarray) -> None:
            """`slot` is about to be overwritten: its entries among tokens [0, end) run now (decode: the
            whole token, once, before an upgrade overwrites a slot it uses)."""
            nonlocal out
            if landing is not None:
                landing.stopped = True
            if T == 1:
                if out is None:
                    out = decode_out(slots_h, gates_h)
                return
            if not by_slot:  # the first flush of the call: the plan is complete
                out = torch.zeros_like(x)
                for t, (row, gates) in enumerate(zip(slots_h.tolist(), gates_h.tolist())):
                    for s, g in zip(row, gates):
                        if g != 0:  # padding has gate 0
                            by_slot.setdefault(s, []).append((t, g))
            entries, n = by_slot.get(slot, []), 0
            while n < len(entries) and entries[n][0] < end:
                n += 1
            if not n:
                return
            run, by_slot[slot] = entries[:n], entries[n:]
            if compiled and n <= FLUSH_ROWS:
                one = np.array([slot], np.int64)  # decode's compiled call per token: no grouping to set up
                for t, g in run:
                    out[t] += self.compiled(x[t:t + 1], one, np.array([g], np.float32))[0]
            else:
                tokens, gates = zip(*run)
                add(tokens, [slot] * n, gates)

        # a decode token's or batch's experts as their reads land, up to a flush (which runs them the way above);
        # not over an inline store, whose copies are made as logged
        landing = LandingExperts(self.compiled, x, cache, a.top_k) if (T == 1 or per_token) and compiled and \
            self.as_landed and self.compiled.one_by_one and not cache.transfers.store.inline else None

        def finish(slots_h: np.ndarray, gates_h: np.ndarray) -> None:
            """The work that no flush ran."""
            nonlocal out
            landed = landing is not None and landing.ran and not landing.stopped
            if T == 1:
                if out is None:
                    out = landing.total(slots_h, gates_h) if landed else decode_out(slots_h, gates_h)
            elif not by_slot:  # no flush: one pass over the whole window
                out = landing.total(slots_h, gates_h) if landed else experts_out(x, slots_h, gates_h)
            else:
                rest = [(t, s, g) for s, entries in by_slot.items() for t, g in entries]
                if rest:
                    add(*zip(*rest))

        def predict(experts: np.ndarray, gates: np.ndarray) -> None:  # this token's slots stay protected
            self._predict_next(layer, x, experts, gates)
        # not where low-precision copies are fetched or still held (a by-expert prompt runs a resident copy as the
        # expert); a policy run after a lowbit one, its cache reset, takes it as it would alone
        if T > 1 and self.by_expert and not (self.policy.fetches_small or cache.state.low.any()) and \
                self.prefetch.mode != "speculative":
            out = torch.zeros_like(x)
            self._run_by_expert(layer, routing, add)
            return out if self.router.scale == 1.0 else out * self.router.scale
        # decode: the next layer's prefetches start as soon as this layer's fetches are under way
        plan = decide_layer(cache, self.policy, stats, layer, routing, self.token_base, flush,
                            predict if ahead and T == 1 else None, landing and landing.landed)
        # a window's predictions serve speculation and a decode batch's prefetches; a prefill issues no prefetch
        if ahead and T > 1 and (self.decoding or self.prefetch.mode == "speculative"):
            predict(plan.experts, plan.gates)
        finish(plan.slots, plan.gates)
        return out if self.router.scale == 1.0 else out * self.router.scale
