"""The compiled half of the miss policies: for one MoE call, which routed experts run,
which misses are fetched now, which are substituted by which resident expert, and what is
admitted in the background. One function (`decide`) over a parameter vector that
`expertcache.policies` builds from a spec; shared by the engine and the replay."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cache_state import GLOBAL_QUOTA
from .compiled import compiled
from .routing import rank_key, top_m, value

# The parameter vector read by `decide`; NORM: the family renormalises its top-k gate weights.
# A vector longer than N_PARAMS carries one tau per MoE layer after them (p[N_PARAMS + layer]),
# which replaces p[TAU] at that layer. UPGRADE: a hit on a slot holding a small copy at a weight the
# rule fetches in full reads the full copy into it in the background.
KIND, RULE, SUB, WINDOW, BETA, TAU, LO, HI, TOP_J, TOP_M, NORM, UPGRADE = range(12)
N_PARAMS = 12
FETCH_ALL, SUBSTITUTING, CONDITIONAL = 0, 1, 2  # KIND
NEVER, THRESHOLD, FIRST_CHOICE, BAND, LOWBIT = 0, 1, 2, 3, 4  # RULE: which misses a substituting policy fetches
SUBSTITUTES = ("best", "drop", "window")  # SUB, by index



class Scratch(NamedTuple):
    """Working arrays of one decision (allocated once, not per call)."""
    exec_e: np.ndarray  # [k] executed experts
    exec_w: np.ndarray  # [k] their weights
    fetch: np.ndarray  # [k]
    low: np.ndarray  # [k] bool: fetch[i] is of the expert's low-precision copy
    admit: np.ndarray  # [k]
    missed: np.ndarray  # [k] ranks to substitute
    keep: np.ndarray  # [k] bool: rank runs its routed expert
    sub_e: np.ndarray  # [k] substitute per rank, -1: none
    order: np.ndarray  # [E] top-m selections
    order_v: np.ndarray  # [E]
    mark: np.ndarray  # [E] bool
    routed: np.ndarray  # [E] bool
    cand_e: np.ndarray  # [k] best substitutes
    comp: np.ndarray  # [E] int64, for top_m on float16 rows
    block_max: np.ndarray  # [E / 16 + 1] int64
    gate_row: np.ndarray  # [E] float32: a sigmoid router's gate scores of the token being decided

    @classmethod
    def make(cls, k: int, E: int) -> Scratch:
        """Zeroed working arrays for top-`k` routing over `E` experts."""
        return cls(np.zeros(k, np.int64), np.zeros(k), np.zeros(k, np.int64), np.zeros(k, bool), np.zeros(k, np.int64),
                   np.zeros(k, np.int64), np.zeros(k, bool), np.zeros(k, np.int64), np.zeros(E, np.int64),
                   np.zeros(E), np.zeros(E, bool), np.zeros(E, bool), np.zeros(k, np.int64), np.zeros(E, np.int64),
                   np.zeros(E // 16 + 1, np.int64), np.zeros(E, np.float32))



@compiled
def resident(st, layer, e):
    """Whether expert `e` of `layer` holds a slot whose transfer has finished."""
    s = st.slot_of[layer, e]
    return s >= 0 and not st.pending[s]


@compiled
def tau_of(p, layer):
    """The fetch threshold tau at `layer`: its own where p carries one per layer, else p[TAU]."""
    return p[N_PARAMS + layer] if len(p) > N_PARAMS else p[TAU]


@compiled
def _should_fetch(p, layer, rank, w):
    rule = p[RULE]
    if rule == THRESHOLD or rule == LOWBIT:
        return rank == 0 or w >= tau_of(p, layer)
    if rule == FIRST_CHOICE:
        return rank == 0
    if rule == BAND:
        return not (p[LO] <= w < p[HI])
    return False


@compiled
def wants_upgrade(p, layer, rank, w):
    """Whether a routed expert served by its low-precision copy should get its full copy: the
    policy upgrades, and would fetch it in full were it a miss."""
    return p[UPGRADE] != 0 and _should_fetch(p, layer, rank, w)


@compiled
def fetches_miss(p, layer, rank, w):
    """Whether the policy fetches in full the expert ranked `rank`, of gate weight w, at `layer` when it misses
    (fetch-all and the cache-conditional policy may fetch any): a prefetch that only reads these reads nothing
    the policy would substitute."""
    return p[KIND] != SUBSTITUTING or _should_fetch(p, layer, rank, w)


@compiled
def would_fetch(p, layer, weights, out):
    """out[j] = fetches_miss for each rank j of gate weights [k]."""
    for j in range(weights.shape[0]):
        out[j] = fetches_miss(p, layer, j, weights[j])


@compiled
def _account(p, account, layer, e, w, admit, n_admit):
    """Add w to e's substituted mass; admit e once it reaches beta."""
    if p[BETA] <= 0:
        return n_admit
    total = account[layer, e] + w
    if total >= p[BETA]:
        account[layer, e] = 0.0
        admit[n_admit] = e
        return n_admit + 1
    account[layer, e] = total
    return n_admit


