"""Miss policies, the Python side: specs, parsing, validation, the registry, presets and
peers. A policy is selected by a spec string, `name` or `name:key=value,key=value`; it
becomes the parameter vector of the compiled decision (`kernel.policy.decide`), shared by
the engine (a layer at a time) and the replay (a whole trace per call).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from .errors import BadInput, UnknownName, did_you_mean
from .kernel.eviction import eviction_code
from .kernel.policy import (
    BAND,
    BETA,
    CONDITIONAL,
    FETCH_ALL,
    FIRST_CHOICE,
    HI,
    KIND,
    LO,
    LOWBIT,
    N_PARAMS,
    NEVER,
    NORM,
    RULE,
    SUB,
    SUBSTITUTES,
    SUBSTITUTING,
    TAU,
    THRESHOLD,
    TOP_J,
    TOP_M,
    UPGRADE,
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
    """One token's decision at one layer: the experts that run and their weights, the fetches, the
    background admissions and what was substituted."""
    experts: list[int]  # executed experts, aligned with weights
    weights: list[float]
    fetch: list[int]  # executed experts to make resident before compute (synchronous)
    admit: list[int] = field(default_factory=list)  # experts to admit in the background
    substituted: int = 0  # routed experts replaced or dropped
    substituted_mass: float = 0.0  # their summed gate weight
    low: list[bool] = field(default_factory=list)  # per fetch: of the expert's low-precision copy


DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)", re.ASCII | re.IGNORECASE)


def checked_number(policy: str, key: str, value, low: float, high: float = math.inf, whole: bool = False,
           above: bool = False) -> float:
    """A policy parameter given as a number or a spec's string, checked: finite, whole if
    `whole`, within [low, high] (low excluded when `above`); BadInput naming it otherwise."""
    try:
        if isinstance(value, bool):  # float(True) is 1.0: a flag given where a number belongs would run as one
            raise TypeError
        if isinstance(value, str) and not DECIMAL.fullmatch(value.strip()):  # float() reads 0_1 as 1.0, and ٠.١
            raise ValueError
        x = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"policy {policy!r}: {key}={value!r} is not a number; e.g. {policy}:{key}={EXAMPLES[key]}") \
            from None
    bounds = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
    inside = lambda v: math.isfinite(v) and not (v <= low if above else v < low) and v <= high  # noqa: E731
    if not inside(x):
        example = float(EXAMPLES[key])  # the usual example, or one inside bounds another parameter set (hi > lo)
        if not inside(example):
            example = (low + high) / 2 if high < math.inf else low + (1 if whole else 0.1)
        raise BadInput(f"policy {policy!r}: {key}={value} is out of range; give a finite {key} {bounds}, "
                       f"e.g. {policy}:{key}={int(example) if whole else round(example, 4):g}")
    if whole and x != int(x):
        raise BadInput(f"policy {policy!r}: {key}={value} must be a whole number, e.g. {policy}:{key}={EXAMPLES[key]}")
    return int(x) if whole else x


def check_params(policy: MissPolicy, p, top_k: int) -> None:
    """BadInput unless `p`, the policy's params(), is a vector the compiled `decide` can trust (it checks no bounds;
    a vector of another length or type read past its end or compiled anew, unknown codes decided nonsense): float64
    [N_PARAMS] (after them, taus a layer), finite, its codes known, tau-like weights in [0, 1], j <= top-k. The
    built-in policies build it so; a subclass's own params() may not."""
    fix = "build it on MissPolicy.params() (kernel/policy.py names its entries)"
    if not isinstance(p, np.ndarray) or p.dtype != np.float64 or p.ndim != 1 or len(p) < N_PARAMS:
        got = f"{p.dtype} {p.shape}" if isinstance(p, np.ndarray) else type(p).__name__
        raise BadInput(f"policy {policy!r}: params() must be a float64 vector of {N_PARAMS} entries, not {got}; {fix}")
    codes = {"kind": (KIND, (FETCH_ALL, SUBSTITUTING, CONDITIONAL)), "rule": (RULE, (NEVER, THRESHOLD, FIRST_CHOICE,
             BAND, LOWBIT)), "sub": (SUB, range(len(SUBSTITUTES)))}
    weights = [TAU, LO, *range(N_PARAMS, len(p))]  # weights the rules compare gate weights with
    for name, (i, known) in codes.items():
        if p[i] not in known:
            raise BadInput(f"policy {policy!r}: params() has {name} {p[i]:g}, not one of {list(known)}; {fix}")
    if not np.isfinite(p).all() or not ((0 <= p[weights]) & (p[weights] <= 1)).all() or p[BETA] < 0 or \
            (p[KIND] == CONDITIONAL and not (0 <= p[TOP_J] <= top_k and p[TOP_J] == int(p[TOP_J]))):
        raise BadInput(f"policy {policy!r}: params() {p.tolist()} has a value out of range (finite; tau and lo in "
                       f"[0, 1], beta >= 0, j a whole number <= top-k={top_k}); {fix}")


