"""The decision kernel: compiled with numba, the loop that decides one layer's tokens in
order -- the policy's decision, victims, synchronous fetches, background admissions,
eviction bookkeeping and counters -- over the arrays of `cache_state.CacheState`.

The engine runs it a layer at a time and carries out the actions it logs (transfers, waits,
expert compute owed before a slot is overwritten); the simulator runs the same
`decide_token` over a whole trace in one call with logging off. Decisions never depend on
when a transfer lands, only on which transfers are in flight (`pending`), which the engine
updates from its transfers before each layer (`ExpertCache.poll`).

A window of tokens decides as token-by-token decoding would: an expert admitted or
prefetched for token t is resident from token t + 1 (`land_flying` at each token of a
call), as in decode, where a background transfer lands within a token's time. The engine
waits for those transfers at that point (a logged WAIT), so the slot is filled before the
expert work of any later token reads it.
"""
from __future__ import annotations

from .cache_state import (
    BACKGROUND,
    CALL,
    CALL_WAITS,
    EVICTION,
    EXPERT_RUNS,
    EXPOSED_PREFETCHES,
    FETCH_WAITS,
    FLUSHED,
    HITS,
    LOGGING,
    LOWBIT_FETCHES,
    LOWBIT_USES,
    MISSES,
    MOE_CALLS,
    N_FLYING,
    N_LOG,
    N_PROTECTED,
    PREFETCHES,
    ROUTED,
    SEGMENTS,
    SUBSTITUTED_CALLS,
    SUBSTITUTIONS,
    SYNC_FETCHES,
    UPGRADES,
)
from .compiled import compiled
from .eviction import DEMAND, add_demand, advance, enter_score, insert, touch, victim
from .policy import CONDITIONAL, KIND, decide, fetches_miss, resident, wants_upgrade
from .routing import route_row

# Logged actions, rows of (op, a, b, c)
LOAD, WAIT, FLUSH, FINISH_ALL = 1, 2, 3, 4  # LOAD: slot, layer * E + expert, kind; WAIT: slot; FLUSH: slot, end
# lowbit: a synchronous fetch of the small copy; upgrade: the full copy read in the background into
# the slot that holds the small one
KINDS = ("fetch", "admit", "prefetch", "fill", "lowbit", "upgrade")
FETCH, ADMIT, PREFETCH, FILL, LOWBIT, UPGRADE = range(len(KINDS))


def log_capacity(tokens: int, top_k: int, num_experts: int) -> int:
    """Room for the actions of a layer call of `tokens` tokens (per token at most k fetches
    and k admissions, each with a flush and a finish-all, k waits, k waits for the previous
    token's admissions, and k upgrades, each after a flush) and of a fill or a prefetch (at most
    every expert of a layer, each with a flush and a finish-all)."""
    return max(tokens * 10 * top_k, 3 * num_experts) + 1


@compiled
def _log(st, op, a, b, c):
    if st.misc[LOGGING]:
        n = st.misc[N_LOG]
        st.log[n, 0], st.log[n, 1], st.log[n, 2], st.log[n, 3] = op, a, b, c
        st.misc[N_LOG] = n + 1


@compiled
def _protect(st, s):
    if not st.protected[s]:
        st.protected[s] = True
        st.protected_list[st.misc[N_PROTECTED]] = s
        st.misc[N_PROTECTED] += 1


@compiled
def _release(st):
    for i in range(st.misc[N_PROTECTED]):
        st.protected[st.protected_list[i]] = False
    st.misc[N_PROTECTED] = 0


@compiled
def _owe(st, s, call):
    """Slot s has one more entry of work in the current call (`call`) that has not run; the first
    since the call began or the slot was last flushed starts one more expert run: one expert
    applied to a batch of tokens, its weights read once."""
    if st.owes[s] != call:
        st.counts[EXPERT_RUNS] += 1
        st.owes[s], st.owed[s] = call, 0
    st.owed[s] += 1