@compiled
def _best_substitutes(p, st, sc, layer, row, table, ranked, k, n):
    """The n best resident experts of `layer` by router score (not in flight, not routed,
    within the top-window ranks for sub=window, not -inf: a sigmoid router's selection row is
    -inf outside the token's allowed groups) into sc.cand_e, best first, ties to the lower
    expert id; returns how many there are (<= n).

    `ranked` holds the row's experts in rank order as far as the caller ranked them (at
    least the k routed): the first usable ones past rank k are the answer when enough of them
    are there. Otherwise every usable slot gets its expert's rank_key, unusable ones -1, and
    the best are taken by maximum reductions."""
    if n <= 0:
        return 0
    E = st.slot_of.shape[1]
    window = p[SUB] == 2
    M = min(int(p[WINDOW]), E)
    limit = min(len(ranked), M) if window else len(ranked)
    found = 0
    for r in range(k, limit):
        e = ranked[r]
        s = st.slot_of[layer, e]
        if s >= 0 and not st.pending[s] and value(row, table, e) > -np.inf:  # -inf: outside the allowed groups
            sc.cand_e[found] = e
            found += 1
            if found == n:
                return found
    if len(ranked) == E or (window and M <= len(ranked)):
        return found  # every rank that may substitute was seen
    ids = ranked[:k]
    if window:
        top_m(row, table, M, sc.order, sc.order_v, sc.comp, sc.block_max)
        for i in range(M):
            sc.mark[sc.order[i]] = True
    for j in range(len(ids)):
        sc.routed[ids[j]] = True
    keys = sc.comp
    if not st.misc[GLOBAL_QUOTA]:  # the layer's own slots, each holding an expert of this layer or none
        lo = np.uint64(st.slot_lo[layer])
        n_keys = np.uint64(st.slot_hi[layer]) - lo
        for i in range(n_keys):  # `&` rather than `and`: no branches, so the loop vectorises
            s = lo + i
            e = st.owner[s] - layer * E
            ec = max(e, 0)  # a safe index for free slots, which are masked out
            usable = (e >= 0) & (not st.pending[s]) & (not sc.routed[ec]) & ((not window) | sc.mark[ec]) \
                & (value(row, table, ec) > -np.inf)
            keys[i] = rank_key(row, table, ec) if usable else -1
    else:  # a global quota: the layer's experts
        n_keys = np.uint64(E)
        for e in range(E):
            s = st.slot_of[layer, e]
            usable = (s >= 0) & (not st.pending[max(s, 0)]) & (not sc.routed[e]) & ((not window) | sc.mark[e]) \
                & (value(row, table, e) > -np.inf)
            keys[e] = rank_key(row, table, e) if usable else -1
    found = 0
    for c in range(n):
        best = np.int64(-1)
        for i in range(n_keys):
            best = max(best, keys[i])
        if best < 0:
            break
        e = 0xFFFF - (best & 0xFFFF)
        sc.cand_e[c] = e
        for i in range(n_keys):  # take it out
            keys[i] = -1 if keys[i] == best else keys[i]
        found += 1
    for j in range(len(ids)):
        sc.routed[ids[j]] = False
    if window:
        for i in range(M):
            sc.mark[sc.order[i]] = False
    return found


