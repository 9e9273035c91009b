"""Each policy's decision and each eviction order on hand-made router rows and cache states."""
import numpy as np
import pytest
import torch

from expertcache.engine.cache import CacheConfig, ExpertCache
from expertcache.engine.stores import ExpertShape
from expertcache.errors import BadInput, UnknownName
from expertcache.kernel.eviction import (
    DECAY,
    EVICTIONS,
    add_demand,
    advance,
    enter_score,
    eviction_code,
    insert,
    touch,
    victim,
)
from expertcache.policies import Route, make_policy


def Resident(E, resident, flying=()):
    """A virtual one-layer cache holding `resident` experts, of which `flying` are still in flight."""
    shape = ExpertShape(1, E, (4, 2), (2, 2))
    cache = ExpertCache(CacheConfig(fraction=1.0), None, 4, None, torch.float32, shape=shape, fetch_bytes=1)
    cache.fill(0, list(resident))
    for e in flying:
        cache.state.pending[cache.slot_of[0, e]] = True
    return cache


def row(probs, k):
    """A route from a full probability row: top-k in rank order, renormalised."""
    p = np.array(probs, dtype=np.float32)
    ids = np.argsort(-p, kind="stable")[:k]
    return Route(0, ids, p[ids] / p[ids].sum(), p)


# experts 0..7; the router ranks 3 > 1 > 6 > 4 > 0 > ...; top-4 = [3, 1, 6, 4]
PROBS = [0.06, 0.25, 0.02, 0.35, 0.09, 0.01, 0.20, 0.02]
R = row(PROBS, 4)  # weights: 3: .393, 1: .281, 6: .225, 4: .101


def test_fetch_all_fetches_every_miss():
    d = make_policy("fetch-all").decide(R, Resident(8, [1, 4]))
    assert d.experts == [3, 1, 6, 4] and d.fetch == [3, 6] and d.substituted == 0
    np.testing.assert_allclose(d.weights, R.weights)


def test_substitute_all_uses_best_ranked_resident_with_the_missed_weight():
    # resident: 1, 4 (routed) and 0, 7, 2 (not routed; by probability 0 > 2 = 7)
    d = make_policy("substitute-all").decide(R, Resident(8, [1, 4, 0, 7, 2]))
    assert d.fetch == []
    assert d.experts == [0, 1, 2, 4]  # 3 -> 0 (best), 6 -> 2 (next best; ties by id order of argmax)
    np.testing.assert_allclose(d.weights, R.weights)  # substitutes carry the missed weights
    assert d.substituted == 2
    assert d.substituted_mass == pytest.approx(R.weights[0] + R.weights[2])


def test_no_resident_substitute_left_means_fetch():
    d = make_policy("substitute-all").decide(R, Resident(8, [1, 4, 5]))
    assert d.experts == [5, 1, 6, 4] and d.fetch == [6] and d.substituted == 1


def test_threshold_fetches_first_choice_and_heavy_misses():
    d = make_policy("threshold:tau=0.25").decide(R, Resident(8, [0, 2, 5, 7]))
    # 3 is first choice, 1 has .281 >= .25: fetched; 6 (.225) and 4 (.101) substituted by 0 and 2
    assert d.fetch == [3, 1] and d.experts == [3, 1, 0, 2] and d.substituted == 2
    assert d.substituted_mass == pytest.approx(R.weights[2] + R.weights[3])
    d = make_policy("threshold:tau=0.22").decide(R, Resident(8, [0, 2, 5, 7]))
    assert d.fetch == [3, 1, 6] and d.experts == [3, 1, 6, 0]


def test_first_choice_fetches_only_rank_zero():
    d = make_policy("first-choice").decide(R, Resident(8, [0, 2, 5, 7]))
    assert d.fetch == [3] and d.experts == [3, 0, 2, 7] and d.substituted == 3


