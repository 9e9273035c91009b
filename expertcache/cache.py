"""The fast tier: a fixed number of expert slots on the compute device and the maps
between (layer, expert) and slot. Slots of one weight kind are one stacked tensor
(w13 [S, 2F, H], w2 [S, H, F]), so the expert kernel indexes them like any expert stack."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .errors import CacheTooSmall, UnknownName
from .eviction import make_eviction
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
    """Slots and maps. With a store, slots are real tensors filled by real transfers; without
    one (`shape` given instead) the cache is virtual: the same bookkeeping, no weights, and
    transfers that complete at once (the simulator's cache)."""

    def __init__(self, cfg: CacheConfig, store: ExpertStore | None, top_k: int, device: torch.device | None,
                 dtype: torch.dtype, shape: ExpertShape | None = None, fetch_bytes: int | None = None):
        if cfg.quota not in ("layer", "global"):
            raise UnknownName(f"unknown quota {cfg.quota!r}; choose 'layer' or 'global'")
        shape = store.shape if store is not None else shape
        self.shape, self.store, self.cfg = shape, store, cfg
        self.expert_bytes = shape.numel * dtype.itemsize  # in the fast tier
        self.fetch_bytes = store.expert_bytes if store is not None else fetch_bytes  # moved per fetch
        self.per_layer = slots_per_layer(cfg, shape, self.expert_bytes, top_k)
        L, E, S = shape.num_layers, shape.num_experts, self.per_layer * shape.num_layers
        self.num_slots = S
        virtual = store is None
        self.w13 = None if virtual else torch.zeros((S, *shape.w13), device=device, dtype=dtype)
        self.w2 = None if virtual else torch.zeros((S, *shape.w2), device=device, dtype=dtype)
        self.slot_of = np.full((L, E), -1, dtype=np.int64)  # resident or in flight
        self.owner = np.full(S, -1, dtype=np.int64)  # layer * E + expert
        self.protected = np.zeros(S, dtype=bool)  # slots that may not be evicted right now
        self.pending: dict[int, Transfer] = {}  # slot -> transfer in flight
        self.eviction = make_eviction(cfg.eviction, S)
        all_slots = np.arange(S)
        self.layer_slots = [all_slots if cfg.quota == "global" else all_slots[l * self.per_layer:(l + 1) * self.per_layer]
                            for l in range(L)]
        self.transfers = InstantTransfers() if virtual else TransferEngine(store, self.w13, self.w2, cfg.io_workers)

    @property
    def bytes(self) -> int:
        return self.num_slots * self.expert_bytes

    # -- what policies see ---------------------------------------------------------------
    def is_resident(self, layer: int, expert: int) -> bool:
        s = self.slot_of[layer, expert]
        return s >= 0 and s not in self.pending

    def in_flight(self, layer: int, expert: int) -> bool:
        s = self.slot_of[layer, expert]
        return s >= 0 and s in self.pending

    def resident_mask(self, layer: int) -> np.ndarray:
        """bool [E]: experts of `layer` usable now (in-flight ones excluded)."""
        mask = self.slot_of[layer] >= 0
        for slot in self.pending:
            if self.owner[slot] // self.shape.num_experts == layer:
                mask[self.owner[slot] % self.shape.num_experts] = False
        return mask

    # -- moving experts ------------------------------------------------------------------
    def victim(self, layer: int) -> int:
        """The slot that the next expert of `layer` will take (not yet evicted)."""
        return self._victim(layer)

    def start(self, layer: int, expert: int, kind: str, slot: int | None = None) -> Transfer:
        """Evict `slot` (default: the victim), remap it to (layer, expert) and start the
        transfer; the caller waits on the slot when it needs the weights."""
        slot = self._victim(layer) if slot is None else slot
        old = self.owner[slot]
        if old >= 0:
            self.slot_of[old // self.shape.num_experts, old % self.shape.num_experts] = -1
        self.owner[slot] = layer * self.shape.num_experts + expert
        self.slot_of[layer, expert] = slot
        self.eviction.insert(slot)
        t = self.transfers.submit(layer, expert, slot, kind)
        self.pending[slot] = t
        return t

    def _victim(self, layer: int) -> int:
        slots = self.layer_slots[layer]
        blocked = self.protected.copy()
        blocked[list(self.pending)] = True
        if blocked[slots].all() and self.pending:  # only in-flight admissions left: let them land
            self.finish_all()
            blocked = self.protected
        if blocked[slots].all():
            raise CacheTooSmall(f"layer {layer}: every cache slot is needed by the current token; "
                                "give the cache more slots")
        return self.eviction.victim(slots, blocked)

    def wait(self, slot: int) -> float:
        """Block until `slot` holds its expert; returns the stall in seconds."""
        t = self.pending.pop(slot, None)
        return self.transfers.wait(t) if t is not None else 0.0

    def poll(self) -> None:
        """Retire finished background transfers so policies see them as resident."""
        for slot in [s for s, t in self.pending.items() if t.done()]:
            self.transfers.wait(self.pending.pop(slot))

    def finish_all(self) -> float:
        return sum(self.wait(s) for s in list(self.pending))

    def fill(self, layer: int, experts) -> None:
        """Initial residency: load `experts` of `layer` synchronously, outside any statistics."""
        for e in experts:
            if self.slot_of[layer, e] < 0:
                self.start(layer, int(e), "fill")
        self.finish_all()

    def warm(self, counts: np.ndarray) -> None:
        """Warm start: each layer's most-routed experts (counts [L, E]) fill its share of slots."""
        n = self.per_layer if self.cfg.quota == "layer" else self.num_slots // self.shape.num_layers
        for layer in range(self.shape.num_layers):
            self.fill(layer, np.argsort(-counts[layer], kind="stable")[:n])

    def clear(self) -> None:
        self.finish_all()
        self.slot_of[:] = -1
        self.owner[:] = -1
        self.eviction = make_eviction(self.cfg.eviction, self.num_slots)

    def close(self) -> None:
        self.finish_all()
        self.transfers.close()