@compiled
def _flush(st, s, t):
    """Slot s is about to be overwritten: its expert's work for tokens [0, t) of the call runs first.
    The other slots' work waits, for the end of the call or their own flush: a window's expert
    runs are split only where a slot changes hands, not at every eviction."""
    _log(st, FLUSH, s, t, 0)
    st.counts[SEGMENTS] += 1
    # the engine runs a flush's few entries one token at a time: a cost per entry, not an expert run's
    st.counts[EXPERT_RUNS] -= 1
    st.counts[FLUSHED] += st.owed[s]
    st.owes[s] = -1


@compiled
def owes_work(st, layer):
    """Whether a slot of `layer` has work left in the current call (the caller's final pass)."""
    for s in range(st.slot_lo[layer], st.slot_hi[layer]):
        if st.owes[s] == st.misc[CALL]:
            return True
    return False


@compiled
def _land_all(st):
    """Every transfer in flight lands (the engine waits for them); False if none was."""
    flying = False
    for s in range(len(st.pending)):
        flying |= st.pending[s]
        st.pending[s] = False
    if flying:
        _log(st, FINISH_ALL, 0, 0, 0)
    return flying


@compiled
def load(st, layer, e, kind, t, clock):
    """Evict the layer's victim and start a transfer of (layer, e) into it; the slot, or -1
    when every slot the layer may use is needed by the current token."""
    E = st.slot_of.shape[1]
    lo, hi = st.slot_lo[layer], st.slot_hi[layer]
    ev = st.misc[EVICTION]
    s = victim(ev, st.score, st.last_use, st.protected, st.pending, lo, hi)
    if s < 0 and _land_all(st):  # only slots in flight left: let them land
        s = victim(ev, st.score, st.last_use, st.protected, st.pending, lo, hi)
    if s < 0:
        return -1
    if st.owes[s] == st.misc[CALL]:  # its expert still owes work to earlier tokens
        _flush(st, s, t)
    old = st.owner[s]
    if old >= 0:
        st.slot_of.reshape(-1)[old] = -1  # owner is the flat index layer * E + expert
    st.owner[s] = layer * E + e
    st.slot_of[layer, e] = s
    insert(st.score, st.last_use, s, clock, enter_score(ev, st.demand, st.demand_clock, layer, e, clock))
    st.pending[s] = True
    st.low[s] = kind == LOWBIT
    if kind == ADMIT or kind == PREFETCH:
        st.flying[st.misc[N_FLYING]] = s
        st.misc[N_FLYING] += 1
    _log(st, LOAD, s, layer * E + e, kind)
    return s


@compiled
def land_flying(st):
    """A new token: the admissions and prefetches started for earlier tokens of the call have
    landed (the engine waits for any still in flight)."""
    for i in range(st.misc[N_FLYING]):
        s = st.flying[i]
        if st.pending[s]:
            st.pending[s] = False
            _log(st, WAIT, s, 0, 0)
    st.misc[N_FLYING] = 0


@compiled
def _upgrades(st, p, layer, t, ids, w):
    """After token t's decisions: each slot it uses that holds a small copy at a weight the
    policy fetches in full gets the full copy, read into the same slot once the token's expert
    work is done (a flush), in the background like an admission (resident from the next token)."""
    for j in range(len(ids)):
        s = st.slot_of[layer, ids[j]]
        if s >= 0 and st.low[s] and not st.pending[s] and wants_upgrade(p, layer, j, w[j]):
            _flush(st, s, t + 1)
            st.low[s] = False
            st.pending[s] = True
            st.flying[st.misc[N_FLYING]] = s
            st.misc[N_FLYING] += 1
            _log(st, LOAD, s, st.owner[s], UPGRADE)
            st.counts[UPGRADES] += 1
            st.counts[BACKGROUND] += 1  # its bytes and cost are an admission's


@compiled
def _count_demand(st, layer, ids, clock):
    """After the token's loads (an expert fetched now enters with the demand before it)."""
    if st.misc[EVICTION] == DEMAND:
        for j in range(len(ids)):
            add_demand(st.demand, st.demand_clock, layer, ids[j], clock)


