"""Traces and the simulator: the replay's counts equal the engine's under fetch-every-miss."""
import json
import struct

import numpy as np
import pytest
import torch

from expertcache.engine.cache import CacheConfig
from expertcache.engine.slots import slot_bytes
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.quant import SMALL_FORMAT, ExpertFormat, encoded_bytes
from expertcache.engine.stores import ExpertShape
from expertcache.errors import CheckpointError
from expertcache.lab.simulator import replay
from expertcache.lab.trace import MAGIC, read_trace, record_trace
from expertcache.models import model_args


@pytest.fixture(scope="module")
def traced(tiny, tmp_path_factory):
    path = tiny["olmoe"][0]
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    out = tmp_path_factory.mktemp("trace") / "t.ectrace"
    return path, ids, record_trace(path, ids, out, context=64, dtype="float32"), out


@pytest.mark.parametrize("eviction", ["lru", "lfu", "freq", "demand"])
def test_replay_counts_equal_the_engine(traced, eviction):
    path, ids, trace, _ = traced
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold", eviction=eviction))
    x = torch.tensor(ids)
    for start in range(0, len(ids), 64):
        engine.forward(x[start:start + 64], 0)
    sim = replay(trace, "fetch-all", CacheConfig(fraction=0.5), eviction=eviction)
    e, s = engine.stats, sim.stats
    fields = ("hits", "misses", "sync_fetches", "moe_calls", "segments", "expert_runs")
    assert [getattr(s, f) for f in fields] == [getattr(e, f) for f in fields]
    assert e.sync_fetches > 0 and e.segments > 2 * 5  # windows were split by evictions


@pytest.mark.parametrize("slots", ["fp32", "fp16", "int4"])
def test_a_cache_in_bytes_holds_the_engines_slots_in_the_replay(traced, slots):
    """A cache given in bytes holds as many slots in the replay as in the engine, for the engine's slot
    format: twice the fp32 slots for fp16, more again for int4 (whose fetches move int4 blobs)."""
    path, ids, trace, _ = traced
    fmt = ExpertFormat.parse(slots)
    a = model_args(open_checkpoint(path).config)
    cache = CacheConfig(bytes=slot_bytes(ExpertShape.of(a), ExpertFormat.parse("fp32")) * a.num_moe_layers * a.top_k)
    engine = Engine(path, EngineConfig(cache=cache, initial="cold", slot_dtype=slots,
                                       store_format=fmt if fmt.quantized else None))
    x = torch.tensor(ids)
    for start in range(0, len(ids), 64):
        engine.forward(x[start:start + 64], 0)
    sim = replay(trace, "fetch-all", cache, fetch_dtype_bytes={"fp32": 4}.get(slots, 2),
                 slot_format=engine.slot_format).stats
    fields = ("hits", "misses", "sync_fetches", "moe_calls", "segments", "expert_runs", "sync_fetch_bytes")
    assert [getattr(sim, f) for f in fields] == [getattr(engine.stats, f) for f in fields]
    assert (engine.cache.per_layer == a.top_k) == (slots == "fp32")  # the others hold more in the same bytes
    engine.close()


def test_decode_order_replay(traced):
    """With per-layer quotas each layer sees its tokens in the same order whatever the window:
    the same fetches; in decode order every token runs its k experts on its own."""
    _, _, trace, _ = traced
    windows = replay(trace, "fetch-all", CacheConfig(fraction=0.5))
    decode = replay(trace, "fetch-all", CacheConfig(fraction=0.5), window=1)
    assert decode.stats.sync_fetches == windows.stats.sync_fetches
    assert decode.stats.expert_runs == 2 * decode.stats.moe_calls > windows.stats.expert_runs


def test_substituting_replay_runs(traced):
    _, _, trace, _ = traced
    r = replay(trace, "threshold:tau=0.3,beta=0.5", CacheConfig(fraction=0.5))
    assert r.stats.substitutions > 0 and r.stats.sync_fetches > 0 and r.events == 300 * 2 * 2


