"""Eviction orders over cache slots, compiled (numba) for the decision kernel.

Every order keeps two arrays over all slots: `last_use` (token index of the last use) and
`score` (0 for LRU; uses since insertion for LFU; a use count that fades with time for
`freq` and `halving`). The victim is the allowed slot with the lowest (score, last_use,
slot index). Fading scores are kept current eagerly: when a decay group's clock moves on
(a layer's own clock with per-layer quotas, one clock with a global quota), its scores are
multiplied by the decay since the last move, so a use is simply `score += 1`.
"""
from __future__ import annotations

import numpy as np

from .compiled import compiled
from .errors import UnknownName

LRU, LFU, FREQ, HALVING = 0, 1, 2, 3
EVICTIONS = {"lru": LRU,  # least recently used
             "lfu": LFU,  # least frequently used: uses since the expert entered its slot
             "freq": FREQ,  # uses decaying by DECAY per token: recent frequency beats old
             "halving": HALVING}  # llama.cpp's expert cache: scores halve every PERIOD tokens
DECAY = 0.98
PERIOD = 128
TINY = 1e-200  # decayed scores below this are 0 (no denormal arithmetic on stale slots)


def eviction_code(name: str) -> int:
    if name not in EVICTIONS:
        raise UnknownName(f"unknown eviction {name!r}; choose one of {', '.join(EVICTIONS)}")
    return EVICTIONS[name]


@compiled
def advance(kind, score, group_clock, group, lo, hi, clock):
    """Bring the scores of slots [lo, hi) (decay group `group`) to token `clock`."""
    prev = group_clock[group]
    if clock <= prev:
        return
    group_clock[group] = clock
    if kind == FREQ:
        f = DECAY ** (clock - prev)
    elif kind == HALVING:
        n = clock // PERIOD - prev // PERIOD
        if n == 0:
            return
        f = 0.5 ** n
    else:
        return
    for s in range(lo, hi):
        v = score[s] * f
        score[s] = v if v > TINY else 0.0


@compiled
def touch(kind, score, last_use, slot, clock):
    last_use[slot] = clock
    if kind != LRU:
        score[slot] += 1.0


@compiled
def insert(score, last_use, slot, clock):
    last_use[slot] = clock
    score[slot] = 0.0


@compiled
def victim(kind, score, last_use, blocked_a, blocked_b, lo, hi):
    """The slot in [lo, hi) with the lowest (score, last_use, index) that neither mask blocks;
    -1 when every slot is blocked. Written as masked minimum reductions, which vectorise:
    (last_use + 1) << 20 | offset orders by recency, then by index."""
    none = np.iinfo(np.int64).max
    m = -np.inf
    if kind != LRU:  # the lowest score first
        m = np.inf
        for s in range(lo, hi):
            m = min(m, np.inf if blocked_a[s] | blocked_b[s] else score[s])
    best = none
    for s in range(lo, hi):
        ok = not (blocked_a[s] | blocked_b[s]) and (kind == LRU or score[s] == m)
        best = min(best, ((last_use[s] + 1) << 20 | (s - lo)) if ok else none)
    return -1 if best == none else lo + (best & 0xFFFFF)