def test_drop_renormalises_the_kept_weights():
    d = make_policy("threshold:tau=0.3,sub=drop").decide(R, Resident(8, [1]))
    assert d.experts == [3, 1] and d.fetch == [3]
    w = R.weights[:2] / R.weights[:2].sum()
    np.testing.assert_allclose(d.weights, w, rtol=1e-6)
    assert d.substituted == 2 and d.substituted_mass == pytest.approx(R.weights[2:].sum())


def test_drop_keeps_the_routed_total_where_the_family_does_not_renormalise():
    # OLMoE / Qwen2-MoE: gate weights are the router's probabilities, summing to less than 1
    raw = Route(0, R.experts, np.array(PROBS, np.float32)[R.experts], np.array(PROBS))
    d = make_policy("threshold:tau=0.3,sub=drop").fit(4, 8, False).decide(raw, Resident(8, [1]))
    assert d.experts == [3, 1]
    kept = raw.weights[:2] * raw.weights.sum() / raw.weights[:2].sum()  # the routed mass (.89), not 1
    np.testing.assert_allclose(d.weights, kept, rtol=1e-6)


def test_conditional_weights_are_the_familys():
    resident = Resident(8, [4, 0, 7])
    raw = Route(0, R.experts, np.array(PROBS, np.float32)[R.experts], np.array(PROBS))
    d = make_policy("conditional:j=2,m=6").fit(4, 8, False).decide(raw, resident)
    np.testing.assert_allclose(d.weights, np.array(PROBS)[[3, 1, 4, 0]], rtol=1e-6)  # probabilities as they are
    d = make_policy("conditional:j=2,m=6").fit(4, 8, True).decide(R, resident)
    p = np.array(PROBS)[[3, 1, 4, 0]]
    np.testing.assert_allclose(d.weights, p / p.sum(), rtol=1e-6)  # renormalised over the chosen


def test_window_substitutes_only_within_the_top_m():
    # top-5 by probability = [3, 1, 6, 4, 0]; expert 0 is resident and inside, 7 is outside
    d = make_policy("substitute-all:sub=window,window=5").decide(R, Resident(8, [0, 7]))
    assert d.experts == [0, 1, 6, 4] and d.fetch == [1, 6, 4]


def test_in_flight_experts_are_not_substitutes():
    d = make_policy("substitute-all").decide(R, Resident(8, [1, 4, 0, 2], flying=[0]))
    assert d.experts == [2, 1, 6, 4] and d.fetch == [6]  # 0 is still arriving: 2 stands in for 3
    d = make_policy("substitute-all").decide(R, Resident(8, [1, 4, 0, 2, 6], flying=[6]))
    assert d.experts == [0, 1, 6, 4] and d.fetch == [6]  # routed 6 is arriving: waited for, not substituted


def test_background_admission_after_beta_of_substituted_mass():
    p = make_policy("first-choice:beta=0.5")
    cache = Resident(8, [3, 0, 2, 7, 5])  # 1, 6, 4 miss and are substituted
    admitted = [p.decide(R, cache).admit for _ in range(3)]
    # expert 1 is substituted with .281 per call: reaches .5 on the 2nd call; 6 (.225) on the 3rd
    assert admitted == [[], [1], [6]]
    assert p.account[0, 1] == pytest.approx(R.weights[1])  # reset at admission, then one more call


def test_presets():
    q, s = make_policy("quality-first"), make_policy("speed-first")
    assert (q.tau, q.beta, q.eviction) == (0.15, 0.5, "demand")
    assert (s.beta, s.eviction, type(s).__name__) == (0.5, "demand", "FirstChoice")


@pytest.mark.parametrize("spec", ["nope", "threshold:tau", "first-choice:sub=odd", "substitute-all:sub=window"])
def test_bad_specs(spec):
    with pytest.raises(UnknownName):
        make_policy(spec)
    with pytest.raises(BadInput, match="tau='x' is not a number"):
        make_policy("threshold:tau=x")


