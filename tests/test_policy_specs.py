"""Policy specs from users: every parameter checked in Python before the compiled kernel
(which runs without bounds checks) sees it. Bad specs give one line naming the parameter
and exit code 2; good ones run to a finite perplexity. Seeded fuzzing over names, keys,
values and ranges, through the library on tiny models and through the CLI on the built-in one."""
import math
import pickle
import random

import pytest
import torch

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.perplexity import perplexity
from expertcache.errors import BadInput, ExpertCacheError, UnknownName
from expertcache.policies import POLICIES, PRESETS, make_policy

K, E = 8, 128  # the built-in model's router: top-8 of 128 experts


@pytest.mark.parametrize("spec,error,names", [
    ("conditional:j=20,m=4", BadInput, "j=20"),
    ("conditional:j=20,m=40", BadInput, "j=20"),  # j > top-k
    ("conditional:j=2,m=4", BadInput, "m=4"),  # m < top-k
    ("conditional:j=2,m=129", BadInput, "m=129"),  # m > experts
    ("conditional:j=-1", BadInput, "j=-1"),
    ("conditional:j=2.5", BadInput, "j=2.5"),
    ("conditional:m=nan", BadInput, "m=nan"),
    ("threshold:tau=nan", BadInput, "tau=nan"),
    ("threshold:tau=inf", BadInput, "tau=inf"),
    ("threshold:tau=-0.1", BadInput, "tau=-0.1"),
    ("threshold:tau=1.5", BadInput, "tau=1.5"),
    ("threshold:tau=0.1,tau=0.2", BadInput, "'tau' is given twice"),
    ("band:lo=0.3,hi=0.2", BadInput, "hi=0.2"),
    ("band:lo=-1", BadInput, "lo=-1"),
    ("first-choice:beta=-0.5", BadInput, "beta=-0.5"),
    ("quality-first:beta=1e400", BadInput, "beta=1e400"),
    ("substitute-all:sub=window,window=8", BadInput, "window=8"),  # window <= top-k: no rank could substitute
    ("substitute-all:sub=window,window=3", BadInput, "window=3"),
    ("substitute-all:sub=window,window=200", BadInput, "window=200"),
    ("substitute-all:sub=window,window=12.5", BadInput, "window=12.5"),
    ("substitute-all:window=16", BadInput, "window=16"),  # ignored without sub=window
    ("fetch-all:tau=0.1", UnknownName, "'tau'"),
    ("threshold:j=2", UnknownName, "'j'"),
    ("conditional:tau=0.1", UnknownName, "'tau'"),
    ("speed-first:x=1", UnknownName, "'x'"),
    ("threshold:sub=odd", UnknownName, "'odd'"),
    ("nope", UnknownName, "'nope'"),
])
def test_bad_parameters_are_named(spec, error, names):
    with pytest.raises(error) as e:
        make_policy(spec).fit(K, E, True)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_presets_take_overrides():
    p = make_policy("quality-first:tau=0.3")
    assert (p.name, p.tau, p.beta, p.eviction) == ("quality-first", 0.3, 0.5, "demand")


# -- fuzzing ---------------------------------------------------------------------------
NAMES = [*POLICIES, *PRESETS, "", "nope", "Threshold", "fetch_all", " conditional "]
KEYS = ["tau", "lo", "hi", "beta", "window", "j", "m", "sub", "x", "", "TAU"]
ODD = ["nan", "inf", "-inf", "1e400", "1e-400", "", "abc", "2.5", "0x10", "1_0", "best", "drop", "window", "odd",
       "True", " 4 ", "-0", "1e30", "-1", "9" * 30]


def random_value(rng: random.Random, key: str) -> str:
    roll = rng.random()
    if roll < 0.2:
        return rng.choice(ODD)
    if key == "sub":
        return rng.choice(["best", "drop", "window", "window"])
    if key in ("j", "m", "window") or roll < 0.4:
        return str(rng.randint(-2, 12))
    return f"{rng.uniform(-0.2, 1.2):.3g}"