EXAMPLES = {"tau": "0.15", "lo": "0.1", "hi": "0.3", "beta": "0.5", "window": "16", "j": "2", "m": "16",
            "upgrade": "1"}


class MissPolicy:
    """Base: fetch every miss. Output identical to the full model."""
    name = "fetch-all"
    kind = FETCH_ALL
    eviction = "lru"  # the eviction order this policy prefers unless one is given
    parameters: tuple[str, ...] = ()  # the keys its spec takes
    fetches_small = False  # some misses fetch the expert's low-precision copy (a second store)
    spec = ""  # the spec make_policy read, every option in it (what statistics lines name the policy by)
    named_eviction: str | None = None  # the spec's own eviction=ORDER, which no other order may override
    engine = None  # a weak reference to the Engine that bound it (Engine._fit): its `account` is that engine's run's

    def __init__(self):
        self.account: np.ndarray | None = None  # [L, E] substituted mass towards admission
        self.norm_topk = True  # the model's gate normalisation (`fit`): top-k renormalised or not
        self.fitted: tuple[int, int] | None = None  # (top_k, experts) of the router `fit` checked it against

    def __getstate__(self) -> dict:
        """Pickled without the engine that bound it (a weak reference, which pickle refuses): another process's
        copy belongs to no engine there."""
        return {k: v for k, v in self.__dict__.items() if k != "engine"}

    def params(self) -> np.ndarray:
        """The parameter vector [N_PARAMS] float64 the compiled `decide` reads."""
        p = np.zeros(N_PARAMS)
        p[KIND] = self.kind
        p[NORM] = self.norm_topk
        return p

    def check(self, top_k: int, num_experts: int) -> None:
        """Raise BadInput when a parameter does not fit a model that routes each token to
        `top_k` of `num_experts` experts per layer (the compiled `decide` relies on it)."""

    def fit(self, top_k: int, num_experts: int, norm_topk: bool) -> MissPolicy:
        """Check the parameters against the model's router and take up its gate normalisation
        (`norm_topk`: the top-k weights renormalised to 1, or probabilities over all experts);
        returns self. The engine and the replay call it before the first decision."""
        if type(self).decide is not MissPolicy.decide:  # a subclass's own would be silently ignored
            raise BadInput(f"policy {self!r} overrides decide(), which the engine never calls: it runs the compiled "
                           "decision on params(); give the policy as its params() vector instead")
        self.check(top_k, num_experts)
        self.norm_topk = bool(norm_topk)
        check_params(self, self.params(), top_k)
        self.fitted = (top_k, num_experts)
        return self

    def bind(self, num_layers: int, num_experts: int) -> np.ndarray:
        """The per-expert state `decide` carries between calls, sized for a model (BadInput when params() carries
        per-layer taus for another depth)."""
        if self.account is None or self.account.shape != (num_layers, num_experts):
            if len(self.params()) not in (N_PARAMS, N_PARAMS + num_layers):  # the kernel would read past them
                raise BadInput(f"policy {self!r}: params() has {len(self.params()) - N_PARAMS} per-layer taus for a "
                               f"model of {num_layers} MoE layers; give none, or one a layer")
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
        self.check(len(route.experts), E)
        sc = Scratch.make(len(route.experts), E)
        sc.gate_row[:] = route.probs  # probabilities rank and weigh alike
        n_exec, n_fetch, n_admit, subst, mass = decide(
            self.params(), self.bind(cache.shape.num_layers, E), st, sc, route.layer,
            np.asarray(route.probs, np.float32), None, False, np.asarray(route.experts, np.int64),
            np.asarray(route.weights, np.float32))
        return Decision(sc.exec_e[:n_exec].tolist(), sc.exec_w[:n_exec].tolist(), sc.fetch[:n_fetch].tolist(),
                        sc.admit[:n_admit].tolist(), subst, mass, sc.low[:n_fetch].tolist())

    def __repr__(self) -> str:
        return self.name

    def __str__(self) -> str:
        """The spec it was made from, every option in it; its repr when made otherwise."""
        return self.spec or repr(self)