@compiled
def decide_token(st, p, account, sc, layer, t, clock, row, table, logits, ranked, w, slots_out, exec_out,
                 gates_out):
    """Token t of the current call at `layer`: decide, load, account. ranked: the router's
    experts in rank order, at least the k routed ones; w [k]: their gate weights. Writes the
    slots, executed experts and gates to the *_out rows [k] (padding has gate 0); returns
    False when the cache is too small for the token."""
    k = len(w)
    ids = ranked[:k]
    ev, cnt = st.misc[EVICTION], st.counts
    _release(st)
    advance(ev, st.score, st.group_clock, st.group[layer], st.slot_lo[layer], st.slot_hi[layer], clock)
    cnt[MOE_CALLS] += 1
    cnt[ROUTED] += k
    call = st.misc[CALL]
    hits = 0
    for j in range(k):
        hits += resident(st, layer, ids[j])
    cnt[HITS] += hits
    if hits == k and p[KIND] != CONDITIONAL:  # every routed expert resident: nothing to decide
        for j in range(k):
            s = st.slot_of[layer, ids[j]]
            touch(ev, st.score, st.last_use, s, clock)
            _protect(st, s)
            _owe(st, s, call)
            cnt[LOWBIT_USES] += st.low[s]
            slots_out[j], exec_out[j], gates_out[j] = s, ids[j], w[j]
        _count_demand(st, layer, ids, clock)
        _upgrades(st, p, layer, t, ids, w)
        return True
    n_exec, n_fetch, n_admit, substituted, mass = decide(p, account, st, sc, layer, row, table, logits, ranked, w)
    cnt[MISSES] += k - hits
    if substituted:
        cnt[SUBSTITUTIONS] += substituted
        cnt[SUBSTITUTED_CALLS] += 1
        st.mass[0] += mass
    for c in range(n_exec):
        s = st.slot_of[layer, sc.exec_e[c]]
        if s >= 0:
            _protect(st, s)
    fetched = cnt[SYNC_FETCHES] + cnt[LOWBIT_FETCHES]
    for f in range(n_fetch):
        e = sc.fetch[f]
        if st.slot_of[layer, e] < 0:
            s = load(st, layer, e, LOWBIT if sc.low[f] else FETCH, t, clock)
            if s < 0:
                return False
            _protect(st, s)
            cnt[LOWBIT_FETCHES if sc.low[f] else SYNC_FETCHES] += 1
    # the call waits once for its fetches, read in parallel
    waits = cnt[SYNC_FETCHES] + cnt[LOWBIT_FETCHES] > fetched
    cnt[FETCH_WAITS] += waits
    st.misc[CALL_WAITS] |= waits
    for a in range(n_admit):  # optional: where every slot is needed by this token (a cache of top-k
        e = sc.admit[a]        # slots), the admission is skipped and the expert's account starts again
        if st.slot_of[layer, e] < 0 and load(st, layer, e, ADMIT, t, clock) >= 0:
            cnt[BACKGROUND] += 1
    for c in range(n_exec):
        s = st.slot_of[layer, sc.exec_e[c]]
        if st.pending[s]:  # fetched now, or still arriving from a prefetch or admission
            _log(st, WAIT, s, 0, 0)
            st.pending[s] = False
        touch(ev, st.score, st.last_use, s, clock)
        _owe(st, s, call)
        cnt[LOWBIT_USES] += st.low[s]
        slots_out[c], exec_out[c], gates_out[c] = s, sc.exec_e[c], sc.exec_w[c]
    for c in range(n_exec, k):  # fewer executed than routed: zero-weight padding
        slots_out[c], exec_out[c], gates_out[c] = slots_out[0], exec_out[0], 0.0
    _count_demand(st, layer, ids, clock)
    _upgrades(st, p, layer, t, ids, w)
    return True


@compiled
def begin_call(st):
    """A new layer call: nothing owes work yet, no actions logged."""
    st.misc[CALL] += 1
    st.misc[N_LOG] = 0
    st.misc[N_FLYING] = 0
    st.misc[CALL_WAITS] = 0


