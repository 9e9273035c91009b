"""Eviction orders over cache slots. Each keeps score arrays over all slots; the cache asks
for the victim among the slots a layer may use (per-layer or global quota).

`clock` is the index of the token being decided (set by the MoE layer), so recency and
decay are measured in tokens; every order breaks ties by recency.
"""
from __future__ import annotations

import numpy as np

from .errors import UnknownName


class LRU:
    """Least recently used."""
    name = "lru"

    def __init__(self, num_slots: int):
        self.last_use = np.full(num_slots, -1, dtype=np.int64)  # free slots go first
        self.clock = 0

    def touch(self, slot: int) -> None:
        self.last_use[slot] = self.clock

    def touch_many(self, slots: np.ndarray) -> None:
        """Touch distinct slots used by one token."""
        self.last_use[slots] = self.clock

    def insert(self, slot: int) -> None:
        self.last_use[slot] = self.clock

    def score(self, slots: np.ndarray) -> np.ndarray:
        """Primary key, lowest evicted first."""
        return np.zeros(len(slots))

    def victim(self, slots: np.ndarray, blocked: np.ndarray) -> int:
        """The slot to evict among `slots` (indices), never one marked in `blocked` (bool over all slots)."""
        allowed = slots[~blocked[slots]]
        order = np.lexsort((self.last_use[allowed], self.score(allowed)))
        return int(allowed[order[0]])


class LFU(LRU):
    """Least frequently used: accesses since the expert entered its slot."""
    name = "lfu"

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.count = np.zeros(num_slots, dtype=np.int64)

    def touch(self, slot):
        super().touch(slot)
        self.count[slot] += 1

    def touch_many(self, slots):
        super().touch_many(slots)
        self.count[slots] += 1

    def insert(self, slot):
        super().insert(slot)
        self.count[slot] = 0

    def score(self, slots):
        return self.count[slots]


class ScoredUse(LRU):
    """A use adds 1 to the slot's score, which fades with time as `_now` says."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.value = np.zeros(num_slots)  # score as of last_use

    def _now(self, slots):
        raise NotImplementedError

    def touch(self, slot):
        self.value[slot] = self._now(slot) + 1.0
        super().touch(slot)

    def touch_many(self, slots):
        self.value[slots] = self._now(slots) + 1.0
        super().touch_many(slots)

    def insert(self, slot):
        super().insert(slot)
        self.value[slot] = 0.0

    def score(self, slots):
        return self._now(slots)


class DecayedFrequency(ScoredUse):
    """Access counts that decay by `decay` per token: frequent recently beats frequent long ago."""
    name = "freq"

    def __init__(self, num_slots: int, decay: float = 0.98):
        super().__init__(num_slots)
        self.decay = decay

    def _now(self, slots):
        return self.value[slots] * self.decay ** (self.clock - self.last_use[slots]).clip(0)


class Halving(ScoredUse):
    """llama.cpp's expert cache: every score halves each `period` tokens; the lowest score
    goes first, ties by recency."""
    name = "halving"

    def __init__(self, num_slots: int, period: int = 128):
        super().__init__(num_slots)
        self.period = period

    def _now(self, slots):
        halvings = self.clock // self.period - self.last_use[slots].clip(0) // self.period
        return self.value[slots] * 0.5 ** halvings


EVICTIONS = {c.name: c for c in (LRU, LFU, DecayedFrequency, Halving)}


def make_eviction(name: str, num_slots: int):
    if name not in EVICTIONS:
        raise UnknownName(f"unknown eviction {name!r}; choose one of {', '.join(EVICTIONS)}")
    return EVICTIONS[name](num_slots)
