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

from ..errors import UnknownName, did_you_mean
from .compiled import compiled

LRU, LFU, FREQ, HALVING, DEMAND = 0, 1, 2, 3, 4
EVICTIONS = {"lru": LRU,  # least recently used
             "lfu": LFU,  # least frequently used: uses since the expert entered its slot
             "freq": FREQ,  # uses decaying by DECAY per token: recent frequency beats old
             "halving": HALVING,  # llama.cpp's expert cache: scores halve every PERIOD tokens
             "demand": DEMAND}  # freq, but an expert enters with its routing demand (see enter_score)
DECAY = 0.98
PERIOD = 128
TINY = 1e-200  # decayed scores below this are 0 (no denormal arithmetic on stale slots)


def eviction_code(name: str) -> int:
    """The compiled code of the eviction order `name`; raises UnknownName for others."""
    if name not in EVICTIONS:
        raise UnknownName(f"unknown eviction {name!r}{did_you_mean(name, EVICTIONS)}; choose one of "
                          f"{', '.join(EVICTIONS)}")
    return EVICTIONS[name]


@compiled
def advance(kind, score, group_clock, group, lo, hi, clock):
    """Bring the scores of slots [lo, hi) (decay group `group`) to token `clock`."""
    prev = group_clock[group]
    if clock <= prev:
        return
    group_clock[group] = clock
    if kind == FREQ or kind == DEMAND:
        f = DECAY ** (clock - prev)
    elif kind == HALVING:
        n = clock // PERIOD - prev // PERIOD
        if n == 0:
            return
        f = 0.5 ** n
    else:
        return
    for i in range(np.uint64(hi - lo)):  # unsigned: plain vector loads (see victim)
        s = np.uint64(lo) + i
        v = score[s] * f
        score[s] = v if v > TINY else 0.0


@compiled
def touch(kind, score, last_use, slot, clock):
    """Record a use of `slot` at token `clock`."""
    last_use[slot] = clock
    if kind != LRU:
        score[slot] += 1.0


@compiled
def insert(score, last_use, slot, clock, entry):
    """A slot takes a new expert at token `clock` with score `entry`."""
    last_use[slot] = clock
    score[slot] = entry


@compiled
def decayed(value, since, clock):
    """A DECAY-per-token count last brought current at token `since`, at token `clock`."""
    return value * DECAY ** (clock - since) if clock > since else value


@compiled
def add_demand(demand, demand_clock, layer, e, clock):
    """One more routing of expert e of `layer` at token `clock`, resident or not."""
    demand[layer, e] = decayed(demand[layer, e], demand_clock[layer, e], clock) + 1.0
    demand_clock[layer, e] = clock


@compiled
def enter_score(kind, demand, demand_clock, layer, e, clock):
    """The score an expert enters its slot with: 0, except under `demand`, where it is the
    expert's decayed routing demand so far (tokens that routed to it, resident or not), so
    an admitted or prefetched expert is not the next victim merely for being new."""
    if kind != DEMAND:
        return 0.0
    return decayed(demand[layer, e], demand_clock[layer, e], clock)


@compiled
def victim(kind, score, last_use, blocked_a, blocked_b, lo, hi):
    """The slot in [lo, hi) with the lowest (score, last_use, index) that neither mask blocks;
    -1 when every slot is blocked.

    Written as minimum reductions without branches, which vectorise: scores are never
    negative, so their bit patterns order like their values; (last_use + 1) << 20 | offset
    orders by recency, then by index; a blocked slot's key is pushed past every real one.
    Unsigned indices spare the negative-index wrapping that would turn loads into gathers."""
    blocked_key = np.int64(1) << 62
    base, n = np.uint64(lo), np.uint64(hi - lo)
    bits = score.view(np.int64)
    m = np.int64(0)
    if kind != LRU:  # the lowest score first; then recency among the slots that have it
        m = np.iinfo(np.int64).max
        for i in range(n):
            s = base + i
            m = min(m, np.iinfo(np.int64).max if blocked_a[s] | blocked_b[s] else bits[s])
    best = blocked_key
    for i in range(n):
        s = base + i
        out = np.int64(blocked_a[s] | blocked_b[s] | (kind != LRU and bits[s] != m))
        best = min(best, ((last_use[s] + 1) << 20 | np.int64(i)) + out * blocked_key)
    return -1 if best >= blocked_key else lo + (best & 0xFFFFF)