class SubstitutingPolicy(MissPolicy):
    """Substitutes the misses its rule declines to fetch.

    sub=best: the best-ranked resident expert (by router probability) not already selected
    for the token runs in the missed expert's place with its weight; sub=drop: the miss is
    dropped and the kept weights scaled up to the routed experts' total (1 where the family
    renormalises its top-k, their share of the probability where it does not); sub=window:
    like best, but only within the router's top-`window` ranks (window > top-k). A miss with
    no resident substitute is fetched. An expert already in flight (prefetched, admitted) is
    waited for, never substituted: cheaper than a new fetch, and exact.
    beta > 0: background admission; each expert accumulates the gate mass it was substituted
    with and is admitted off the critical path once that reaches beta.
    """
    kind, rule = SUBSTITUTING, NEVER
    parameters = ("sub", "window", "beta")

    def __init__(self, sub: str = "best", window: float | None = None, beta: float = 0.0):
        super().__init__()
        if sub not in SUBSTITUTES:
            raise UnknownName(f"unknown substitute choice {sub!r}; choose one of {', '.join(SUBSTITUTES)}")
        if sub == "window" and window is None:
            raise UnknownName("sub=window needs window=M (the router's top-M ranks), e.g. window=16")
        if sub != "window" and window is not None:
            raise BadInput(f"policy {self.name!r}: window={window} applies only with sub=window; "
                           f"add sub=window or leave window out")
        self.sub, self.beta = sub, checked_number(self.name, "beta", beta, 0)
        self.window = 0 if window is None else checked_number(self.name, "window", window, 1, whole=True)

    def check(self, top_k: int, num_experts: int) -> None:
        """BadInput when sub=window's window does not lie in (top-k, experts]."""
        if self.sub == "window" and not top_k < self.window <= num_experts:
            raise BadInput(f"policy {self.name!r}: window={self.window} must be more than top-k={top_k} (substitutes "
                           f"come from the ranks after the top-k) and at most the {num_experts} experts; "
                           f"e.g. window={min(2 * top_k, num_experts)}")

    def params(self) -> np.ndarray:
        """The base vector plus the fetch rule, the substitute choice, window and beta."""
        p = super().params()
        p[RULE], p[SUB], p[WINDOW], p[BETA] = self.rule, SUBSTITUTES.index(self.sub), self.window, self.beta
        return p


class SubstituteAll(SubstitutingPolicy):
    """Substitute every miss that has a resident substitute; fetch only those that have none."""
    name = "substitute-all"


def checked_taus(policy: str, value) -> tuple[float, ...]:
    """tau as one number, or one per MoE layer ('0.05/0.1/...' in a spec, or a sequence), each
    checked in [0, 1]; BadInput naming it otherwise."""
    parts = value.split("/") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    return tuple(checked_number(policy, "tau", v, 0, 1) for v in parts)


class TauRule(SubstitutingPolicy):
    """A substituting rule that fetches a first choice or a miss of gate weight >= tau: one tau,
    or one per MoE layer (`tau=0.05/0.1/0.07/...`, as many as the model has MoE layers)."""
    def __init__(self, tau: float | str = 0.15, **kw):
        super().__init__(**kw)
        self.taus = checked_taus(self.name, tau)
        self.tau = self.taus[0] if len(self.taus) == 1 else min(self.taus)  # the lowest, for bounds

    def bind(self, num_layers: int, num_experts: int) -> np.ndarray:
        """The base's state; BadInput when per-layer taus do not number the model's MoE layers."""
        if len(self.taus) > 1 and len(self.taus) != num_layers:
            raise BadInput(f"policy {self.name!r}: {len(self.taus)} per-layer taus for a model of {num_layers} MoE "
                           f"layers; give one tau, or one per layer separated by '/'")
        return super().bind(num_layers, num_experts)

    def params(self):
        """The substituting vector plus tau (per layer after the vector when there are several)."""
        p = super().params()
        p[TAU] = self.tau
        return np.concatenate([p, self.taus]) if len(self.taus) > 1 else p

    @property
    def tau_text(self) -> str:
        """tau as a spec writes it."""
        return "/".join(f"{t:g}" for t in self.taus)


