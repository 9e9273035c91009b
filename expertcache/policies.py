"""Miss policies: for one MoE call (one token at one layer), which routed experts run,
which misses are fetched now, which are substituted by which resident expert, and what
is admitted in the background. The engine, the emulation and the simulator share them.

A policy is selected by a spec string, `name` or `name:key=value,key=value`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import UnknownName


@dataclass
class Route:
    """The router's verdict for one token at one layer."""
    layer: int
    experts: np.ndarray  # [k] expert ids in rank order (rank 0 = first choice)
    weights: np.ndarray  # [k] gate weights, normalised as the family does
    probs: np.ndarray  # [E] the full softmax row


@dataclass
class Decision:
    experts: list[int]  # executed experts, aligned with weights
    weights: list[float]
    fetch: list[int]  # executed experts to make resident before compute (synchronous)
    admit: list[int] = field(default_factory=list)  # experts to admit in the background
    substituted: int = 0  # routed experts replaced or dropped
    substituted_mass: float = 0.0  # their summed gate weight


class CacheView(Protocol):
    def is_resident(self, layer: int, expert: int) -> bool: ...
    def in_flight(self, layer: int, expert: int) -> bool: ...
    def resident_mask(self, layer: int) -> np.ndarray: ...


class MissPolicy:
    """Base: fetch every miss. Output identical to the full model."""
    name = "fetch-all"
    eviction = "lru"  # the eviction order this policy prefers unless one is given
    hits_run_as_routed = True  # when every routed expert is resident, the routed set runs unchanged

    def decide(self, route: Route, cache: CacheView) -> Decision:
        experts = route.experts.tolist()
        fetch = [e for e in experts if not cache.is_resident(route.layer, e)]
        return Decision(experts, route.weights.tolist(), fetch)

    def reset(self) -> None:
        """Forget state carried between calls (start of a run)."""

    def __repr__(self) -> str:
        return self.name


SUBSTITUTES = ("best", "drop", "window")


class SubstitutingPolicy(MissPolicy):
    """Substitutes the misses `should_fetch` declines.

    sub=best: the best-ranked resident expert (by router probability) not already selected
    for the token runs in the missed expert's place with its weight; sub=drop: the miss is
    dropped and the kept weights renormalised; sub=window: like best, but only within the
    router's top-`window` ranks. A miss with no resident substitute is fetched.
    beta > 0: background admission; each expert accumulates the gate mass it was substituted
    with and is admitted off the critical path once that reaches beta.
    """

    def __init__(self, sub: str = "best", window: float = 0, beta: float = 0.0):
        if sub not in SUBSTITUTES:
            raise UnknownName(f"unknown substitute choice {sub!r}; choose one of {', '.join(SUBSTITUTES)}")
        if sub == "window" and window < 1:
            raise UnknownName("sub=window needs window=M (the router's top-M ranks), e.g. window=16")
        self.sub, self.window, self.beta = sub, int(window), float(beta)
        self.account: dict[tuple[int, int], float] = {}

    def reset(self) -> None:
        self.account.clear()

    def should_fetch(self, rank: int, weight: float) -> bool:
        return False

    def decide(self, route: Route, cache: CacheView) -> Decision:
        layer, k = route.layer, len(route.experts)
        routed, weights = route.experts.tolist(), route.weights.tolist()
        resident = [cache.is_resident(layer, e) for e in routed]
        if all(resident):
            return Decision(routed, weights, [])
        # An expert already in flight (prefetched, admitted) is waited for: cheaper than a
        # new fetch and exact, so it is never substituted.
        missed = [j for j in range(k) if not resident[j] and not cache.in_flight(layer, routed[j])
                  and not self.should_fetch(j, weights[j])]
        fetch = [routed[j] for j in range(k) if not resident[j] and j not in missed]
        experts = {j: routed[j] for j in range(k) if j not in missed}
        if missed and self.sub == "drop" and not experts:  # nothing would be left: fetch the first choice
            experts[missed[0]] = routed[missed[0]]
            fetch.append(routed[missed.pop(0)])
        substituted, mass, admit = 0, 0.0, []
        if missed and self.sub != "drop":
            usable = cache.resident_mask(layer).copy()
            usable[routed] = False  # never a second copy of an expert the token already routes to
            if self.sub == "window":
                inside = np.zeros_like(usable)
                inside[np.argsort(-route.probs, kind="stable")[: self.window]] = True
                usable &= inside
            candidates = np.where(usable, route.probs, -1.0)
            for j in missed:
                best = int(candidates.argmax())
                if candidates[best] < 0:  # no resident expert left to substitute: fetch
                    experts[j] = routed[j]
                    fetch.append(routed[j])
                    continue
                candidates[best] = -1.0
                experts[j] = best
                substituted += 1
                mass += weights[j]
                admit += self._account(layer, routed[j], weights[j])
        elif missed:  # drop and renormalise
            substituted, mass = len(missed), sum(weights[j] for j in missed)
            for j in missed:
                admit += self._account(layer, routed[j], weights[j])
        order = sorted(experts)
        kept = [weights[j] for j in order]
        if self.sub == "drop" and missed:
            total = sum(kept)
            kept = [w / total for w in kept]
        return Decision([experts[j] for j in order], kept, fetch, admit, substituted, mass)

    def _account(self, layer: int, expert: int, weight: float) -> list[int]:
        if self.beta <= 0:
            return []
        key = (layer, expert)
        total = self.account.get(key, 0.0) + weight
        if total >= self.beta:
            self.account[key] = 0.0
            return [expert]
        self.account[key] = total
        return []