def test_warm_start_needs_the_routing_counts(traced, capsys):
    from expertcache import cli
    path, _, _, out = traced  # a tiny model without routing_counts.json
    assert cli.main(["simulate", str(out), "--initial", "warm", "--policies", "fetch-all"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path / "routing_counts.json") in err and str(out) in err
    assert "expertcache calibrate" in err
    assert cli.main(["simulate", str(out), "--initial", "auto", "--policies", "fetch-all"]) == 0  # cold, as asked
    out_text = capsys.readouterr().out
    assert "| `fetch-all` |" in out_text
    assert f"start: cold (no routing counts beside {path.resolve()})" in out_text  # auto says which it took


def test_a_policy_or_cache_given_twice_is_replayed_once(traced, tmp_path, capsys):
    """Duplicates in --policies or --cache make one row each, as bench and study run them once: not rows that
    repeat (and a sweep's time doubled)."""
    from expertcache import cli
    out, js = traced[3], tmp_path / "sim.json"
    assert cli.main(["simulate", str(out), "--initial", "cold", "--policies", "fetch-all", "substitute-all",
                     "fetch-all", "--cache", "0.5", "0.5", "--json", str(js)]) == 0
    rows = [(r["policy"], r["cache"]) for r in json.loads(js.read_text())["runs"]]
    assert rows == [("fetch-all", 0.5), ("substitute-all", 0.5)], rows
    assert capsys.readouterr().out.count("| `fetch-all` |") == 1


def test_trace_format_version_is_checked(traced, tmp_path):
    _, ids, trace, out = traced
    assert trace.logits.shape == (300, 2, 8) and list(trace.tokens) == ids
    bad = tmp_path / "v99.ectrace"
    raw = bytearray(out.read_bytes())
    raw[len(MAGIC):len(MAGIC) + 4] = struct.pack("<I", 99)
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="format version 99"):
        read_trace(bad)
    (tmp_path / "junk").write_bytes(b"hello")
    with pytest.raises(CheckpointError, match="not an expertcache trace"):
        read_trace(tmp_path / "junk")