class Order:
    """One eviction order over S slots of one layer, driven token by token."""

    def __init__(self, name, S):
        self.kind, self.S = eviction_code(name), S
        self.score, self.last_use, self.clock = np.zeros(S), np.full(S, -1), np.zeros(1, dtype=np.int64)

    def at(self, t):
        advance(self.kind, self.score, self.clock, 0, 0, self.S, t)
        self.t = t
        return self

    def insert(self, slot):
        insert(self.score, self.last_use, slot, self.t, 0.0)

    def touch(self, slot):
        touch(self.kind, self.score, self.last_use, slot, self.t)

    def victim(self, blocked=()):
        b = np.zeros(self.S, dtype=bool)
        b[list(blocked)] = True
        return victim(self.kind, self.score, self.last_use, b, np.zeros(self.S, dtype=bool), 0, self.S)


def test_eviction_orders():
    for name in ["lru", "lfu", "freq", "halving", "demand"]:
        ev = Order(name, 4)
        for t, s in enumerate([0, 1, 2, 3]):
            ev.at(t).insert(s)
            ev.touch(s)
        for t, s in enumerate([0, 0, 0, 1], start=4):  # 0 used often, 1 once more, 2 and 3 never again
            ev.at(t).touch(s)
        assert ev.at(8).victim() == 2, name
        assert ev.victim(blocked=[2]) == 3, name  # next least recent / least frequent
        assert ev.victim(blocked=[0, 1, 2, 3]) == -1, name
    lru, lfu = Order("lru", 3), Order("lfu", 3)
    for ev in (lru, lfu):
        for t, s in enumerate([0, 0, 0, 1, 2]):
            ev.at(t).touch(s)
    assert lru.victim() == 0  # least recent
    assert lfu.victim() == 1  # fewest uses, older of the tied
    empty = Order("lfu", 3)
    assert empty.victim() == 0  # never used: the lowest slot


def test_demand_entry_score():
    """Under `demand` an expert enters its slot with its decayed routing demand so far (resident
    or not), so a newly admitted expert is not the next victim for being new; `freq` enters at 0."""
    demand, clock = np.zeros((2, 4)), np.zeros((2, 4), np.int64)
    add_demand(demand, clock, 1, 2, 10)
    add_demand(demand, clock, 1, 2, 12)
    assert enter_score(EVICTIONS["demand"], demand, clock, 1, 2, 15) == pytest.approx((DECAY ** 2 + 1) * DECAY ** 3)
    assert enter_score(EVICTIONS["freq"], demand, clock, 1, 2, 15) == 0.0
    assert enter_score(EVICTIONS["demand"], demand, clock, 0, 2, 15) == 0.0  # another layer's expert
    ev = Order("demand", 3)
    for t, s in enumerate([0, 1]):
        ev.at(t).insert(s)
        ev.touch(s)
    ev.at(5)
    insert(ev.score, ev.last_use, 2, 5, enter_score(EVICTIONS["demand"], demand, clock, 1, 2, 5))
    assert ev.victim() == 0  # the old, once-used slot goes before the admitted expert with demand


def test_cache_conditional_routing():
    # top-2 (3, 1) kept; the other two places go to resident experts within the top-6: 4 and 0
    d = make_policy("conditional:j=2,m=6").decide(R, Resident(8, [4, 0, 7]))
    assert d.experts == [3, 1, 4, 0] and d.fetch == [3, 1]
    p = np.array(PROBS)[[3, 1, 4, 0]]
    np.testing.assert_allclose(d.weights, p / p.sum(), rtol=1e-6)
    assert d.substituted == 1 and d.substituted_mass == pytest.approx(R.weights[2])  # expert 6 dropped
    # too few resident in the window: fetch in rank order
    d = make_policy("conditional:j=2,m=6").decide(R, Resident(8, [7]))
    assert d.experts == [3, 1, 6, 4] and d.fetch == [3, 1, 6, 4]