def random_spec(rng: random.Random) -> str:
    """A spec near a valid one: a real policy name and its own keys, each once, most of the time."""
    name = rng.choice(NAMES) if rng.random() < 0.2 else rng.choice([*POLICIES, *PRESETS])
    cls = POLICIES.get(name) or POLICIES.get(PRESETS.get(name, ("",))[0].split(":")[0])
    own = list(cls.parameters) if cls else []
    keys = rng.sample(own, rng.randint(0, len(own))) if rng.random() < 0.8 else []
    keys += [rng.choice(KEYS) for _ in range(rng.random() < 0.3)]  # unknown or repeated
    if "window" in keys and "sub" not in keys and rng.random() < 0.7:
        keys.append("sub")
    items = [key if rng.random() < 0.02 else f"{key}={random_value(rng, key)}" for key in keys]
    return name + (":" + ",".join(items) if items or rng.random() < 0.1 else "")


def test_fuzzed_specs_give_an_error_or_a_finite_perplexity(tiny):
    """Per family (k=2 of 8 experts): renormalised (qwen3_moe) and not (olmoe) gate weights."""
    rng = random.Random(11)
    ids = torch.randint(0, 96, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    engines = [Engine(tiny[f][0], EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold"))
               for f in ("qwen3_moe", "olmoe")]
    outcomes = {"ran": 0, "UnknownName": 0, "BadInput": 0}
    for i in range(400):
        spec = random_spec(rng)
        engine = engines[i % 2]
        try:
            engine.set_policy(spec)
        except ExpertCacheError as e:
            msg = str(e)
            assert type(e) in (UnknownName, BadInput) and msg and "\n" not in msg, (spec, msg)
            outcomes[type(e).__name__] += 1
            continue
        r = perplexity(engine, ids, context=20)
        assert math.isfinite(r.ppl) and r.ppl > 1, spec
        outcomes["ran"] += 1
    assert min(outcomes.values()) > 40, outcomes  # each outcome well represented


def test_fuzzed_specs_through_the_cli(capsys):
    """A sample of the fuzzed specs and the one that crashed the process (exit 134) through
    `expertcache ppl` on the built-in model: exit 0 with a finite perplexity or exit 2 with one line."""
    rng = random.Random(5)
    specs = ["conditional:j=20,m=4", "conditional:j=8,m=8", "substitute-all:sub=window,window=9"]
    specs += [random_spec(rng) for _ in range(5)]
    codes = []
    for spec in specs:
        code = cli.main(["ppl", "--store", "ram", "--max-tokens", "40", "--context", "40", "--policy", spec])
        out, err = capsys.readouterr()
        codes.append(code)
        if code == 0:
            assert math.isfinite(float(out.split()[1])), (spec, out)
        else:
            assert code == 2 and err.startswith("expertcache: error:") and err.count("\n") == 1, (spec, err)
    assert codes[:3] == [2, 0, 0] and 0 in codes[3:] and 2 in codes[3:], list(zip(specs, codes))


# -- the kernel's entries: sizes and ids checked before the compiled call ----------------
def virtual_cache(L=2, E=8, k=2):
    from expertcache.engine.cache import ExpertCache
    from expertcache.engine.stores import ExpertShape
    return ExpertCache(CacheConfig(fraction=0.5), None, k, None, torch.float32, shape=ExpertShape(L, E, (4, 2), (2, 2)),
                       fetch_bytes=1)


def test_decide_and_prefetch_check_their_arrays():
    import numpy as np

    from expertcache.kernel.routing import Routing
    cache, policy = virtual_cache(), make_policy("conditional:j=2,m=4")
    T, E, k = 3, 8, 2

    def decide(layer=0, logits=(T, E), ids=None, weights=(T, k), out=(T, k), dtype=np.float32, pol=policy):
        ids = np.tile(np.arange(k), (T, 1)) if ids is None else np.asarray(ids, np.int64)
        rows = np.zeros(logits, dtype)  # a softmax routing: the logits rank and weigh
        return cache.decide(pol, layer, Routing(rows, rows, np.full(weights, 0.5, np.float32), ids), 0,
                            np.zeros(out, np.int64), np.zeros(out, np.int64), np.zeros(out, np.float32))

    assert decide() is None  # the plan of every token is left to the caller
    for bad, match in [(dict(logits=(T, E + 1)), "logits must be a float32 array of shape"),
                       (dict(logits=(T + 1, E)), "logits"), (dict(dtype=np.float64), "logits"),
                       (dict(weights=(T, k + 1)), "weights"), (dict(out=(T, k + 1)), "slots"),
                       (dict(ids=[[0, 8]] * T), r"outside \[0, 8\)"), (dict(ids=[[-1, 0]] * T), "outside"),
                       (dict(ids=[[0, 1, 2]] * T), "ids must be"), (dict(layer=2), "layer 2 is out of range"),
                       (dict(layer=-1), "layer -1"), (dict(pol=make_policy("conditional:j=2,m=9")), "m=9")]:
        with pytest.raises(BadInput, match=match):
            decide(**bad)
    cache.prefetch(1, [7, 0], 0)
    for layer, experts, match in [(0, [8], "outside"), (0, [-1], "outside"), (2, [0], "layer 2"),
                                  (0, [[0, 1]], "list of expert ids")]:
        with pytest.raises(BadInput, match=match):
            cache.prefetch(layer, experts, 0)


def test_replay_checks_its_inputs():
    import numpy as np

    from expertcache.lab.simulator import replay, route_trace
    from expertcache.lab.trace import Trace
    L, E, N = 2, 8, 30
    logits = np.random.default_rng(0).normal(size=(N, L, E)).astype(np.float16)
    header = {"num_layers": L, "num_experts": E, "top_k": 2, "norm_topk_prob": False, "hidden_size": 8,
              "expert_params": 3 * 8 * 4, "context": 10}
    trace = Trace(header, np.zeros(N, np.int32), logits)
    routes = route_trace(trace)
    assert replay(trace, "conditional:j=2,m=8", routes=routes).stats.moe_calls == N * L
    other = Trace(header, np.zeros(N - 1, np.int32), logits[:-1])
    for kwargs, match in [(dict(policy="conditional:j=3"), "j=3 is more than top-k=2"),
                          (dict(policy="substitute-all:sub=window,window=9"), "window=9"),
                          (dict(routes=route_trace(other)), "routes of shape"),
                          (dict(counts=np.zeros((L, E + 1))), "routing counts of shape"),
                          (dict(window=-3), "window -3")]:
        with pytest.raises(BadInput, match=match):
            replay(trace, **{"policy": "fetch-all", **kwargs})
    for bad in ({**header, "top_k": 9}, {**header, "num_experts": 16}):
        with pytest.raises(BadInput, match="do not fit its header"):
            route_trace(Trace(bad, trace.tokens, logits))


def test_fuzzed_per_layer_taus_give_an_error_or_a_finite_perplexity(tiny):
    """tau given per layer ('a/b/...'): the right count of valid values runs, any other count or
    value is one line naming the problem."""
    rng = random.Random(12)
    ids = torch.randint(0, 96, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold"))
    layers = engine.args.num_moe_layers
    outcomes = {"ran": 0, "BadInput": 0}
    for _ in range(60):
        n = rng.choice([layers, layers, 1, layers + 1, layers + 2])  # one tau is a scalar
        taus = "/".join(random_value(rng, "tau") if rng.random() < 0.15 else f"{rng.uniform(0, 1):.3g}"
                        for _ in range(n))
        spec = f"{rng.choice(['threshold', 'lowbit'])}:tau={taus}"
        try:
            engine.set_policy(spec)
        except ExpertCacheError as e:
            assert type(e) is BadInput and "\n" not in str(e) and "tau" in str(e), (spec, str(e))
            outcomes["BadInput"] += 1
            continue
        assert n in (1, layers), spec
        r = perplexity(engine, ids, context=20)
        assert math.isfinite(r.ppl) and r.ppl > 1, spec
        outcomes["ran"] += 1
    assert min(outcomes.values()) > 10, outcomes


@pytest.mark.parametrize("variant", ["fetch-all+prefetch/quasi-hidden:drop=2", "fetch-all+prefetch/estimator:fetched=7",
                                     "fetch-all+prefetch/quasi-hidden:budget=0", "fetch-all+prefetch/quasi-hidden:x=1",
                                     "fetch-all+prefetch/lookahead:confidence=1.5",
                                     "fetch-all+prefetch/lookahead:confidence=nan",
                                     "fetch-all+prefetch/lookahead:confidence=sure",
                                     "fetch-all+prefetch/lookahead:confidence=0_1",
                                     "fetch-all+prefetch/router-ahead:budget=2,budget=3", "fetch-all+",
                                     "fetch-all+prefetch/", "+prefetch/router-ahead", "fetch-all+prefetch/estimator:"])
def test_prefetch_options_take_only_their_values(variant):
    """drop and fetched are 0 or 1, budget a count >= 1, confidence a weight in [0, 1], each given once, and a spec
    whole: any other is refused, not read as something else (budget=2,budget=3 ran with 3, "fetch-all+" as
    fetch-all, "prefetch/" with quasi-hidden)."""
    from expertcache.errors import BadInput
    from expertcache.lab.bench import parse_variant
    with pytest.raises(BadInput, match="prefetch option|incomplete"):
        parse_variant(variant)
    assert parse_variant("fetch-all+prefetch/quasi-hidden:drop=0,fetched=1,budget=4")[1].budget == 4
    sure = parse_variant("fetch-all+prefetch/lookahead:confidence=0.1")[1]
    assert sure.confidence == 0.1 and str(sure) == "prefetch/lookahead:confidence=0.1"


def test_a_report_folder_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    from expertcache import cli
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["study", "--out", str(tmp_path / "afile")])
    assert e.value.code == 2 and "is a file; give a folder" in capsys.readouterr().err


def test_study_checks_its_policy_names_before_the_baseline(capsys, monkeypatch):
    from expertcache import cli
    monkeypatch.setattr("expertcache.lab.study.run_study", lambda *a, **k: pytest.fail("the study ran"))
    assert cli.main(["study", "--policies", "threshold:tau=0.15", "no-such-policy"]) == 2
    assert "no-such-policy" in capsys.readouterr().err


# -- every road by which a policy reaches the kernel: one check, Engine.bind_policy ---------
def test_every_road_to_the_kernel_checks_the_policy(tiny):
    """A policy that the engine's --policy check refuses is refused the same way as a prefill policy
    (library and server), through set_policy, and when a policy made elsewhere is handed straight to
    the runner: the kernel never sees one unchecked (conditional j=16 wrote past arrays of top-k)."""
    from expertcache.engine.generate import TextGeneration
    from expertcache.engine.sampling import SamplingParams
    from expertcache.serve.scheduler import Scheduler, SchedulerConfig
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))  # top-2 of 8
    bad = "conditional:j=4,m=4"
    with pytest.raises(BadInput, match="j=4"):
        engine.set_policy(bad)
    with pytest.raises(BadInput, match="j=4"):
        TextGeneration(engine, [1, 2, 3], SamplingParams(max_tokens=2), prefill_policy=make_policy(bad))
    with pytest.raises(BadInput, match="j=4"):
        Scheduler(engine, SchedulerConfig(prefill_policy=make_policy(bad)))
    engine.runner.policy = make_policy(bad)  # a library user's shortcut past the engine
    with pytest.raises(BadInput, match="bind_policy"):
        engine.forward(torch.tensor([1, 2, 3]), 0)
    engine.set_policy("fetch-all")
    assert engine.forward(torch.tensor([1, 2, 3]), 0).isfinite().all()
    engine.close()