def test_a_trace_write_cut_short_keeps_the_trace_it_replaces(traced, monkeypatch):
    """A trace is written whole or not at all: a write that fails (a full disk, Ctrl-C) left a truncated file in
    place of the trace recorded before."""
    import numpy as np

    from expertcache.lab import trace as trace_module
    _, ids, trace, out = traced
    before = out.read_bytes()

    def cut(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(np, "ascontiguousarray", cut)  # after the header is written
    with pytest.raises(KeyboardInterrupt):
        trace_module.write_trace(out, trace.header, trace.tokens, trace.logits)
    assert out.read_bytes() == before and [p.name for p in out.parent.iterdir() if ".partial" in p.name] == []


def test_cost_fit_recovers_known_costs():
    from expertcache.lab.costmodel import fit_terms
    rng = np.random.default_rng(0)
    counts = np.column_stack([np.ones(6), rng.uniform(0, 50, (6, 3))])
    cost = np.array([1e-4, 3e-5, 5e-5, 2e-5])
    fitted = fit_terms(counts, counts @ cost, ("dense", "a", "b", "c"))
    np.testing.assert_allclose(list(fitted.values()), cost, rtol=1e-6)
    worse = fit_terms(counts, counts @ np.array([1e-4, 3e-5, 5e-5, 0.0]) - 1e-5 * counts[:, 3], ("d", "a", "b", "c"))
    assert worse["c"] == 0.0 and min(worse.values()) >= 0  # a negative cost is not physical: dropped


def test_cost_fit_is_the_non_negative_optimum():
    """Against every subset of terms fitted free (the optimum has one whose free fit is
    non-negative): no non-negative choice has a smaller relative error. (With this seed,
    dropping the most negative term and refitting ends 10% worse.)"""
    import itertools

    from expertcache.lab.costmodel import fit_terms
    rng = np.random.default_rng(110)
    counts = np.column_stack([np.ones(8), rng.uniform(0, 30, (8, 4))])
    seconds = counts @ np.array([2e-4, -1e-5, 4e-5, 3e-5, -2e-5]) + rng.normal(0, 2e-5, 8)
    scaled, target = counts / seconds[:, None], np.ones(8)
    fitted = np.array(list(fit_terms(counts, seconds, tuple("abcde")).values()))
    best = np.inf
    for r in range(1, 6):
        for keep in itertools.combinations(range(5), r):
            c, *_ = np.linalg.lstsq(scaled[:, keep], target, rcond=None)
            if (c >= 0).all():
                best = min(best, np.sum((scaled[:, keep] @ c - target) ** 2))
    assert (fitted >= 0).all()
    assert np.sum((scaled @ fitted - target) ** 2) == pytest.approx(best, rel=1e-9)


def test_cost_model_adds_fetch_time():
    from expertcache.engine.stats import RunStats
    from expertcache.lab.costmodel import DATASHEET
    p = DATASHEET["rtx3090-qwen3-next"]
    none = RunStats(tokens=10, moe_calls=480)
    some = RunStats(tokens=10, moe_calls=480, sync_fetches=480, fetch_waits=480)  # one fetch per MoE call
    extra = p.ms_per_token(some) - p.ms_per_token(none)
    assert extra == pytest.approx(1000 * 48 * p.fetch_s)
    assert 0.2 < p.fetch_s * 1000 < 0.3  # 6.3 MB over PCIe 4.0


ADMITTING = ("quality-first:beta=0.1", "threshold:tau=0.3,beta=0.2", "first-choice:beta=0.1,sub=drop")


@pytest.mark.parametrize("policy", ADMITTING)
def test_windows_decide_as_decode_in_the_replay(traced, policy):
    """What is admitted for token t is resident from token t + 1, in a window as in decode."""
    _, _, trace, _ = traced
    windows = replay(trace, policy, CacheConfig(fraction=0.5)).stats
    decode = replay(trace, policy, CacheConfig(fraction=0.5), window=1).stats
    fields = ("hits", "misses", "sync_fetches", "substitutions", "background_fetches", "substituted_mass")
    assert windows.background_fetches > 0
    assert [getattr(windows, f) for f in fields] == [getattr(decode, f) for f in fields]


@pytest.mark.parametrize("policy", ADMITTING)
def test_windows_decide_as_decode_in_the_engine(traced, policy):
    """A teacher-forced window and token-by-token decoding make the same decisions (exact
    `ram` store): the same counts and the same logits."""
    path, ids, _, _ = traced
    x = torch.tensor(ids[:48])
    runs = []
    for window in (48, 1):
        engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold", policy=policy))
        logits = torch.cat([engine.forward(x[p:p + window], p) for p in range(0, len(x), window)])
        runs.append((logits, engine.stats))
        engine.close()
    (lw, w), (ld, d) = runs
    fields = ("hits", "misses", "sync_fetches", "substitutions", "background_fetches")
    assert w.background_fetches > 0 and w.substitutions > 0
    assert [getattr(w, f) for f in fields] == [getattr(d, f) for f in fields]
    assert w.substituted_mass == pytest.approx(d.substituted_mass, rel=1e-6)
    torch.testing.assert_close(lw, ld, atol=1e-4, rtol=0)


def test_sweep_on_ray_equals_the_local_sweep(traced, monkeypatch):
    """The sweep's pure task list on a local one-CPU Ray (Ray >= 2.x has no local mode) gives
    the rows the local loop gives."""
    ray = pytest.importorskip("ray")
    from pathlib import Path
    # Ray's workers import this checkout's expertcache, whatever else is installed
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    from expertcache.commands.simulate import run_tasks
    _, _, _, out = traced
    tasks = [(str(out), p, f, None, "cold", "rtx3090-qwen3-next", None)
             for f in (0.5, 0.75) for p in ("fetch-all", "threshold:tau=0.3,beta=0.5,eviction=demand")]
    timing = ("events_per_second", "routing_seconds")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    import signal
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    on_ray = run_tasks(tasks, "ray", ray_init={"num_cpus": 1, "include_dashboard": False})
    assert not ray.is_initialized()  # shut down after the sweep it started
    # and without Ray's SIGTERM handler, which raised SystemExit in whatever ran later (a `timeout` on the tests)
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers
    assert strip(on_ray) == strip(run_tasks(tasks))
    assert [r["policy"] for r in on_ray] == [t[1] for t in tasks] and on_ray[0]["sync_fetches"] > 0


def test_ray_address_needs_jobs_ray(traced, capsys):
    from expertcache import cli
    _, _, _, out = traced
    assert cli.main(["simulate", str(out), "--ray-address", "auto", "--policies", "fetch-all"]) == 2
    assert "--jobs ray" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["lowbit:tau=0.3", "lowbit:tau=0.3,lo=0.1"])
def test_replay_counts_lowbit_bytes_as_the_engine_does(traced, policy):
    """Low-precision fetches are counted apart from full ones, in the replay and the engine
    alike, and their bytes are those of the small copies (int4), not of full experts."""
    path, ids, trace, _ = traced
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold", policy=policy,
                                       store="disk"))
    x = torch.tensor(ids)
    for start in range(0, len(ids), 64):
        engine.forward(x[start:start + 64], 0)
    sim = replay(trace, policy, CacheConfig(fraction=0.5)).stats
    e = engine.stats
    fields = ("hits", "misses", "sync_fetches", "lowbit_fetches", "substitutions", "moe_calls")
    assert [getattr(sim, f) for f in fields] == [getattr(e, f) for f in fields]
    assert e.lowbit_fetches > 0 and sim.lowbit_fetches > 0
    small = encoded_bytes(engine.store.shape.parts, SMALL_FORMAT)
    assert sim.lowbit_bytes == sim.lowbit_fetches * small
    assert e.lowbit_bytes == e.lowbit_fetches * engine.cache.small.blob  # 4 KiB-aligned blobs on disk
    assert engine.cache.small.format == SMALL_FORMAT and engine.cache.small.blob < engine.store.blob
    assert e.sync_fetch_bytes == e.sync_fetches * engine.store.blob
    engine.close()
    full = replay(trace, "fetch-all", CacheConfig(fraction=0.5)).stats
    assert sim.sync_fetch_bytes + sim.lowbit_bytes < full.sync_fetch_bytes


