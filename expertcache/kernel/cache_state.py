"""The cache's bookkeeping as arrays: what the compiled decision kernel reads and writes
(slots, maps, in-flight transfers, eviction keys, counters, the action log)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .eviction import eviction_code

# Counters, in RunStats' names.
COUNTERS = ("moe_calls", "routed", "hits", "misses", "sync_fetches", "fetch_waits", "substitutions",
            "substituted_calls", "background_fetches", "prefetch_fetches", "segments", "expert_runs", "flushed",
            "lowbit_fetches", "upgrades", "lowbit_uses", "exposed_prefetches")
MOE_CALLS, ROUTED, HITS, MISSES, SYNC_FETCHES, FETCH_WAITS, SUBSTITUTIONS, SUBSTITUTED_CALLS, BACKGROUND, \
    PREFETCHES, SEGMENTS, EXPERT_RUNS, FLUSHED, LOWBIT_FETCHES, UPGRADES, LOWBIT_USES, EXPOSED_PREFETCHES = \
    range(len(COUNTERS))
# misc[]: scalars of the state (CALL_WAITS: the current call waits for fetches of its own)
EVICTION, CALL, N_PROTECTED, N_LOG, LOGGING, GLOBAL_QUOTA, N_FLYING, CALL_WAITS = range(8)


class CacheState(NamedTuple):
    """The cache's bookkeeping as arrays (L layers, E experts, S slots), read and written in
    place by the compiled kernel."""
    slot_of: np.ndarray  # [L, E] slot holding (layer, expert), resident or in flight; -1: absent
    owner: np.ndarray  # [S] layer * E + expert held by the slot; -1: free
    pending: np.ndarray  # [S] bool: its transfer is in flight
    low: np.ndarray  # [S] bool: the slot holds the expert's low-precision copy (fetched by a lowbit policy)
    protected: np.ndarray  # [S] bool: used by the token being decided, not evictable
    protected_list: np.ndarray  # the protected slots, to clear them without a pass over S
    flying: np.ndarray  # [S] slots of admissions and prefetches started in the current call (misc[N_FLYING])
    last_use: np.ndarray  # [S] eviction: token index of the last use (-1: never)
    score: np.ndarray  # [S] eviction: primary key (see eviction.py)
    demand: np.ndarray  # [L, E] decayed routing demand of each expert (`demand` eviction only)
    demand_clock: np.ndarray  # [L, E] the token each demand is current at
    group_clock: np.ndarray  # [L] eviction: the token each decay group's scores are current at
    slot_lo: np.ndarray  # [L] the slots layer l may use are [slot_lo[l], slot_hi[l])
    slot_hi: np.ndarray
    group: np.ndarray  # [L] decay group of each layer (its own, or 0 with a global quota)
    owes: np.ndarray  # [S] the call (misc[CALL]) in which the slot's expert has work not yet run; -1 once flushed
    owed: np.ndarray  # [S] how many entries (token, expert) of that call the slot's work covers
    misc: np.ndarray  # int64 scalars, indexed by EVICTION, CALL, ...
    counts: np.ndarray  # int64 [len(COUNTERS)], drained into RunStats after each call
    mass: np.ndarray  # float64 [1]: substituted gate mass, drained likewise
    log: np.ndarray  # int64 [capacity, 4]: actions for the engine to carry out

    @classmethod
    def make(cls, num_layers: int, num_experts: int, per_layer: int, quota: str, eviction: str,
             top_k: int, active: int | None = None) -> CacheState:
        """An empty state: per_layer * L free slots, each layer's own (quota 'layer') or shared
        ('global'), ordered by `eviction`, with a small action log; of them only `active` a layer in use (all by
        default)."""
        L, E = num_layers, num_experts
        S = per_layer * L
        active = per_layer if active is None else active
        lo = np.zeros(L, np.int64) if quota == "global" else np.arange(L, dtype=np.int64) * per_layer
        hi = np.full(L, active * L, np.int64) if quota == "global" else lo + active
        group = np.zeros(L, np.int64) if quota == "global" else np.arange(L, dtype=np.int64)
        misc = np.zeros(8, np.int64)
        misc[EVICTION] = eviction_code(eviction)
        misc[GLOBAL_QUOTA] = quota == "global"
        return cls(np.full((L, E), -1, np.int64), np.full(S, -1, np.int64), np.zeros(S, bool), np.zeros(S, bool),
                   np.zeros(S, bool),
                   np.zeros(2 * top_k + 2, np.int64), np.zeros(S, np.int64), np.full(S, -1, np.int64), np.zeros(S),
                   np.zeros((L, E)), np.zeros((L, E), np.int64), np.zeros(L, np.int64), lo, hi, group,
                   np.full(S, -1, np.int64), np.zeros(S, np.int64), misc, np.zeros(len(COUNTERS), np.int64),
                   np.zeros(1), np.zeros((64, 4), np.int64))

    def with_log(self, capacity: int) -> CacheState:
        """This state with room for `capacity` logged actions."""
        if len(self.log) >= capacity:
            return self
        return self._replace(log=np.zeros((max(capacity, 2 * len(self.log)), 4), np.int64))