def test_a_lowbit_prefill_policy_gets_its_small_copies(tiny):
    """A lowbit prefill policy opens and attaches the low-precision store, as --policy lowbit does."""
    from expertcache.engine.generate import TextGeneration
    from expertcache.engine.sampling import SamplingParams
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold", cache=CacheConfig(fraction=0.5)))
    gen = TextGeneration(engine, list(range(1, 20)), SamplingParams(max_tokens=3), prefill_policy=make_policy(
        "lowbit:tau=0.9"))
    assert [out.token for out in gen] and engine.cache.small is not None
    engine.close()


def test_serve_refuses_a_prefill_policy_the_model_cannot_take(capsys):
    """serve --prefill-policy conditional:j=16,m=16 on the top-8 built-in model: one line and exit 2
    (it crashed the server with SIGSEGV on the first prompt)."""
    code = cli.main(["serve", "--store", "ram", "--port", "0", "--prefill-policy", "conditional:j=16,m=16"])
    err = capsys.readouterr().err
    assert code == 2 and "j=16" in err and err.strip().count("\n") == 0, err


def test_a_custom_policys_params_are_checked_before_the_kernel_sees_them(tiny):
    """A MissPolicy subclass's own params() reaches the compiled decision (which checks no bounds) only as a vector
    it can trust: a short one was read past its end, an int or float32 one compiled anew for minutes, an unknown
    kind decided nonsense, j past top-k wrote past the scratch arrays. A subclass's decide(), which the engine never
    calls, is refused rather than silently ignored; a policy given as None or a class is one line."""
    import numpy as np
    from expertcache.kernel.policy import CONDITIONAL, KIND, N_PARAMS, RULE, SUBSTITUTING, TAU, THRESHOLD, TOP_J
    from expertcache.policies import MissPolicy
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))  # top-2 of 8
    L = engine.args.num_moe_layers

    def custom(edit):
        class Custom(MissPolicy):
            name = "custom"

            def params(self):
                return edit(super().params())
        return Custom()

    def with_entries(**entries):
        def edit(p):
            for key, value in entries.items():
                p[{"kind": KIND, "rule": RULE, "tau": TAU, "j": TOP_J}[key]] = value
            return p
        return edit
    for edit, words in [(lambda p: p[:5], "12 entries"), (lambda p: p.astype(np.float32), "float32"),
                        (lambda p: list(p), "not list"), (lambda p: None, "NoneType"),
                        (with_entries(kind=7), "kind 7"), (with_entries(kind=SUBSTITUTING, rule=9), "rule 9"),
                        (with_entries(kind=SUBSTITUTING, rule=THRESHOLD, tau=np.nan), "out of range"),
                        (with_entries(kind=CONDITIONAL, j=5), "out of range"),
                        (lambda p: np.concatenate([p, [0.1] * (L + 1)]), f"{L + 1} per-layer taus")]:
        with pytest.raises(BadInput, match=words):
            engine.set_policy(custom(edit))
    threshold = with_entries(kind=SUBSTITUTING, rule=THRESHOLD, tau=0.3)
    engine.set_policy(custom(lambda p: np.concatenate([threshold(p), [0.3] * L])))  # one tau a layer: taken
    assert len(engine.policy.params()) == N_PARAMS + L and engine.forward(torch.tensor([1, 2, 3]), 0).isfinite().all()

    class OwnDecide(MissPolicy):
        def decide(self, route, cache):
            raise AssertionError("never called")
    for policy, words in [(OwnDecide(), "overrides decide"), (None, "policy spec is a string"),
                          (MissPolicy, "is a class")]:
        with pytest.raises(BadInput, match=words):
            engine.set_policy(policy)
    with pytest.raises(BadInput, match="policy spec is a string"):
        Engine(tiny["qwen3_moe"][0], EngineConfig(policy=MissPolicy()))
    other = Engine(tiny["qwen3_moe"][0], policy="threshold:tau=0.2")  # a spec string is taken too
    assert str(other.policy) == "threshold:tau=0.2"
    other.close()
    engine.close()