def test_upgrades_decide_alike_in_windows_decode_and_the_replay(traced):
    """lowbit with upgrade=1 (exact `ram` stores): a hit on a small copy that the rule would fetch
    in full reads the full copy into its slot after the token's expert work. A window and
    token-by-token decoding give the same counts and logits (the window's earlier tokens ran
    with the small copy), the replay counts what the engine does, and every slot no longer
    marked low holds its expert's full copy."""
    path, ids, trace, _ = traced
    policy, cfg = "lowbit:tau=0.3,upgrade=1", CacheConfig(fraction=0.5)
    fields = ("hits", "misses", "sync_fetches", "lowbit_fetches", "upgrades", "background_fetches", "moe_calls",
              "lowbit_uses")
    x = torch.tensor(ids)
    runs = []
    for window in (64, 1):
        engine = Engine(path, EngineConfig(cache=cfg, initial="cold", policy=policy))
        logits = torch.cat([engine.forward(x[p:p + window], p % 64) for p in range(0, 128, window)])
        runs.append((logits, engine.stats))
        engine.close()
    (lw, w), (ld, d) = runs
    assert w.upgrades > 0 and w.background_fetches == w.upgrades and w.lowbit_uses > w.lowbit_fetches > 0
    assert [getattr(w, f) for f in fields] == [getattr(d, f) for f in fields]
    torch.testing.assert_close(lw, ld, atol=1e-4, rtol=0)

    engine = Engine(path, EngineConfig(cache=cfg, initial="cold", policy=policy))
    for start in range(0, len(ids), 64):
        engine.forward(x[start:start + 64], 0)
    sim = replay(trace, policy, cfg).stats
    e = engine.stats
    assert [getattr(sim, f) for f in (*fields, "segments", "expert_runs")] == \
        [getattr(e, f) for f in (*fields, "segments", "expert_runs")]
    assert sim.background_bytes == sim.upgrades * sim.sync_fetch_bytes // sim.sync_fetches
    cache, E = engine.cache, engine.store.shape.num_experts
    w13, w2 = torch.empty_like(cache.w13[0]), torch.empty_like(cache.w2[0])
    full = low = 0
    for s, owner in enumerate(cache.state.owner.tolist()):
        if owner < 0:
            continue
        engine.store.read_into(owner // E, owner % E, w13, w2)
        same = torch.equal(cache.w13[s], w13) and torch.equal(cache.w2[s], w2)
        assert same != cache.state.low[s], (s, owner)
        full, low = full + same, low + (not same)
    assert full and low
    engine.close()


def test_calibrate_hw_measures_the_store_and_slots_it_is_given(tmp_path, capsys):
    """calibrate-hw times the engine with the store format, read mode, I/O path and slot dtype it is
    given: int8 slots of an int8 store read buffered through worker threads (lowbit runs left out,
    as int8 slots cannot take low-precision copies)."""
    from expertcache import cli
    from expertcache.engine.quant import ExpertFormat
    from expertcache.lab.costmodel import CALIBRATION, HardwareProfile
    out = tmp_path / "profile.json"
    assert cli.main(["calibrate-hw", "--store-dir", str(tmp_path / "int8"), "--store-dtype", "int8", "--slot-dtype",
                     "int8", "--read-mode", "buffered", "--io", "threads", "--repeats", "1", "--out", str(out)]) == 0
    prof = HardwareProfile.load(out)
    runs = [r["policy"] for r in prof.calibration]
    assert len(runs) == len(CALIBRATION) - 2 and not any("lowbit" in r for r in runs)
    fmt = ExpertFormat.parse("int8")
    from expertcache.engine.stores import ALIGN
    assert prof.expert_bytes == -(-encoded_bytes(((128, 160), (160, 64)), fmt) // ALIGN) * ALIGN
    assert "one buffered-dontneed read alone" in prof.source, prof.source
    assert (prof.slot_dtype, prof.mode) == ("int8", "decode")  # what tune checks a profile against
    unfitted = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("unfitted: "))
    assert unfitted == f"unfitted: {', '.join(prof.unfitted) or 'none'}" and "(" not in unfitted


def test_calibrate_hw_refuses_to_write_a_profile_its_reader_would_refuse(tmp_path, capsys, monkeypatch):
    """A fit that leaves fetch_bandwidth infinite (no time per fetch, as under load) ends calibrate-hw with exit 2
    and one line, writing nothing: save runs the check that load runs."""
    from dataclasses import replace

    from expertcache import cli
    from expertcache.errors import BadInput
    from expertcache.lab import costmodel
    bad = replace(costmodel.DATASHEET["rtx3090-qwen3-next"], fetch_bandwidth=float("inf"))
    with pytest.raises(BadInput, match="fetch_bandwidth=inf"):
        bad.save(tmp_path / "direct.json")
    monkeypatch.setattr(costmodel, "measure_profile", lambda *a, **k: bad)
    out = tmp_path / "profile.json"
    assert cli.main(["calibrate-hw", "--store", "ram", "--repeats", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress bar's lines
    assert err.count("error:") == 1 and "fetch_bandwidth=inf" in last and "calibrate-hw" in last, err
    assert not out.exists() and not (tmp_path / "direct.json").exists()


def test_profiles_are_versioned(tmp_path, capsys):
    """A version-1 profile (before the version field) loads with its newer terms unmeasured; a
    later version, or a field this version does not know, is refused in one line."""
    import json
    from dataclasses import asdict

    from expertcache import cli
    from expertcache.engine.stats import RunStats
    from expertcache.errors import BadInput
    from expertcache.lab.costmodel import DATASHEET, PROFILE_VERSION, HardwareProfile
    p = DATASHEET["rtx3090-qwen3-next"]
    old = {k: v for k, v in asdict(p).items() if k not in ("version", "lowbit_fetch_s", "prefetch_s", "prediction_s",
                                                          "unfitted", "exposed_prefetch_s")}
    (tmp_path / "v1.json").write_text(json.dumps(old))
    v1 = HardwareProfile.load(tmp_path / "v1.json")
    s = RunStats(tokens=10, moe_calls=480, sync_fetches=100, fetch_waits=50, lowbit_fetches=30, lowbit_bytes=30 * 10**6)
    assert v1.version == 1 and v1.ms_per_token(s) == pytest.approx(p.ms_per_token(s))
    p.save(tmp_path / "current.json")
    assert HardwareProfile.load(tmp_path / "current.json") == p and p.version == PROFILE_VERSION
    (tmp_path / "v2.json").write_text(json.dumps({**{k: v for k, v in asdict(p).items() if k != "exposed_prefetch_s"},
                                                  "version": 2}))
    assert HardwareProfile.load(tmp_path / "v2.json").exposed_prefetch_s == 0  # unmeasured
    for name, data, words in (("v9", {**asdict(p), "version": 9}, "version 9"),
                              ("odd", {**asdict(p), "speed": 1}, "unknown fields \\['speed'\\]"),
                              ("junk", "not json", "not a readable hardware profile"),
                              ("negative", {**asdict(p), "fetch_latency_s": -1}, "fetch_latency_s=-1"),
                              ("nan", {**asdict(p), "dense_s": float("nan")}, "dense_s=nan"),
                              ("nobandwidth", {**asdict(p), "fetch_bandwidth": 0}, "fetch_bandwidth=0"),
                              ("nolayers", {**asdict(p), "layers": 0}, "layers=0")):
        (tmp_path / f"{name}.json").write_text(json.dumps(data) if name != "junk" else data)
        with pytest.raises(BadInput, match=words):
            HardwareProfile.load(tmp_path / f"{name}.json")
    assert cli.main(["tune", "--profile", str(tmp_path / "v9.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "calibrate-hw" in err


def test_terms_the_runs_do_not_vary_are_not_fitted():
    from expertcache.lab.costmodel import identifiable
    counts = np.column_stack([np.ones(5), np.full(5, 48.0), [0, 1, 2, 3, 4], np.zeros(5), [1, 1, 1, 1, 1.01]])
    assert identifiable(counts, ("dense", "runs", "fetches", "never", "flat")) == (["dense", "fetches"],
                                                                                  ["runs", "never", "flat"])


def test_fit_profile_recovers_each_term_and_folds_constant_ones_into_dense():
    """Synthetic runs whose times follow known costs: the fitted profile gives them back, its
    estimate of each run is its time, and expert runs (k per token and layer in every run, as
    in decode) are folded into dense; flushed entries (none, as in decode) stay unmeasured; of a prediction's
    cost, its compute is what the engine timed and the rest is fitted."""
    from types import SimpleNamespace

    from expertcache.engine.stats import RunStats
    from expertcache.lab.costmodel import TimedRun, fit_profile
    rng = np.random.default_rng(3)
    layers, k, tokens = 6, 8, 100
    cost = {"fetch_waits": 4e-4, "sync_fetches": 2e-4, "lowbit_fetches": 5e-4, "background_fetches": 3e-4,
            "prefetch_fetches": 1e-4, "exposed_prefetches": 3e-5, "predictions": 6e-5, "substituted_calls": 2e-5}
    runs = []
    for i in range(14):
        s = RunStats(tokens=tokens, moe_calls=tokens * layers, expert_runs=tokens * layers * k,
                     **{t: int(rng.integers(0, 3 * tokens)) for t in cost})
        s.predict_s = 2e-5 * s.predictions  # of a prediction's cost, the compute the engine times itself
        seconds = 2e-3 + sum(c * getattr(s, t) / tokens for t, c in cost.items())
        runs.append(TimedRun(0.25, f"run {i}", seconds, s))
    p = fit_profile(runs, SimpleNamespace(expert_bytes=10**6), layers, k, "decode", "test")
    assert p.unfitted == ("expert_runs", "flushed") and p.dense_s == pytest.approx(2e-3, rel=1e-6)
    fitted = {"fetch_waits": p.fetch_latency_s, "sync_fetches": p.transfer_s, "lowbit_fetches": p.lowbit_fetch_s,
              "background_fetches": p.admission_s, "prefetch_fetches": p.prefetch_s,
              "exposed_prefetches": p.exposed_prefetch_s, "predictions": p.prediction_s,
              "substituted_calls": p.decision_s}
    assert fitted == pytest.approx(cost, rel=1e-6) and p.prediction_compute_s == pytest.approx(2e-5)
    for r in runs:
        assert p.ms_per_token(r.stats) == pytest.approx(1000 * r.seconds, rel=1e-6)


@pytest.mark.parametrize("room", ["all", "one", "not the full cache"])
def test_time_runs_opens_an_engine_a_cache_and_only_what_memory_holds(tiny, tmp_path, monkeypatch, room):
    """The runs of one cache share an engine. Where the engines do not fit in memory together, each round opens
    them one at a time; a run whose engine does not fit even alone is left out with `fitting`, and refused
    without it. (Memory is what the engine's own check is told: here, room for one engine or for all.)"""
    from expertcache.engine import engine as engine_module
    from expertcache.errors import NotEnoughMemory
    from expertcache.lab.costmodel import time_runs
    opened, most = [], [0]
    check = engine_module.Engine._check_memory

    def limited(self, cache, *args):
        open_now = [e for e in opened if not e.closed]
        if (room == "one" and open_now) or (room == "not the full cache" and cache.fraction == 1.0):
            raise NotEnoughMemory("this run would hold more than this machine has free")
        check(self, cache, *args)
        opened.append(self)
        most[0] = max(most[0], len(open_now) + 1)
    monkeypatch.setattr(engine_module.Engine, "_check_memory", limited)
    runs = [(1.0, "fetch-all"), (0.5, "fetch-all"), (0.5, "first-choice"), (0.5, "fetch-all+prefetch/router-ahead")]
    timed = time_runs(tiny["qwen3_moe"][0], runs, list(range(1, 12)), repeats=2, store_dir=tmp_path / "s", prompt=4,
                      fitting=True)
    kept = runs[1:] if room == "not the full cache" else runs
    assert [(t.cache, t.variant) for t in timed] == kept and all(t.seconds > 0 for t in timed)
    s = {v if c < 1 else "full": t.stats for (c, v), t in zip(kept, timed)}
    assert s["first-choice"].substitutions > 0 == s["fetch-all"].substitutions  # each its own variant
    assert s["fetch-all+prefetch/router-ahead"].predictions > 0 == s["fetch-all"].predictions
    if "full" in s:  # and its own cache
        assert s["full"].misses < s["fetch-all"].misses
    assert len(opened) == {"all": 2, "one": 1 + 2 * 3, "not the full cache": 3}[room]  # held, or opened each round
    assert most[0] == (1 if room != "all" else 2) and all(e.closed for e in opened)
    if room == "not the full cache":  # refused without `fitting`, and with it where no run is left
        for asked, fitting in ((runs, False), (runs[:1], True)):
            with pytest.raises(NotEnoughMemory):
                time_runs(tiny["qwen3_moe"][0], asked, list(range(1, 12)), repeats=1, store_dir=tmp_path / "s",
                          prompt=4, fitting=fitting)
        assert all(e.closed for e in opened)


@pytest.mark.parametrize("policy", ["quality-first", "first-choice:beta=0.3"])
def test_admission_with_top_k_slots_is_skipped_not_fatal(traced, policy):
    """A cache of exactly top-k slots a layer: in a window every slot can be needed by the token that would admit
    an expert, and the admission is then skipped (it is optional) in the engine and the replay alike."""
    path, ids, trace, _ = traced
    a = model_args(open_checkpoint(path).config)
    cache = CacheConfig(fraction=a.top_k / a.num_experts)
    engine = Engine(path, EngineConfig(cache=cache, initial="cold", policy=policy))
    assert engine.cache.per_layer == a.top_k
    x = torch.tensor(ids)
    for start in range(0, len(ids), 64):
        engine.forward(x[start:start + 64], 0)
    sim = replay(trace, policy, cache).stats
    fields = ("hits", "misses", "sync_fetches", "substitutions", "background_fetches", "moe_calls")
    assert [getattr(sim, f) for f in fields] == [getattr(engine.stats, f) for f in fields]
    engine.close()


def rewritten(out, dest, header=None, logits=None, raw_header=None):
    """The trace at `out` written to `dest` with `header` fields changed (a key given None: left out) and its logits
    replaced, byte for byte as write_trace lays it out but with no field recomputed but the checksum of new
    logits; or with `raw_header` bytes."""
    import json

    import crc32c

    from expertcache.lab.trace import FORMAT_VERSION
    t = read_trace(out)
    body = np.asarray(t.tokens).tobytes() + np.asarray(t.logits if logits is None else logits).tobytes()
    h = {k: v for k, v in {**t.header, "crc32c": crc32c.crc32c(body), **(header or {})}.items() if v is not None}
    raw = raw_header if raw_header is not None else json.dumps(h).encode()
    pad = (-(len(MAGIC) + 8 + len(raw))) % 64
    dest.write_bytes(MAGIC + struct.pack("<II", FORMAT_VERSION, len(raw) + pad) + raw + b" " * pad + body)
    return dest


@pytest.mark.parametrize("case, words", [
    ("context='abc'", "context='abc', which must be a whole number"),
    ("hidden_size=0", "hidden_size=0, which must be a whole number >= 1"),
    ("no expert_params", "no field 'expert_params'"),
    ("top_k=2.5", "top_k=2.5"),
    ("shape of fewer tokens", "logits of shape [100, 2, 8], not"),
    ("int8 logits", "dtype='int8', which must be one of float16, float32"),
    ("a NaN logit", "router logit nan of token 5, MoE layer 1, expert 3 is not finite"),
    ("an infinite logit", "router logit -inf of token 7"),
    ("header not JSON", "unreadable trace header"),
    ("header a list", "a JSON list, not an object"),
    ("header length past the end", "is truncated (its header runs to byte"),
    ("a flipped byte in the logits", "its tokens or logits do not match the checksum written with them"),
    ("bytes appended", "has 7 bytes past its logits"),
    ("a folder", "is a folder, not a trace"),
])
def test_a_corrupt_trace_is_one_line_not_a_traceback_or_a_replay(traced, tmp_path, capsys, case, words):
    """Every field of a trace's header is checked as it loads, and its logits before they are routed: a field of the
    wrong type or missing failed deep in the replay with a traceback, a header whose shape disagreed with its
    token count or whose dtype was not float replayed other numbers than the logits', NaN or infinite logits
    replayed routes no model made, a corrupt header failed with a JSON message naming no file, and a flipped byte
    in the logits replayed as a number the model never gave, and bytes appended past the logits went unnoticed."""
    from expertcache import cli
    _, _, trace, out = traced
    bad = tmp_path / "bad.ectrace"
    logits = np.asarray(trace.logits).copy()
    if case == "context='abc'":
        rewritten(out, bad, {"context": "abc"})
    elif case == "hidden_size=0":
        rewritten(out, bad, {"hidden_size": 0})
    elif case == "no expert_params":
        rewritten(out, bad, {"expert_params": None})
    elif case == "top_k=2.5":
        rewritten(out, bad, {"top_k": 2.5})
    elif case == "shape of fewer tokens":
        rewritten(out, bad, {"shape": [100, 2, 8]})
    elif case == "int8 logits":
        rewritten(out, bad, {"dtype": "int8", "shape": [300, 2, 8]}, logits.astype(np.int8))
    elif case in ("a NaN logit", "an infinite logit"):
        logits[5, 1, 3], logits[7, 0, 2] = (np.nan, 0) if case == "a NaN logit" else (0, -np.inf)
        rewritten(out, bad, logits=logits)
    elif case == "header not JSON":
        rewritten(out, bad, raw_header=b"\xff{not json")
    elif case == "header a list":
        rewritten(out, bad, raw_header=b"[1, 2]")
    elif case == "header length past the end":
        raw = bytearray(out.read_bytes())
        raw[len(MAGIC) + 4:len(MAGIC) + 8] = struct.pack("<I", 2**31)
        bad.write_bytes(bytes(raw))
    elif case == "a flipped byte in the logits":  # another finite number, which replayed as the model's
        raw = bytearray(out.read_bytes())
        raw[-5] ^= 0x01
        bad.write_bytes(bytes(raw))
    elif case == "bytes appended":  # another file's bytes after the logits: its header's counts read as the trace's
        bad.write_bytes(out.read_bytes() + b"trailer")
    else:
        bad.mkdir()
    assert cli.main(["simulate", str(bad), "--policies", "fetch-all", "--initial", "cold"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and words in err and "expertcache trace" in err, err


def test_a_trace_names_its_model_by_an_absolute_path(tiny, tmp_path, monkeypatch):
    """A trace recorded with a relative --model kept that relative path: replayed from another folder, `simulate`
    warm-started from another folder's routing counts of that name, or from none (cold), printing other numbers
    for the same trace and command."""
    path = tiny["olmoe"][0]
    monkeypatch.chdir(path.parent)
    t = record_trace(type(path)(path.name), list(range(1, 20)), tmp_path / "t.ectrace", 8, "float32")
    assert t.header["model"] == str(path.resolve())


def test_logits_of_any_float_dtype_replay_as_their_float32_values(traced):
    """The compiled routing read a caller's float64 logits into other routes than the same values' in float32."""
    from expertcache.lab.trace import Trace
    _, _, trace, _ = traced
    runs = [replay(Trace(trace.header, trace.tokens, np.asarray(trace.logits).astype(dtype)), "fetch-all",
                   CacheConfig(fraction=0.5)).stats for dtype in (np.float32, np.float64)]
    assert runs[0].sync_fetches == runs[1].sync_fetches and runs[0].hits == runs[1].hits


@pytest.mark.parametrize("field, value, words", [("calibration", 5, "calibration=5, which must be a list"),
                                                 ("unfitted", 5, "unfitted=5, which must be a list"),
                                                 ("overlap", "no", "overlap='no', which must be true or false"),
                                                 ("layers", 6.5, "layers=6.5, which must be a whole number"),
                                                 ("version", True, "of version True")])
def test_a_profile_field_of_another_type_is_one_line(traced, tmp_path, capsys, field, value, words):
    """A list that is a number failed with a traceback; overlap "no" was read as true (transfers priced as
    hidden); half a layer priced half a layer more; version true was read as version 1."""
    import json
    from dataclasses import asdict

    from expertcache import cli
    from expertcache.lab.costmodel import DATASHEET
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**asdict(DATASHEET["a6000-qwen3-30b"]), field: value}))
    assert cli.main(["simulate", str(traced[3]), "--policies", "fetch-all", "--initial", "cold", "--profile",
                     str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert words in err and str(path) in err and "calibrate-hw" in err, err


def test_a_profile_measured_on_another_model_is_refused(traced, tmp_path, capsys):
    """A calibrate-hw profile prices the model it was measured on: one of 48 layers and top-8 priced a 2-layer,
    top-2 trace's replay as if it were that model and printed the number; one of the trace's depth and top-k but
    of 9 MiB experts priced the trace's small ones at its reads' speed. A datasheet profile projects onto its own
    model by design, and a measured one of the trace's model runs."""
    import json
    from dataclasses import asdict, replace

    from expertcache import cli
    from expertcache.lab.costmodel import DATASHEET
    from expertcache.lab.trace import read_trace
    _, _, _, out = traced
    params = read_trace(out).header["expert_params"]
    measured = replace(DATASHEET["a6000-qwen3-30b"], calibration=({"cache": 0.25, "policy": "fetch-all"},))
    for name, profile in (("other", measured), ("other size", replace(measured, layers=2, top_k=2)),
                          ("same", replace(measured, layers=2, top_k=2, expert_bytes=2 * params)),
                          # a small expert's blob, padded to whole pages: past 4.5 bytes a parameter (it was refused)
                          ("padded", replace(measured, layers=2, top_k=2, expert_bytes=(4 * params + 4095) // 4096
                                             * 4096))):
        (tmp_path / f"{name}.json").write_text(json.dumps(asdict(profile)))
    run = ["simulate", str(out), "--policies", "fetch-all", "--initial", "cold", "--profile"]
    assert cli.main([*run, str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "measured on a model of 48 MoE layers, top-8" in err and str(out) in err, err
    assert "has 2, top-2" in err and "calibrate-hw --model" in err
    assert cli.main([*run, str(tmp_path / "other size.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"have {params:,} parameters" in err and "calibrate-hw --model" in err, err
    assert cli.main([*run, str(tmp_path / "same.json")]) == 0
    assert (4 * params + 4095) // 4096 * 4096 > 4.5 * params  # fp32, padded
    assert cli.main([*run, str(tmp_path / "padded.json")]) == 0
    assert cli.main([*run, "a6000-qwen3-30b"]) == 0