def test_halving_scores_halve_every_period():
    ev = Order("halving", 2)
    for t in range(3):  # slot 0 used 3 times at tokens 0..2
        ev.at(t).touch(0)
    ev.at(300).touch(1)  # slot 1 once, recently
    assert ev.victim() == 0  # slot 0: 3 halved twice = 0.75 < 1
    assert ev.score[0] == 0.75
    ev.at(310)
    assert ev.score[1] == 1.0  # no period boundary crossed since its use
    fresh = Order("halving", 1)
    for t in range(3):
        fresh.at(t).touch(0)
    assert fresh.at(130).score[0] == pytest.approx(1.5)  # one boundary crossed


def test_decayed_frequency_fades_per_token():
    ev = Order("freq", 2)
    ev.at(0).touch(0)
    ev.touch(0)  # 2 uses at token 0
    ev.at(40).touch(1)  # 1 use at token 40: 2 * 0.98^40 = 0.89 < 1
    assert ev.score[0] == pytest.approx(2 * 0.98 ** 40)
    assert ev.victim() == 0


def test_global_quota_substitutes_within_the_layer():
    shape = ExpertShape(2, 8, (4, 2), (2, 2))
    cache = ExpertCache(CacheConfig(fraction=0.5, quota="global"), None, 4, None, torch.float32, shape=shape,
                        fetch_bytes=1)
    cache.fill(1, [0, 2, 5, 7])  # another layer's experts: never substitutes for layer 0
    cache.fill(0, [1, 4, 2])
    d = make_policy("substitute-all").decide(R, cache)
    assert d.experts == [2, 1, 6, 4] and d.fetch == [6] and d.substituted == 1  # 3 -> 2; none left for 6


def test_lowbit_fetches_light_misses_as_small_copies():
    # 3 first choice and 1 (.281 >= .25): full; 6 (.225) and 4 (.101): small copies; nothing substituted
    d = make_policy("lowbit:tau=0.25").decide(R, Resident(8, [0, 2, 5, 7]))
    assert d.fetch == [3, 1, 6, 4] and d.experts == [3, 1, 6, 4] and d.substituted == 0
    assert d.low == [False, False, True, True]
    np.testing.assert_allclose(d.weights, R.weights)


def test_lowbit_three_way_substitutes_below_lo():
    # 6 (.225) is between lo and tau: small copy; 4 (.101) below lo=0.15: substituted by resident 0
    d = make_policy("lowbit:tau=0.25,lo=0.15").decide(R, Resident(8, [0, 2, 5, 7]))
    assert d.fetch == [3, 1, 6] and d.low == [False, False, True]
    assert d.experts == [3, 1, 6, 0] and d.substituted == 1
    assert d.substituted_mass == pytest.approx(R.weights[3])


def test_lowbit_keeps_hits_and_in_flight_experts():
    # 1 resident, 6 in flight: waited for, never fetched again; 4 light: small copy
    d = make_policy("lowbit:tau=0.3").decide(R, Resident(8, [1, 6, 0], flying=[6]))
    assert d.fetch == [3, 6, 4] and d.low == [False, False, True] and d.substituted == 0


def _decide_one(cache, spec, probs, k=4):
    """One token's decision at layer 0 by the compiled layer loop: the logged actions and the counters."""
    from expertcache.kernel import decisions
    from expertcache.kernel.cache_state import COUNTERS
    from expertcache.kernel.routing import Routing, route_logits
    rows, weights, ids = route_logits(np.log(np.array([probs], np.float32)), k, True)
    out = np.empty((1, k), np.int64), np.empty((1, k), np.int64), np.empty((1, k), np.float32)
    policy = make_policy(spec).fit(k, len(probs), True)
    if policy.fetches_small:
        cache.small = "virtual"  # a virtual cache moves no bytes: its small copies are bookkeeping only
    cache.decide(policy, 0, Routing(rows, rows, weights, ids), 0, *out)
    log = cache._take_log()
    counts = dict(zip(COUNTERS, cache.state.counts.tolist()))
    return [(decisions.KINDS[c] if op == decisions.LOAD else op, a) for op, a, _, c in log], counts