def test_a_refused_eviction_leaves_the_engine_as_it_was(tiny):
    """set_policy with an unknown eviction order changes nothing: it switched the policy and left the unknown name
    in the cache's config, so that every later run (its reset) failed again."""
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    engine.set_policy("threshold:tau=0.2", eviction="lfu")
    with pytest.raises(UnknownName, match="lruu"):
        engine.set_policy("fetch-all", eviction="lruu")
    assert str(engine.policy) == "threshold:tau=0.2" and engine.cache.cfg.eviction == "lfu"
    assert perplexity(engine, list(range(1, 20)), context=8).ppl > 0
    engine.close()


def test_the_cache_configs_eviction_is_taken(tiny):
    """CacheConfig(eviction=...) was overridden by the policy's preferred order without a word; it now counts where
    EngineConfig names none, and an unknown order is refused as the config is made."""
    path = tiny["qwen3_moe"][0]
    engine = Engine(path, EngineConfig(cache=CacheConfig(eviction="lfu"), initial="cold"), policy="quality-first")
    assert engine.cache.cfg.eviction == "lfu"
    engine.set_policy("fetch-all")
    assert engine.cache.cfg.eviction == "lfu"
    engine.close()
    engine = Engine(path, EngineConfig(cache=CacheConfig(eviction="lfu"), eviction="freq", initial="cold"))
    assert engine.cache.cfg.eviction == "freq"
    engine.close()
    engine = Engine(path, EngineConfig(initial="cold"), policy="quality-first")
    assert engine.cache.cfg.eviction == engine.policy.eviction == "demand"  # the preset's own order
    engine.close()
    with pytest.raises(UnknownName, match="lruu"):
        CacheConfig(eviction="lruu")