@compiled
def decide_layer(st, p, account, sc, layer, rows, scores, logits, ids, w, token_base, slots, experts, gates):
    """The engine's call: tokens [0, T) of one layer in order. rows [T, E]: router logits when
    `logits`, else a sigmoid router's selection rows with its gate scores [T, E]. Returns 0, or
    -1-t when the cache is too small for token t. The caller runs the expert work that no flush
    ran."""
    begin_call(st)
    for t in range(ids.shape[0]):
        if t:
            land_flying(st)
        if not logits:
            for e in range(scores.shape[1]):
                sc.gate_row[e] = scores[t, e]
        if not decide_token(st, p, account, sc, layer, t, token_base + t, rows[t], None, logits, ids[t], w[t],
                            slots[t], experts[t], gates[t]):
            return -1 - t
    st.counts[SEGMENTS] += owes_work(st, layer)  # the caller's final pass, if it has work
    return 0


@compiled
def _hold(st, layer, experts, held):
    """Mark the slots of the mapped `experts` of `layer` protected (`held`) or not. Called after a call's
    decisions, whose marks no later victim choice needs before the next token's decisions release them all."""
    for e in experts:
        s = st.slot_of[layer, e]
        if s >= 0:
            st.protected[s] = held


@compiled
def prefetch(st, layer, ids, hold, clock):
    """Start transfers of the predicted experts `ids` of `layer` that are not mapped; False when the cache has
    no slot to give. The mapped experts of `hold` (the layer's other predictions) are kept from eviction
    meanwhile: the layer's routes are not yet known when its prefetches evict, so its least recently used slot
    is often one that it is about to use (an oracle's prefetches read ~1 expert a token more than on-demand
    loading that way)."""
    st.misc[N_LOG] = 0
    _hold(st, layer, hold, True)
    held, ok = True, True
    for e in ids:
        if st.slot_of[layer, e] < 0:
            s = load(st, layer, e, PREFETCH, 0, clock)
            if s < 0 and held:  # a cache of few slots: the held ones may go, as before holding
                _hold(st, layer, hold, False)
                held = False
                s = load(st, layer, e, PREFETCH, 0, clock)
            if s < 0:
                ok = False
                break
            st.counts[PREFETCHES] += 1
            st.counts[EXPOSED_PREFETCHES] += st.misc[CALL_WAITS] == 0  # no wait of the call's own hides its cost
    if held:
        _hold(st, layer, hold, False)
    return ok


@compiled
def prefetch_ranked(st, p, layer, ids, w, budget, fetched, confidence, clock, chosen):
    """A decode token's prefetch of its predicted experts ids [>= budget] of `layer` in rank order, with their
    predicted gate weights w: `prefetch` the first `budget` that are not mapped, predicted at a weight of at
    least `confidence` and, with `fetched`, that the policy p would fetch were they misses. The engine's and
    the replay's one path. Returns the transfers started, or -1 when the cache has no slot to give. chosen
    [>= budget] int64 scratch."""
    n = 0
    for j in range(budget):
        if st.slot_of[layer, ids[j]] < 0 and w[j] >= confidence \
                and not (fetched and not fetches_miss(p, layer, j, w[j])):
            chosen[n] = ids[j]
            n += 1
    return n if prefetch(st, layer, chosen[:n], ids[:budget], clock) else -1


@compiled
def prefetch_predicted(st, p, layer, row, norm, budget, fetched, confidence, clock, ids, w, vals, comp, block_max,
                       chosen):
    """A decode token's prefetch straight from its predicted router logits row [E] for `layer` (a softmax
    router without bias), in one call: route the row (ids [k], w [k] <- its top-k in rank order and their
    gate weights, as route_row), then `prefetch_ranked`. vals, comp, block_max: route_row's working arrays."""
    route_row(row, None, norm, ids, vals, w, comp, block_max)
    return prefetch_ranked(st, p, layer, ids, w, budget, fetched, confidence, clock, chosen)


@compiled
def fill(st, layer, experts):
    """Initial residency (transfers logged, nothing counted)."""
    st.misc[N_LOG] = 0
    for e in experts:
        if st.slot_of[layer, e] < 0:
            if load(st, layer, e, FILL, 0, 0) < 0:
                return False
    return True
