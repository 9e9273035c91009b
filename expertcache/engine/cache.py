"""The fast tier: a fixed number of expert slots on the compute device, the bookkeeping
that maps (layer, expert) to slots (`cache_state.CacheState`), and the transfers that fill
them. Slots of one weight kind are one stacked tensor (w13 [S, 2F, H], w2 [S, H, F]), so the
expert kernel indexes them like any expert stack."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CacheTooSmall, UnknownName
from ..kernel import decisions as kernel
from ..kernel.cache_state import LOGGING, N_LOG, CacheState
from ..kernel.policy import Scratch
from ..kernel.routing import Router, Routing, route_logits
from ..policies import MissPolicy
from .stores import ExpertShape, ExpertStore
from .transfer import InstantTransfers, Transfer, TransferEngine


@dataclass(frozen=True)
class CacheConfig:
    fraction: float = 0.25  # of each layer's experts
    bytes: int | None = None  # overrides fraction when given
    quota: str = "layer"  # "layer": each layer owns its slots; "global": any layer may take any slot
    eviction: str = "lru"  # the engine overrides it with EngineConfig.eviction or the policy's choice
    io_workers: int = 4


def slots_per_layer(cfg: CacheConfig, shape: ExpertShape, fast_expert_bytes: int, top_k: int) -> int:
    if cfg.bytes is not None:
        per_layer = cfg.bytes // fast_expert_bytes // shape.num_layers
        what = f"{cfg.bytes} bytes"
    else:
        if not 0 < cfg.fraction <= 1:
            raise CacheTooSmall(f"cache fraction {cfg.fraction} must be in (0, 1]; e.g. --cache 0.25")
        per_layer = int(round(cfg.fraction * shape.num_experts))
        what = f"a fraction of {cfg.fraction}"
    if per_layer < top_k:
        raise CacheTooSmall(f"{what} gives {per_layer} expert slots per layer, fewer than top-k={top_k}; "
                            f"give at least {top_k / shape.num_experts:.3f} of the experts or "
                            f"{top_k * fast_expert_bytes * shape.num_layers} bytes")
    return min(per_layer, shape.num_experts)


class ExpertCache:
    """Slots, their bookkeeping and their transfers. With a store, slots are real tensors
    filled by real transfers; without one (`shape` given instead) the cache is virtual: the
    same bookkeeping, no weights, and transfers that complete at once (the simulator's)."""

    def __init__(self, cfg: CacheConfig, store: ExpertStore | None, top_k: int, device: torch.device | None,
                 dtype: torch.dtype, shape: ExpertShape | None = None, fetch_bytes: int | None = None):
        if cfg.quota not in ("layer", "global"):
            raise UnknownName(f"unknown quota {cfg.quota!r}; choose 'layer' or 'global'")
        shape = store.shape if store is not None else shape
        self.shape, self.store, self.cfg, self.top_k = shape, store, cfg, top_k
        self.expert_bytes = shape.numel * dtype.itemsize  # in the fast tier
        self.fetch_bytes = store.expert_bytes if store is not None else fetch_bytes  # moved per fetch
        self.per_layer = slots_per_layer(cfg, shape, self.expert_bytes, top_k)
        S = self.per_layer * shape.num_layers
        self.num_slots = S
        virtual = store is None
        self.w13 = None if virtual else torch.zeros((S, *shape.w13), device=device, dtype=dtype)
        self.w2 = None if virtual else torch.zeros((S, *shape.w2), device=device, dtype=dtype)
        self.state = self._new_state()
        self.scratch = Scratch.make(top_k, shape.num_experts)
        self.pending: dict[int, Transfer] = {}  # slot -> transfer in flight
        self.transfers = InstantTransfers() if virtual else TransferEngine(store, self.w13, self.w2, cfg.io_workers)
        if not virtual:
            self._compile()

    def _compile(self) -> None:
        """Compile routing and the decision kernel for the engine's argument types now, on a
        throwaway state (numba caches the machine code on disk: only the first run compiles),
        so that no forward pass is timed with a compilation in it."""
        L, E, k = self.shape.num_layers, self.shape.num_experts, self.top_k
        route_logits(np.zeros((1, E), np.float32), k, True)
        Router(k, True, "sigmoid").route(np.zeros((1, E), np.float32), 0)
        ids = np.arange(k, dtype=np.int64)[None]
        for logits in (True, False):
            kernel.decide_layer(self._new_state(), MissPolicy().params(), np.zeros((L, E)), self.scratch, 0,
                                np.zeros((1, E), np.float32), np.zeros((1, E), np.float32), logits, ids,
                                np.full((1, k), 1 / k, np.float32), 0, np.zeros((1, k), np.int64),
                                np.zeros((1, k), np.int64), np.zeros((1, k), np.float32))

    def _new_state(self) -> CacheState:
        st = CacheState.make(self.shape.num_layers, self.shape.num_experts, self.per_layer, self.cfg.quota,
                             self.cfg.eviction, self.top_k)
        st.misc[LOGGING] = 1
        return st.with_log(kernel.log_capacity(1, self.top_k, self.shape.num_experts))

    @property
    def bytes(self) -> int:
        return self.num_slots * self.expert_bytes

    @property
    def slot_of(self) -> np.ndarray:
        """[L, E] slot of each (layer, expert), resident or in flight; -1 if absent."""
        return self.state.slot_of

    def too_small(self, layer: int) -> CacheTooSmall:
        return CacheTooSmall(f"layer {layer}: every cache slot is needed by the current token; "
                             "give the cache more slots")

    # -- deciding ------------------------------------------------------------------------
    def decide(self, policy, layer: int, routing: Routing, token_base: int, slots: np.ndarray, experts: np.ndarray,
               gates: np.ndarray) -> int:
        """Decide one layer's tokens (the compiled loop) and log the actions to carry out;
        returns the first token whose expert work is still owed."""
        T, k = routing.ids.shape
        self.state = self.state.with_log(kernel.log_capacity(T, k, self.shape.num_experts))
        L, E = self.shape.num_layers, self.shape.num_experts
        logits = routing.scores is routing.rows  # softmax: one row ranks and weighs
        owed_from = kernel.decide_layer(self.state, policy.params(), policy.bind(L, E), self.scratch, layer,
                                        routing.rows, routing.scores, logits, routing.ids, routing.weights,
                                        token_base, slots, experts, gates)
        if owed_from < 0:
            raise self.too_small(layer)
        return owed_from

    def prefetch(self, layer: int, experts: np.ndarray, clock: int) -> float:
        """Start transfers of `experts` of `layer` that are not mapped yet."""
        if not kernel.prefetch(self.state, layer, np.asarray(experts, np.int64), clock):
            raise self.too_small(layer)
        return self.carry_out()

    def carry_out(self, compute=None) -> float:
        """Carry out the logged actions in order: start transfers, wait for them, run the
        expert work owed before a slot is overwritten (`compute(begin, end)`). Returns the
        seconds stalled."""
        st, stall = self.state, 0.0
        n = st.misc[N_LOG]
        if not n:
            return 0.0
        E = self.shape.num_experts
        for op, a, b, c in st.log[:n].tolist():
            if op == kernel.LOAD:
                self.pending[a] = self.transfers.submit(b // E, b % E, a, kernel.KINDS[c])
            elif op == kernel.WAIT:
                stall += self.wait(a)
            elif op == kernel.FLUSH:
                compute(a, b)
            else:
                stall += self.finish_all()
        st.misc[N_LOG] = 0
        return stall

    # -- transfers -----------------------------------------------------------------------
    def wait(self, slot: int) -> float:
        """Block until `slot` holds its expert; returns the stall in seconds."""
        t = self.pending.pop(slot, None)
        self.state.pending[slot] = False
        return self.transfers.wait(t) if t is not None else 0.0

    def poll(self) -> None:
        """Retire finished transfers so that decisions see them as resident."""
        for slot in [s for s, t in self.pending.items() if t.done()]:
            self.wait(slot)

    def finish_all(self) -> float:
        return sum(self.wait(s) for s in list(self.pending))

    # -- residency -----------------------------------------------------------------------
    def fill(self, layer: int, experts) -> None:
        """Initial residency: load `experts` of `layer` synchronously, outside any statistics."""
        if not kernel.fill(self.state, layer, np.asarray(experts, np.int64)):
            raise self.too_small(layer)
        self.carry_out()
        self.finish_all()

    def warm(self, counts: np.ndarray) -> None:
        """Warm start: each layer's most-routed experts (counts [L, E]) fill its share of slots."""
        n = self.per_layer if self.cfg.quota == "layer" else self.num_slots // self.shape.num_layers
        for layer in range(self.shape.num_layers):
            self.fill(layer, np.argsort(-counts[layer], kind="stable")[:n])

    def clear(self) -> None:
        """Empty the cache; takes up a changed eviction order."""
        self.finish_all()
        self.state = self._new_state()

    def close(self) -> None:
        self.finish_all()
        self.transfers.close()