@pytest.mark.parametrize("spec, upgraded", [("lowbit:tau=0.25,upgrade=1", True), ("lowbit:tau=0.25", False)])
def test_lowbit_upgrades_a_small_copy_that_a_hit_would_fetch_in_full(spec, upgraded):
    """Expert 3, the first choice, is resident as its small copy: with upgrade=1 the token runs
    it as it is, its expert work is flushed, and then the full copy is read into the same slot
    in the background; expert 6 (.225 < tau), also small, stays small."""
    from expertcache.kernel import decisions
    cache = Resident(8, [3, 1, 6, 4])
    s3, s6 = cache.slot_of[0, 3], cache.slot_of[0, 6]
    cache.state.low[[s3, s6]] = True
    log, counts = _decide_one(cache, spec, PROBS)
    assert counts["lowbit_uses"] == 2  # 3 and 6 ran from their small copies this token, upgraded or not
    if upgraded:
        assert log == [(decisions.FLUSH, s3), ("upgrade", s3)]  # the slot's work runs before the full copy lands
        assert counts["upgrades"] == counts["background_fetches"] == 1 and counts["sync_fetches"] == 0
        assert not cache.state.low[s3] and cache.state.pending[s3] and cache.state.low[s6]
    else:
        assert log == [] and counts["upgrades"] == 0 and cache.state.low[s3]


class RecordedTransfers:
    """A virtual cache's transfers that record the order of submissions, flushes and waits, and fail
    the wait for expert `failing`."""

    def __init__(self, failing=None):
        from expertcache.engine.transfer import InstantTransfers
        self.inner, self.events, self.failing, self.queued = InstantTransfers(), [], failing, False

    def submit(self, layer, expert, slot, kind, here=False):
        self.events.append((kind, expert))
        self.queued = True
        return self.inner.submit(layer, expert, slot, kind, here)

    def flush(self):
        if self.queued:  # a flush with nothing queued starts nothing
            self.events.append("flush")
        self.queued = False

    def wait(self, t):
        self.events.append(("wait", t.expert))
        if t.expert == self.failing:
            raise OSError(5, "Input/output error")
        return 0.0


def test_admissions_start_after_the_calls_fetches_have_landed():
    """A token fetches 3, 1 and 6 and admits 4 (substituted with .101 >= beta): the admission's read
    starts once the fetches have landed, so it does not share the slow tier with them."""
    from expertcache.kernel import decisions
    from expertcache.kernel.cache_state import N_LOG
    from expertcache.kernel.routing import Routing, route_logits
    cache = Resident(8, [0, 2, 5, 7])
    cache.transfers = RecordedTransfers()
    rows, weights, ids = route_logits(np.log(np.array([PROBS], np.float32)), 4, True)
    out = np.empty((1, 4), np.int64), np.empty((1, 4), np.int64), np.empty((1, 4), np.float32)
    cache.decide(make_policy("threshold:tau=0.15,beta=0.1").fit(4, 8, True), 0, Routing(rows, rows, weights, ids),
                 0, *out)
    logged = [(decisions.KINDS[c], b) for op, _, b, c in cache.state.log[:cache.state.misc[N_LOG]].tolist()
              if op == decisions.LOAD]
    assert logged == [("fetch", 3), ("fetch", 1), ("fetch", 6), ("admit", 4)]  # logged before the waits
    cache.carry_out()
    assert cache.transfers.events == [("fetch", 3), ("fetch", 1), ("fetch", 6), "flush", ("wait", 3), ("wait", 1),
                                      ("wait", 6), ("admit", 4), "flush"]
    assert cache.slot_of[0, 4] >= 0 and 4 in [t.expert for t in cache.pending.values()]