class ThresholdRule(TauRule):
    """Fetch a miss if it is the first choice or its gate weight is >= tau (per layer, if given so)."""
    name, rule = "threshold", THRESHOLD
    parameters = ("tau", *SubstitutingPolicy.parameters)

    def __repr__(self):
        return f"{self.name}(tau={self.tau_text})"


class FirstChoice(SubstitutingPolicy):
    """Fetch only a missed first choice."""
    name, rule = "first-choice", FIRST_CHOICE


class WeightBand(SubstitutingPolicy):
    """Substitute exactly the misses whose gate weight lies in [lo, hi), first choices
    included; fetch the rest. Used to compare few heavy against many light substitutions."""
    name, rule = "band", BAND
    parameters = ("lo", "hi", *SubstitutingPolicy.parameters)

    def __init__(self, lo: float = 0.0, hi: float = 1.01, **kw):
        super().__init__(**kw)
        self.lo = checked_number(self.name, "lo", lo, 0, 1)
        self.hi = checked_number(self.name, "hi", hi, self.lo, above=True)

    def params(self):
        """The substituting vector plus the band's lo and hi."""
        p = super().params()
        p[LO], p[HI] = self.lo, self.hi
        return p

    def __repr__(self):
        return f"band(lo={self.lo:g},hi={self.hi:g})"


class LowBit(TauRule):
    """Three actions by gate weight: fetch a miss in full precision if it is the first choice or
    its weight is >= tau (per layer, if given so); fetch its low-precision copy (int4, from a
    second store) if its weight is >= lo; substitute it below lo (lo=0, the default: never
    substitute). A slot holding a small copy serves later hits as it is, until evicted; with
    upgrade=1, a hit on it that the rule would fetch in full also reads the full copy into the
    slot in the background, for the tokens after it."""
    name, rule = "lowbit", LOWBIT
    fetches_small = True
    parameters = ("tau", "lo", "upgrade", *SubstitutingPolicy.parameters)

    def __init__(self, tau: float | str = 0.15, lo: float = 0.0, upgrade: float = 0, **kw):
        super().__init__(tau, **kw)
        self.lo = checked_number(self.name, "lo", lo, 0, self.tau)
        self.upgrade = bool(checked_number(self.name, "upgrade", upgrade, 0, 1, whole=True))

    def params(self):
        """The tau rule's vector plus lo and upgrade."""
        p = super().params()
        p[LO], p[UPGRADE] = self.lo, self.upgrade
        return p

    def __repr__(self):
        return f"lowbit(tau={self.tau_text},lo={self.lo:g}{',upgrade=1' if self.upgrade else ''})"


class CacheConditional(MissPolicy):
    """Cache-conditional routing: keep the router's top-j (fetched if missing) and fill the
    other k-j places with the best-ranked resident experts within the top-m, fetching in rank
    order when too few are resident. The chosen experts get the family's gate weights:
    renormalised over them where the family renormalises its top-k, the router's
    probabilities otherwise. 0 <= j <= top-k <= m <= experts."""
    name, kind = "conditional", CONDITIONAL
    parameters = ("j", "m")
    default_m = 16  # or every expert, when a model has fewer

    def __init__(self, j: float = 2, m: float | None = None):
        super().__init__()
        self.j = checked_number(self.name, "j", j, 0, whole=True)
        self.m = None if m is None else checked_number(self.name, "m", m, 1, whole=True)
        if self.j > self.top_m:
            raise BadInput(f"policy {self.name!r}: j={self.j} is more than m={self.top_m}; the top-j lie within "
                           f"the top-m, e.g. conditional:j=2,m=16")

    @property
    def top_m(self) -> int:
        """m as given, else the default (which the kernel keeps within [top-k, experts])."""
        return self.default_m if self.m is None else self.m

    def check(self, top_k: int, num_experts: int) -> None:
        """BadInput when j is more than top-k or a given m lies outside [top-k, experts]."""
        if self.j > top_k:
            raise BadInput(f"policy {self.name!r}: j={self.j} is more than top-k={top_k}; give j <= {top_k}")
        if self.m is not None and not top_k <= self.m <= num_experts:
            raise BadInput(f"policy {self.name!r}: m={self.m} must lie between top-k={top_k} and the {num_experts} "
                           f"experts; e.g. m={min(2 * top_k, num_experts)}")

    def params(self):
        """The base vector plus j and m."""
        p = super().params()
        p[TOP_J], p[TOP_M] = self.j, self.top_m
        return p

    def __repr__(self):
        return f"conditional(j={self.j},m={self.top_m})"


