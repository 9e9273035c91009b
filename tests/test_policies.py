"""Each policy's decision on hand-made router rows and cache states."""
import numpy as np
import pytest

from expertcache.errors import UnknownName
from expertcache.eviction import make_eviction
from expertcache.policies import Route, make_policy


class Resident:
    """A cache view: which experts of layer 0 are resident (and which are in flight)."""

    def __init__(self, E, resident, flying=()):
        self.mask = np.zeros(E, dtype=bool)
        self.mask[list(resident)] = True
        self.flying = set(flying)

    def is_resident(self, layer, e):
        return bool(self.mask[e]) and e not in self.flying

    def in_flight(self, layer, e):
        return e in self.flying

    def resident_mask(self, layer):
        m = self.mask.copy()
        m[list(self.flying)] = False
        return m


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
    assert p.account[(0, 1)] == pytest.approx(R.weights[1])  # reset at admission, then one more call


def test_presets():
    q, s = make_policy("quality-first"), make_policy("speed-first")
    assert (q.tau, q.beta, q.eviction) == (0.15, 0.5, "freq")
    assert (s.beta, s.eviction, type(s).__name__) == (0.5, "freq", "FirstChoice")


@pytest.mark.parametrize("spec", ["nope", "threshold:tau", "threshold:tau=x", "first-choice:sub=odd",
                                  "substitute-all:sub=window"])
def test_bad_specs(spec):
    with pytest.raises(UnknownName):
        make_policy(spec)


def test_eviction_orders():
    slots = np.arange(4)
    none = np.zeros(4, dtype=bool)
    for name in ["lru", "lfu", "freq"]:
        ev = make_eviction(name, 4)
        for t, s in enumerate([0, 1, 2, 3]):
            ev.clock = t
            ev.insert(s)
            ev.touch(s)
        for t, s in enumerate([0, 0, 0, 1], start=4):  # 0 used often, 1 once more, 2 and 3 never again
            ev.clock = t
            ev.touch(s)
        ev.clock = 8
        expected = {"lru": 2, "lfu": 2, "freq": 2}[name]
        assert ev.victim(slots, none) == expected, name
        blocked = none.copy()
        blocked[2] = True
        assert ev.victim(slots, blocked) == 3, name  # next least recent / least frequent
    lru, lfu = make_eviction("lru", 3), make_eviction("lfu", 3)
    for ev in (lru, lfu):
        for t, s in enumerate([0, 0, 0, 1, 2]):
            ev.clock = t
            ev.touch(s)
    assert lru.victim(np.arange(3), np.zeros(3, bool)) == 0  # least recent
    assert lfu.victim(np.arange(3), np.zeros(3, bool)) == 1  # fewest uses, older of the tied


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
    ev = make_eviction("halving", 2)
    for t in range(3):  # slot 0 used 3 times at tokens 0..2
        ev.clock = t
        ev.touch(0)
    ev.clock = 300
    ev.touch(1)  # slot 1 once, recently
    assert ev.victim(np.arange(2), np.zeros(2, bool)) == 0  # slot 0: 3 halved twice = 0.75 < 1
    ev.clock = 310
    assert ev.score(np.arange(2))[1] == 1.0  # no period boundary crossed since its use
    ev.clock = 130  # before slot 1's use, compare at a clock where 0 was halved once: 1.5
    assert ev.score(np.arange(1))[0] == pytest.approx(1.5)