def test_one_policy_object_runs_one_engine_at_a_time(tiny):
    """A policy object carries its run's state (the substituted mass towards admission): handed to a second open
    engine it is refused, where both engines counted each other's substitutions (more admissions, silently). Once
    its engine is closed, or failed to load, another may take it; one engine may bind it again (a prefill policy)."""
    path = tiny["qwen3_moe"][0]
    policy = make_policy("quality-first")
    first = Engine(path, EngineConfig(initial="cold"), policy=policy)
    first.bind_policy(policy)
    with pytest.raises(BadInput, match="bound to another open Engine"):
        Engine(path, EngineConfig(initial="cold"), policy=policy)
    # pickled as unbound: the weak reference to its engine cannot be pickled
    assert pickle.loads(pickle.dumps(policy)).params().tolist() == policy.params().tolist()
    first.close()
    with pytest.raises(UnknownName):
        Engine(path, EngineConfig(initial="cold", eviction="nope"), policy=policy)
    Engine(path, EngineConfig(initial="cold"), policy=policy).close()


@pytest.mark.parametrize("value", ["0_1", "\u0660.\u0661", "0x1p-3", " "])
def test_a_policy_number_is_a_plain_decimal(value):
    """Python's float() reads 0_1 as 1.0 and Arabic-Indic digits as theirs: threshold:tau=0_1 ran as tau=1,
    silently. A spec's number is a plain ASCII decimal."""
    from expertcache.errors import BadInput
    from expertcache.policies import make_policy
    with pytest.raises(BadInput, match="is not a number"):
        make_policy(f"threshold:tau={value}")
    assert make_policy("threshold:tau=.5").tau == 0.5 and make_policy("threshold:tau=1e-1").tau == 0.1