@compiled
def decide(p, account, st, sc, layer, row, table, logits, ranked, w):
    """One MoE call. p: a policy's params(), checked against the model (`MissPolicy.fit`):
    nothing here checks bounds; account: its [L, E] state; st: the cache state; sc: scratch;
    row [E]: the router's probabilities, or its logits when `logits`, else a sigmoid router's
    selection row (the order; the gate scores are in sc.gate_row), read through `table` (see
    `value`); ranked: the row's experts in rank order, at least the k routed ones; w [k]: the
    routed gate weights, normalised as the family does (p[NORM]).

    Writes the executed experts and weights to sc.exec_e / sc.exec_w, the synchronous
    fetches to sc.fetch (sc.low marks those of low-precision copies: the LOWBIT rule fetches
    a miss it does not fetch in full as its small copy when its weight is >= p[LO], and
    substitutes it below) and background admissions to sc.admit; returns
    (executed, fetches, admissions, substituted, substituted mass)."""
    k = len(w)
    ids = ranked[:k]
    kind = p[KIND]
    sc.low[:] = False
    if kind == CONDITIONAL:
        return _conditional(p, st, sc, layer, row, table, logits, ranked, w)
    n_fetch = 0
    for j in range(k):
        sc.exec_e[j], sc.exec_w[j] = ids[j], w[j]
        if not resident(st, layer, ids[j]):
            sc.fetch[n_fetch] = ids[j]
            n_fetch += 1
    if kind == FETCH_ALL or n_fetch == 0:
        return k, n_fetch, 0, 0, 0.0
    # Substituting: which misses to fetch (first rule, in-flight ones) and which to substitute.
    n_fetch, n_missed, n_kept = 0, 0, 0
    for j in range(k):
        e = ids[j]
        sc.sub_e[j] = -1
        s = st.slot_of[layer, e]
        if s >= 0 and not st.pending[s]:
            sc.keep[j] = True
        elif s >= 0 or _should_fetch(p, layer, j, w[j]):
            sc.keep[j] = True
            sc.fetch[n_fetch] = e
            n_fetch += 1
        elif p[RULE] == LOWBIT and w[j] >= p[LO]:
            sc.keep[j] = True
            sc.low[n_fetch] = True
            sc.fetch[n_fetch] = e
            n_fetch += 1
        else:
            sc.keep[j] = False
            sc.missed[n_missed] = j
            n_missed += 1
        n_kept += sc.keep[j]
    first = 0  # missed[first:] are still to be substituted
    drop = p[SUB] == 1
    if drop and n_kept == 0:  # nothing would be left: fetch the first choice
        j = sc.missed[0]
        sc.keep[j] = True
        sc.fetch[n_fetch] = ids[j]
        n_fetch += 1
        first = 1
    substituted, mass, n_admit = 0, 0.0, 0
    if not drop:
        n_cand = _best_substitutes(p, st, sc, layer, row, table, ranked, k, n_missed - first)
        for i in range(first, n_missed):
            j, c = sc.missed[i], i - first
            if c >= n_cand:  # no resident expert left to substitute: fetch
                sc.keep[j] = True
                sc.fetch[n_fetch] = ids[j]
                n_fetch += 1
                continue
            sc.sub_e[j] = sc.cand_e[c]
            substituted += 1
            mass += w[j]
            n_admit = _account(p, account, layer, ids[j], w[j], sc.admit, n_admit)
    else:
        for i in range(first, n_missed):
            j = sc.missed[i]
            substituted += 1
            mass += w[j]
            n_admit = _account(p, account, layer, ids[j], w[j], sc.admit, n_admit)
    n_exec, kept, routed = 0, 0.0, 0.0
    for j in range(k):
        routed += w[j]
        if sc.keep[j] or sc.sub_e[j] >= 0:
            sc.exec_e[n_exec] = ids[j] if sc.keep[j] else sc.sub_e[j]
            sc.exec_w[n_exec] = w[j]
            kept += w[j]
            n_exec += 1
    if drop and substituted:  # the kept weights take up the dropped ones' share: the routed total stays
        for i in range(n_exec):
            sc.exec_w[i] *= routed / kept
    return n_exec, n_fetch, n_admit, substituted, mass


@compiled
def _conditional(p, st, sc, layer, row, table, logits, ranked, w):
    k = len(w)
    ids = ranked[:k]
    J, M = int(p[TOP_J]), min(max(int(p[TOP_M]), k), len(row))
    if len(ranked) >= M:  # ranked far enough already
        for i in range(M):
            sc.order[i] = ranked[i]
            sc.order_v[i] = value(row, table, ranked[i])
    else:
        top_m(row, table, M, sc.order, sc.order_v, sc.comp, sc.block_max)
    n = 0
    for i in range(J):
        sc.exec_e[n] = sc.order[i]
        n += 1
    for i in range(J, M):
        if n < k and resident(st, layer, sc.order[i]):
            sc.exec_e[n] = sc.order[i]
            n += 1
    for i in range(J, M):
        if n >= k:
            break
        taken = False
        for c in range(n):
            taken |= sc.exec_e[c] == sc.order[i]
        if not taken:
            sc.exec_e[n] = sc.order[i]
            n += 1
    total, n_fetch = 0.0, 0
    for c in range(n):
        e = sc.exec_e[c]
        q = value(row, table, e)
        q = np.exp(q - sc.order_v[0]) if logits else sc.gate_row[e]
        sc.exec_w[c] = q
        total += q
        if not resident(st, layer, e):
            sc.fetch[n_fetch] = e
            n_fetch += 1
    if not p[NORM]:  # the family's weights are probabilities over every expert, not renormalised
        total = 0.0
        if logits:
            for e in range(len(row)):
                total += np.exp(value(row, table, e) - sc.order_v[0])
        else:
            total = 1.0
    for c in range(n):
        sc.exec_w[c] /= total
    substituted, mass = 0, 0.0
    for j in range(k):
        kept = False
        for c in range(n):
            kept |= sc.exec_e[c] == ids[j]
        if not kept:
            substituted += 1
            mass += w[j]
    return n, n_fetch, 0, substituted, mass
