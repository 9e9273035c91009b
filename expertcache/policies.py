"""Miss policies, the Python side: specs, parsing, validation, the registry, presets and
peers. A policy is selected by a spec string, `name` or `name:key=value,key=value`; it
becomes the parameter vector of the compiled decision (`kernel.policy.decide`), shared by
the engine (a layer at a time) and the replay (a whole trace per call).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import UnknownName
from .kernel.policy import (
    BAND,
    BETA,
    CONDITIONAL,
    FETCH_ALL,
    FIRST_CHOICE,
    HI,
    KIND,
    LO,
    NEVER,
    RULE,
    SUB,
    SUBSTITUTES,
    SUBSTITUTING,
    TAU,
    THRESHOLD,
    TOP_J,
    TOP_M,
    WINDOW,
    Scratch,
    decide,
)


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



class MissPolicy:
    """Base: fetch every miss. Output identical to the full model."""
    name = "fetch-all"
    kind = FETCH_ALL
    eviction = "lru"  # the eviction order this policy prefers unless one is given

    def __init__(self):
        self.account: np.ndarray | None = None  # [L, E] substituted mass towards admission

    def params(self) -> np.ndarray:
        p = np.zeros(10)
        p[KIND] = self.kind
        return p

    def bind(self, num_layers: int, num_experts: int) -> np.ndarray:
        """The per-expert state `decide` carries between calls, sized for a model."""
        if self.account is None or self.account.shape != (num_layers, num_experts):
            self.account = np.zeros((num_layers, num_experts))
        return self.account

    def reset(self) -> None:
        """Forget state carried between calls (start of a run)."""
        if self.account is not None:
            self.account[:] = 0.0

    def decide(self, route: Route, cache) -> Decision:
        """One decision against `cache` (an ExpertCache), without changing the cache: the
        compiled `decide` seen from Python, for tests and exploration."""
        st, E = cache.state, cache.shape.num_experts
        sc = Scratch.make(len(route.experts), E)
        sc.gate_row[:] = route.probs  # probabilities rank and weigh alike
        n_exec, n_fetch, n_admit, subst, mass = decide(
            self.params(), self.bind(cache.shape.num_layers, E), st, sc, route.layer,
            np.asarray(route.probs, np.float32), None, False, np.asarray(route.experts, np.int64),
            np.asarray(route.weights, np.float32))
        return Decision(sc.exec_e[:n_exec].tolist(), sc.exec_w[:n_exec].tolist(), sc.fetch[:n_fetch].tolist(),
                        sc.admit[:n_admit].tolist(), subst, mass)

    def __repr__(self) -> str:
        return self.name


class SubstitutingPolicy(MissPolicy):
    """Substitutes the misses its rule declines to fetch.

    sub=best: the best-ranked resident expert (by router probability) not already selected
    for the token runs in the missed expert's place with its weight; sub=drop: the miss is
    dropped and the kept weights renormalised; sub=window: like best, but only within the
    router's top-`window` ranks. A miss with no resident substitute is fetched. An expert
    already in flight (prefetched, admitted) is waited for, never substituted: cheaper than
    a new fetch, and exact.
    beta > 0: background admission; each expert accumulates the gate mass it was substituted
    with and is admitted off the critical path once that reaches beta.
    """
    kind, rule = SUBSTITUTING, NEVER

    def __init__(self, sub: str = "best", window: float = 0, beta: float = 0.0):
        super().__init__()
        if sub not in SUBSTITUTES:
            raise UnknownName(f"unknown substitute choice {sub!r}; choose one of {', '.join(SUBSTITUTES)}")
        if sub == "window" and window < 1:
            raise UnknownName("sub=window needs window=M (the router's top-M ranks), e.g. window=16")
        self.sub, self.window, self.beta = sub, int(window), float(beta)

    def params(self) -> np.ndarray:
        p = super().params()
        p[RULE], p[SUB], p[WINDOW], p[BETA] = self.rule, SUBSTITUTES.index(self.sub), self.window, self.beta
        return p


class SubstituteAll(SubstitutingPolicy):
    name = "substitute-all"


class ThresholdRule(SubstitutingPolicy):
    """Fetch a miss if it is the first choice or its gate weight is >= tau."""
    name, rule = "threshold", THRESHOLD

    def __init__(self, tau: float = 0.15, **kw):
        super().__init__(**kw)
        self.tau = tau

    def params(self):
        p = super().params()
        p[TAU] = self.tau
        return p

    def __repr__(self):
        return f"{self.name}(tau={self.tau:g})"


class FirstChoice(SubstitutingPolicy):
    """Fetch only a missed first choice."""
    name, rule = "first-choice", FIRST_CHOICE


class WeightBand(SubstitutingPolicy):
    """Substitute exactly the misses whose gate weight lies in [lo, hi), first choices
    included; fetch the rest. Used to compare few heavy against many light substitutions."""
    name, rule = "band", BAND

    def __init__(self, lo: float = 0.0, hi: float = 1.01, **kw):
        super().__init__(**kw)
        self.lo, self.hi = lo, hi

    def params(self):
        p = super().params()
        p[LO], p[HI] = self.lo, self.hi
        return p

    def __repr__(self):
        return f"band(lo={self.lo:g},hi={self.hi:g})"


class CacheConditional(MissPolicy):
    """Cache-conditional routing: keep the router's top-j (fetched if missing) and fill the
    other k-j places with the best-ranked resident experts within the top-m, fetching in rank
    order when too few are resident. Kept weights are the router's, renormalised."""
    name, kind = "conditional", CONDITIONAL

    def __init__(self, j: float = 2, m: float = 16):
        super().__init__()
        self.j, self.m = int(j), int(m)

    def params(self):
        p = super().params()
        p[TOP_J], p[TOP_M] = self.j, self.m
        return p

    def __repr__(self):
        return f"conditional(j={self.j},m={self.m})"


POLICIES: dict[str, type[MissPolicy]] = {
    p.name: p for p in (MissPolicy, SubstituteAll, ThresholdRule, FirstChoice, WeightBand, CacheConditional)}
# name -> (policy spec, eviction): the quality- and speed-first presets
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