POLICIES: dict[str, type[MissPolicy]] = {
    p.name: p for p in (MissPolicy, SubstituteAll, ThresholdRule, FirstChoice, WeightBand, LowBit, CacheConditional)}
# name -> (policy spec, eviction): the quality- and speed-first presets
PRESETS = {"quality-first": ("threshold:tau=0.15,beta=0.5", "demand"),
           "speed-first": ("first-choice:beta=0.5", "demand"),
           # peers' caches, by the eviction order each uses with fetch-on-miss
           "mixtral-offloading": ("fetch-all", "lru"),  # per-layer LRU
           "moe-infinity": ("fetch-all", "lfu"),  # least frequently used
           "llama.cpp": ("fetch-all", "halving")}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name:key=value,...` -> (name, {key: value}); each key at most once."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UnknownName(f"policy parameter {item!r} in {spec!r} is not key=value; e.g. threshold:tau=0.15")
        key = key.strip()
        if key in params:
            raise BadInput(f"policy parameter {key!r} is given twice in {spec!r}; give it once")
        params[key] = value.strip()
    return name.strip(), params


def as_policy(policy: MissPolicy | str) -> MissPolicy:
    """`policy` itself, or the policy its spec names; BadInput for anything else (a class, None)."""
    if isinstance(policy, MissPolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, MissPolicy):
        raise BadInput(f"policy {policy.__name__} is a class; give an instance, {policy.__name__}(), or a spec string")
    return make_policy(policy)


def make_policy(spec: str) -> MissPolicy:
    """The policy a spec names, its parameters checked (those that depend on the model's
    router are checked by `MissPolicy.fit`). A preset's parameters can be overridden. Every
    spec also takes `eviction=ORDER` (lru, lfu, freq, halving, demand): the order the policy
    runs with unless the engine or replay is given one, so that one string names a tuned policy."""
    if not isinstance(spec, str):
        raise BadInput(f"a policy spec is a string such as 'threshold:tau=0.15', not {type(spec).__name__}; a "
                       "MissPolicy object itself goes to Engine(policy=...) or Engine.set_policy")
    if "+prefetch/" in spec or "+speculative/" in spec:  # the command line's and bench's spelling of a variant
        raise UnknownName(f"{spec!r} is a policy with prefetching, as the command line spells it; in Python give them "
                          "apart, EngineConfig(policy=..., prefetch=PrefetchConfig(...)): "
                          "expertcache.lab.bench.parse_variant(spec) returns the two")
    name, params = parse_spec(spec)
    chosen_eviction = params.pop("eviction", None)  # any policy: the eviction order it runs with
    if chosen_eviction is not None:
        eviction_code(chosen_eviction)  # UnknownName listing the orders
    eviction = None
    if name in PRESETS:
        preset_spec, eviction = PRESETS[name]
        base, preset_params = parse_spec(preset_spec)
        cls, params = POLICIES[base], {**preset_params, **params}
    elif name in POLICIES:
        cls = POLICIES[name]
    else:
        raise UnknownName(f"unknown policy {name!r}{did_you_mean(name, [*POLICIES, *PRESETS])}; choose one of "
                          f"{', '.join([*POLICIES, *PRESETS])}")
    for key in params:
        if key not in cls.parameters:
            takes = f"it takes {', '.join((*cls.parameters, 'eviction'))}"  # eviction: every policy's
            raise UnknownName(f"policy {name!r} has no parameter {key!r}; {takes}")
    try:
        policy = cls(**params)
    except BadInput as e:
        raise BadInput(f"{e} (preset {name!r} is {PRESETS[name][0]})") if eviction is not None else e from None
    if eviction is not None:
        policy.eviction, policy.name = eviction, name
    if chosen_eviction is not None:
        policy.eviction = policy.named_eviction = chosen_eviction
    policy.spec = spec.strip()
    return policy


def eviction_order(policy: MissPolicy, *given: str | None) -> str:
    """The eviction order a run of `policy` takes: the first of `given` (a call's, a config's) that is not None,
    else the one the policy prefers; BadInput where the policy's spec names another (eviction=lfu with --eviction
    lru ran lru under the spec's name)."""
    order = next((g for g in given if g is not None), None)
    if order is not None and policy.named_eviction not in (None, order):
        raise BadInput(f"policy {policy.spec!r} names eviction={policy.named_eviction}, and eviction {order} is "
                       f"asked too (--eviction); give the order once")
    return order or policy.eviction
