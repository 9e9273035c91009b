"""Eviction orders over cache slots. Each keeps one score array over all slots; the cache
asks for the victim among the slots a layer may use (per-layer or global quota)."""
from __future__ import annotations

import numpy as np

from .errors import UnknownName


class Eviction:
    """Least recently used. `clock` counts MoE calls so recency breaks every tie."""

    name = "lru"

    def __init__(self, num_slots: int):
        self.last_use = np.zeros(num_slots, dtype=np.int64)
        self.clock = 0

    def tick(self) -> None:
        self.clock += 1

    def touch(self, slot: int) -> None:
        self.last_use[slot] = self.clock

    def insert(self, slot: int) -> None:
        self.last_use[slot] = self.clock

    def victim(self, slots: np.ndarray, protected: np.ndarray) -> int:
        """The slot to evict among `slots` (indices) excluding `protected` (bool mask over all slots)."""
        keys = np.where(protected[slots], np.iinfo(np.int64).max, self.last_use[slots])
        return int(slots[np.argmin(keys)])


EVICTIONS = {"lru": Eviction}


def make_eviction(name: str, num_slots: int) -> Eviction:
    if name not in EVICTIONS:
        raise UnknownName(f"unknown eviction {name!r}; choose one of {', '.join(EVICTIONS)}")
    return EVICTIONS[name](num_slots)