def test_an_admission_that_the_window_waits_for_starts_with_the_fetches():
    """In a window the next token waits for what the previous one admitted: held back, the admission's read
    would start only after the fetches and then stall that token, so it goes to the disk with them."""
    from expertcache.kernel.routing import Routing, route_logits
    cache = Resident(8, [0, 2, 5, 7])
    cache.transfers = RecordedTransfers()
    rows, weights, ids = route_logits(np.log(np.array([PROBS, PROBS], np.float32)), 4, True)
    out = np.empty((2, 4), np.int64), np.empty((2, 4), np.int64), np.empty((2, 4), np.float32)
    cache.decide(make_policy("threshold:tau=0.15,beta=0.1").fit(4, 8, True), 0, Routing(rows, rows, weights, ids),
                 0, *out)
    cache.carry_out()
    assert cache.transfers.events == [("fetch", 3), ("fetch", 1), ("fetch", 6), ("admit", 4), "flush", ("wait", 3),
                                      ("wait", 1), ("wait", 6), ("wait", 4)]


def test_a_failed_fetch_leaves_the_held_admission_unmapped():
    from expertcache.kernel.routing import Routing, route_logits
    cache = Resident(8, [0, 2, 5, 7])
    cache.transfers = RecordedTransfers(failing=1)
    rows, weights, ids = route_logits(np.log(np.array([PROBS], np.float32)), 4, True)
    out = np.empty((1, 4), np.int64), np.empty((1, 4), np.int64), np.empty((1, 4), np.float32)
    cache.decide(make_policy("threshold:tau=0.15,beta=0.1").fit(4, 8, True), 0, Routing(rows, rows, weights, ids),
                 0, *out)
    with pytest.raises(OSError):
        cache.carry_out()
    assert ("admit", 4) not in cache.transfers.events
    assert cache.slot_of[0, 4] == -1 and cache.slot_of[0, 1] == -1 and not cache.state.pending.any()
    assert not cache.pending


@pytest.mark.parametrize("spec", ["lowbit:tau=0.1,lo=0.2", "lowbit:lo=-1", "lowbit:tau=2", "lowbit:upgrade=2",
                                  "lowbit:upgrade=0.5"])
def test_lowbit_parameters_are_checked(spec):
    with pytest.raises(BadInput, match="out of range|whole number"):
        make_policy(spec)


@pytest.mark.parametrize("name", ["threshold", "lowbit"])
def test_per_layer_tau_decides_each_layer_as_its_own_tau(name):
    """Seeded fuzz over routes and residency: at every layer, a per-layer tau decides exactly as
    that layer's tau given alone."""
    rng = np.random.default_rng(5)
    L, E, k = 4, 16, 4
    shape = ExpertShape(L, E, (4, 2), (2, 2))
    for _ in range(60):
        taus = rng.choice([0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0], L)
        per_layer = make_policy(f"{name}:tau={'/'.join(f'{t:g}' for t in taus)}")
        cache = ExpertCache(CacheConfig(fraction=0.5), None, k, None, torch.float32, shape=shape, fetch_bytes=1)
        for layer in range(L):
            cache.fill(layer, rng.choice(E, E // 2, replace=False).tolist())
        for layer in range(L):
            probs = rng.dirichlet(np.full(E, 0.5)).astype(np.float32)
            ids = np.argsort(-probs, kind="stable")[:k]
            route = Route(layer, ids, probs[ids] / probs[ids].sum(), probs)
            alone = make_policy(f"{name}:tau={taus[layer]:g}")
            assert per_layer.decide(route, cache) == alone.decide(route, cache), (taus, layer)


@pytest.mark.parametrize("spec, words", [("threshold:tau=0.1/x", "not a number"),
                                         ("threshold:tau=0.1/1.5", "out of range"),
                                         ("lowbit:tau=0.1/0.3,lo=0.2", "out of range")])
def test_per_layer_taus_are_checked(spec, words):
    with pytest.raises(BadInput, match=words):
        make_policy(spec)


def test_per_layer_taus_must_number_the_layers():
    with pytest.raises(BadInput, match="3 per-layer taus for a model of 4 MoE layers"):
        make_policy("threshold:tau=0.1/0.2/0.3").bind(4, 16)
    assert make_policy("threshold:tau=0.1/0.2/0.3/0.4").params()[-4:].tolist() == [0.1, 0.2, 0.3, 0.4]