class SubstituteAll(SubstitutingPolicy):
    name = "substitute-all"


class ThresholdRule(SubstitutingPolicy):
    """Fetch a miss if it is the first choice or its gate weight is >= tau."""
    name = "threshold"

    def __init__(self, tau: float = 0.15, **kw):
        super().__init__(**kw)
        self.tau = tau

    def should_fetch(self, rank, weight):
        return rank == 0 or weight >= self.tau

    def __repr__(self):
        return f"{self.name}(tau={self.tau:g})"


class FirstChoice(SubstitutingPolicy):
    """Fetch only a missed first choice."""
    name = "first-choice"

    def should_fetch(self, rank, weight):
        return rank == 0


class WeightBand(SubstitutingPolicy):
    """Substitute exactly the misses whose gate weight lies in [lo, hi), first choices
    included; fetch the rest. Used to compare few heavy against many light substitutions."""
    name = "band"

    def __init__(self, lo: float = 0.0, hi: float = 1.01, **kw):
        super().__init__(**kw)
        self.lo, self.hi = lo, hi

    def should_fetch(self, rank, weight):
        return not self.lo <= weight < self.hi

    def __repr__(self):
        return f"band(lo={self.lo:g},hi={self.hi:g})"


class CacheConditional(MissPolicy):
    """Cache-conditional routing: keep the router's top-j (fetched if missing) and fill the
    other k-j places with the best-ranked resident experts within the top-m, fetching in rank
    order when too few are resident. Kept weights are the router's, renormalised."""
    name = "conditional"
    hits_run_as_routed = False  # it renormalises the router's probabilities itself

    def __init__(self, j: float = 2, m: float = 16):
        self.j, self.m = int(j), int(m)

    def decide(self, route: Route, cache: CacheView) -> Decision:
        layer, k = route.layer, len(route.experts)
        order = np.argsort(-route.probs, kind="stable")[: max(self.m, k)]
        chosen = [int(e) for e in order[: self.j]]
        resident = cache.resident_mask(layer)
        chosen += [int(e) for e in order[self.j:] if resident[e]][: k - len(chosen)]
        chosen += [int(e) for e in order[self.j:] if int(e) not in chosen][: k - len(chosen)]
        probs = route.probs[chosen]
        weights = (probs / probs.sum()).tolist()
        dropped = [j for j, e in enumerate(route.experts.tolist()) if e not in chosen]
        fetch = [e for e in chosen if not cache.is_resident(layer, e)]
        return Decision(chosen, weights, fetch, [], len(dropped), float(route.weights[dropped].sum()))

    def __repr__(self):
        return f"conditional(j={self.j},m={self.m})"


POLICIES: dict[str, type[MissPolicy]] = {
    p.name: p for p in (MissPolicy, SubstituteAll, ThresholdRule, FirstChoice, WeightBand, CacheConditional)}
# name -> (policy spec, eviction): the seed's presets
PRESETS = {"quality-first": ("threshold:tau=0.15,beta=0.5", "freq"),
           "speed-first": ("first-choice:beta=0.5", "freq"),
           # peers' caches, by the eviction order each uses with fetch-on-miss
           "mixtral-offloading": ("fetch-all", "lru"),  # per-layer LRU
           "moe-infinity": ("fetch-all", "lfu"),  # least frequently used
           "llama.cpp": ("fetch-all", "halving")}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UnknownName(f"policy parameter {item!r} in {spec!r} is not key=value; e.g. threshold:tau=0.15")
        params[key.strip()] = value.strip()
    return name.strip(), params


def make_policy(spec: str) -> MissPolicy:
    name, params = parse_spec(spec)
    if name in PRESETS:
        preset_spec, eviction = PRESETS[name]
        policy = make_policy(preset_spec + "".join(f",{k}={v}" for k, v in params.items()))
        policy.eviction, policy.name = eviction, name
        return policy
    if name not in POLICIES:
        raise UnknownName(f"unknown policy {name!r}; choose one of {', '.join([*POLICIES, *PRESETS])}")
    cls = POLICIES[name]
    try:
        return cls(**{k: (v if k == "sub" else float(v)) for k, v in params.items()})
    except (TypeError, ValueError) as e:
        raise UnknownName(f"bad parameters for policy {name!r} ({e}); see `expertcache --help`") from None
