"""Speculative prefetch: prefetch-only keeps the output exact; predictors and the estimator
work end to end on a tiny model calibrated in the test; on a sigmoid router (DeepSeek-V3) the
estimator learns the family's own scores, not a softmax's."""
import json
import shutil

import numpy as np
import pytest
import torch

from expertcache.choices import EVAL_TEXT
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import load_default_vectors
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.moe import PrefetchConfig
from expertcache.engine.predictors import Estimator
from expertcache.errors import BadInput
from expertcache.kernel.cache_state import PREFETCHES
from expertcache.kernel.routing import Router
from expertcache.lab.calibrate import calibrate, save_calibration
from expertcache.lab.bench import parse_variant
from expertcache.lab.prediction import (
    fit_estimator,
    prediction_routes,
    recall_per_layer,
    recall_table,
    record_states,
    routing_loss,
    train_estimator,
)
from expertcache.lab.simulator import replay
from expertcache.lab.trace import record_trace


@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrated") / "model"
    shutil.copytree(tiny["qwen3_moe"][0], path)
    ids = torch.randint(0, 96, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    c = calibrate(path, ids, context=128)
    assert c.counts.sum() == 600 * 2 * 2  # tokens x layers x top-k
    save_calibration(c, path, "random ids")
    fit_estimator(path, ids)
    return path, tiny["qwen3_moe"][1]


def decode(engine, ids, prompt=6):
    out = [engine.forward(ids[:prompt], 0)]
    for pos in range(prompt, len(ids)):
        out.append(engine.forward(ids[pos:pos + 1], pos))
    return torch.cat(out)


@pytest.mark.parametrize("predictor", ["router-ahead", "quasi-hidden", "estimator", "hybrid", "lookahead"])
@pytest.mark.parametrize("store", ["ram", "disk"])
def test_prefetch_only_is_exact(calibrated, predictor, store):
    path, hf = calibrated
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(path, EngineConfig(store=store, cache=CacheConfig(fraction=0.25),
                                       prefetch=PrefetchConfig(predictor, "prefetch")))
    torch.testing.assert_close(decode(engine, ids), ref, atol=1e-4, rtol=0)
    assert engine.stats.prefetch_fetches > 0
    engine.close()


@pytest.mark.parametrize("policy", ["threshold:tau=0.3", "first-choice", "substitute-all", "fetch-all"])
def test_fetched_prefetches_only_what_the_policy_would_fetch(calibrated, policy):
    """fetched=1: each token's prefetches are its predicted experts that the policy fetches when they miss (first
    choice, or weight >= tau), every such one not mapped, and never one it would substitute; fetch-all prefetches
    every prediction."""
    from expertcache.kernel.decisions import KINDS, LOAD
    path, _ = calibrated
    engine = Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25), policy=policy,
                                       prefetch=PrefetchConfig("quasi-hidden", fetched=True)))
    cache, E = engine.cache, engine.args.num_experts
    asked, loads, predict, take = [], [], engine.runner._predict_next, cache._take_log

    def taken():
        rows = take()
        loads.extend(b % E for op, _, b, c in rows if op == LOAD and KINDS[c] == "prefetch")
        return rows

    def spy(layer, x, ids, gates):
        before = cache.slot_of[layer + 1].copy()
        loads.clear()
        predict(layer, x, ids, gates)
        asked.append((engine.runner.predicted, before, list(loads)))
    cache._take_log, engine.runner._predict_next = taken, spy
    decode(engine, torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(7)))
    decoded = [a for a in asked if a[0].ids.shape[0] == 1]
    assert len(decoded) == 18 * (engine.args.num_moe_layers - 1)  # decode tokens x predicted layers
    tau = {"threshold:tau=0.3": 0.3, "first-choice": 2.0, "substitute-all": None, "fetch-all": 0.0}[policy]
    for predicted, before, started in decoded:
        ids, w = predicted.ids[0].tolist(), predicted.weights[0]
        fetched = [] if tau is None else [e for j, e in enumerate(ids) if j == 0 or w[j] >= tau]
        # with two slots a layer, a prefetch may evict a predicted expert, which is then prefetched too
        assert set(started) <= set(fetched) and {e for e in fetched if before[e] < 0} <= set(started)
    assert (engine.stats.prefetch_fetches > 0) == (tau is not None)
    engine.close()


@pytest.mark.parametrize("policy", ["fetch-all", "threshold:tau=0.3"])
def test_exposed_prefetches_are_those_of_calls_without_a_wait(calibrated, policy):
    """A prefetch read counts as exposed when the call that issues it has no fetch of its own to wait for
    (nothing hides its cost): per call, the prefetches it started, split by whether its fetch waits grew."""
    from expertcache.kernel.cache_state import FETCH_WAITS
    path, _ = calibrated
    engine = Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25), policy=policy,
                                       prefetch=PrefetchConfig("quasi-hidden")))
    runner, counts, split = engine.runner, engine.cache.state.counts, {True: 0, False: 0}
    call, predict = runner.__call__, runner._predict_next
    total = lambda i, name: int(counts[i]) + getattr(engine.stats, name)  # noqa: E731

    def calls(layer, x, router):
        runner.waits_before = total(FETCH_WAITS, "fetch_waits")
        return call(layer, x, router)

    def spy(layer, x, ids, gates):
        before = total(PREFETCHES, "prefetch_fetches")
        predict(layer, x, ids, gates)
        split[total(FETCH_WAITS, "fetch_waits") > runner.waits_before] += total(PREFETCHES, "prefetch_fetches") - before
    runner.__call__, runner._predict_next = calls, spy
    engine.model.moe = calls
    decode(engine, torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(7)))
    s = engine.stats
    assert s.prefetch_fetches == split[True] + split[False] and s.exposed_prefetches == split[False]
    assert 0 < s.exposed_prefetches < s.prefetch_fetches  # some calls wait, some do not
    engine.close()


def test_compiled_prefetch_equals_the_general_path(calibrated):
    """A decode token's prediction routed and prefetched in one compiled call (softmax routers without bias) starts
    the transfers the general path (Router.route, then the prefetch kernel) starts: same logits, counts and slots."""
    from dataclasses import replace
    path, _ = calibrated
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(8))
    runs = []
    for general in (False, True):
        engine = Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25), policy="threshold:tau=0.3",
                                           prefetch=PrefetchConfig("quasi-hidden", fetched=True)))
        if general:  # a zero bias routes the same, through the general path
            r = engine.runner.router
            engine.runner.router = replace(r, bias=np.zeros((engine.args.num_moe_layers, engine.args.num_experts),
                                                            np.float32))
        runs.append((decode(engine, ids), engine.stats.prefetch_fetches, engine.stats.sync_fetches,
                     engine.cache.slot_of.copy()))
        engine.close()
    (fast, *fast_counts), (slow, *slow_counts) = runs
    torch.testing.assert_close(fast, slow, atol=0, rtol=0)
    assert fast_counts[0] == slow_counts[0] > 0 and fast_counts[1] == slow_counts[1]
    assert (fast_counts[2] == slow_counts[2]).all()


@pytest.mark.parametrize("budget", [0, 3])
def test_prefetch_budget_beyond_the_ranked_experts_is_refused(calibrated, budget):
    """The predictor ranks the next layer's top-k (2 here): a larger budget is refused, not cut silently."""
    engine = Engine(calibrated[0], EngineConfig(cache=CacheConfig(fraction=0.5)))
    with pytest.raises(BadInput, match=f"prefetch budget {budget}: .* budget=1..2"):
        engine.set_prefetch(PrefetchConfig(budget=budget))
    engine.set_prefetch(PrefetchConfig(budget=2))
    engine.close()


def test_a_predictor_attached_again_is_the_one_made_before(calibrated):
    """Each predictor is made once per engine, as a run attaches it, and kept across detaching and other
    predictors: a repetition of a variant runs the same predictor, not a fresh copy elsewhere in memory."""
    engine = Engine(calibrated[0], EngineConfig(cache=CacheConfig(fraction=0.5)))
    engine.set_prefetch(PrefetchConfig("quasi-hidden"))
    first = engine.runner.predictor
    for name in ("router-ahead", None, "quasi-hidden"):
        engine.set_prefetch(name and PrefetchConfig(name))
    assert engine.runner.predictor is first
    engine.close()


def test_speculative_runs_predicted_experts(calibrated):
    path, hf = calibrated
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(6))
    exact = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25)))
    spec = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25),
                                     prefetch=PrefetchConfig("quasi-hidden", "speculative")))
    a, b = decode(exact, ids), decode(spec, ids)
    assert torch.isfinite(b).all() and not torch.allclose(a, b)
    assert spec.stats.prefetch_fetches > 0


def test_recall_table(calibrated):
    path, _ = calibrated
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    table = recall_table(path, ids)
    assert set(table) == {"router-ahead", "quasi-hidden", "estimator", "hybrid", "lookahead"}
    assert all(len(r) == 1 and 0 <= r[0] <= 1 for r in table.values())


def test_routing_loss_follows_the_router():
    """A shift of every logit leaves a softmax router's routing, and its loss, unchanged; it moves a sigmoid
    router's scores, so its loss grows; a logit bias weighs the softmax as the router does."""
    g = torch.Generator().manual_seed(0)
    true = 3 * torch.randn(64, 16, generator=g)
    softmax, sigmoid = Router(4, True), Router(4, True, "sigmoid", 4, 2)
    assert routing_loss(softmax, true + 2.0, true).item() == pytest.approx(0, abs=1e-5)
    assert routing_loss(sigmoid, true + 2.0, true) > routing_loss(sigmoid, true, true) + 1.0
    pred, bias = true + torch.randn(64, 16, generator=g), 3 * torch.randn(16, generator=g).expand(64, 16)
    assert routing_loss(softmax, pred, true, bias).item() != pytest.approx(routing_loss(softmax, pred, true).item(),
                                                                           rel=0.05)


def test_estimator_learns_a_sigmoid_routers_scores(tiny, tmp_path):
    """Trained on DeepSeek-V3 states, the estimator's logits give the next layer's sigmoid scores (which the
    selection bias ranks and the gates weigh) within 0.03 on average; the softmax KL left them off by a shift."""
    path = tmp_path / "model"
    shutil.copytree(tiny["deepseek_v3"][0], path)
    ids = torch.randint(0, 96, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    save_calibration(calibrate(path, ids, context=128), path, "random ids")
    model, states = record_states(path, ids, context=128)
    assert model.router.selects
    dv = load_default_vectors(path)
    est = Estimator(model, dv, train_estimator(model, states, dv, epochs=20, batch=64))
    with torch.no_grad():
        pred = est.logits(0, states.resid[0], states.x[0], states.ids[0], states.weights[0])
    predicted, true = (model.router.route(r.numpy(), 1) for r in (pred, states.logits[1]))
    assert abs(predicted.scores - true.scores).mean() < 0.03
    assert recall_per_layer(est, states, model.args.top_k)[0] > 0.9


def test_compiled_quasi_hidden_equals_torch():
    """Decode's compiled quasi-hidden prediction gives the logits of the PyTorch formula."""
    from expertcache.engine.predictors import QuasiHidden, make_predictor
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    p = make_predictor("quasi-hidden", engine.model, engine.path)
    assert isinstance(p, QuasiHidden)
    g = torch.Generator().manual_seed(0)
    resid = torch.randn(1, engine.args.hidden_size, generator=g)
    ids = torch.randperm(engine.args.num_experts, generator=g)[:engine.args.top_k][None]
    gates = torch.softmax(torch.randn(1, engine.args.top_k, generator=g), -1)
    compiled = p.logits(2, resid, None, ids, gates)
    reference = p._router_logits(2, p.quasi_hidden(2, resid, ids, gates))
    torch.testing.assert_close(compiled, reference, atol=1e-5, rtol=1e-5)


def test_unneeded_queued_prefetches_are_dropped_unread(tmp_path, monkeypatch):
    """Prefetches still queued for a worker when their layer's routes are known and not among them are
    dropped: the read never happens, the slot is free, and they stop counting as prefetches; started and
    needed ones land. (io_uring hands every read to the kernel at once: nothing waits in a queue there.)"""
    import os
    import threading

    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path,
                                       cache=CacheConfig(fraction=0.25, io="threads")))
    cache, workers = engine.cache, engine.cache.cfg.io_workers
    layer = 2
    absent = [e for e in range(engine.args.num_experts) if cache.slot_of[layer, e] < 0][:workers + 4]
    gate, started, real = threading.Event(), threading.Semaphore(0), os.preadv

    def held(*a):  # every worker's read waits until the queue behind them has been looked at
        started.release()
        gate.wait()
        return real(*a)
    monkeypatch.setattr(os, "preadv", held)
    cache.prefetch(layer, np.array(absent), 0)
    for _ in range(workers):
        assert started.acquire(timeout=60)  # the first `workers` prefetches are being read; the last 4 are queued
    needed = np.array([[absent[1], absent[workers + 1]]])
    assert cache.drop_prefetches(layer, needed) == 3  # queued and not needed
    gate.set()
    cache.finish_all()
    monkeypatch.setattr(os, "preadv", real)
    landed = [cache.slot_of[layer, e] >= 0 for e in absent]
    assert landed == [True] * workers + [False, True, False, False]
    assert not cache.pending and not cache.state.pending.any()
    assert cache.state.counts[PREFETCHES] == workers + 1
    assert (cache.state.owner >= 0).sum() == cache.num_slots - 3  # the dropped prefetches' slots are free
    engine.close()


def test_a_prefetch_does_not_evict_the_other_predictions():
    """A prefetch evicts the layer's least recently used slot; the predicted experts already resident are kept
    from it (the layer is about to use them), and nothing stays protected after."""
    layer, runs = 2, []
    for hold in (False, True):
        engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25)))
        cache = engine.cache
        absent = next(e for e in range(engine.args.num_experts) if cache.slot_of[layer, e] < 0)
        before = cache.slot_of[layer].copy()
        kept = np.array(runs[0] if hold else [], np.int64)
        cache.prefetch_routed(layer, np.array([absent]), 0, np.concatenate([kept, [absent]]))
        cache.finish_all()
        evicted = np.flatnonzero((before >= 0) & (cache.slot_of[layer] < 0))
        assert cache.slot_of[layer, absent] >= 0 and len(evicted) == 1 and not cache.state.protected.any()
        runs.append(evicted)
        engine.close()
    assert runs[1][0] != runs[0][0]  # held, the first run's victim stayed; another slot went


def test_a_prefetch_into_a_full_hold_evicts_as_before():
    """Where every slot of the layer holds a prediction, the prefetch still loads (evicting one of them) rather
    than calling the cache too small."""
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=8 / 128)))  # top-8 of 128
    cache, layer = engine.cache, 2
    resident = np.flatnonzero(cache.slot_of[layer] >= 0)
    absent = next(e for e in range(engine.args.num_experts) if cache.slot_of[layer, e] < 0)
    assert len(resident) == engine.args.top_k  # the smallest cache: a slot per routed expert
    cache.prefetch_routed(layer, np.array([absent]), 0, np.concatenate([resident, [absent]]))
    cache.finish_all()
    assert cache.slot_of[layer, absent] >= 0 and (cache.slot_of[layer] >= 0).sum() == engine.args.top_k
    assert not cache.state.protected.any()
    engine.close()


def test_router_ahead_decode_path_equals_torch():
    """Decode's compiled router-ahead prediction gives the logits of its PyTorch product."""
    from expertcache.engine.predictors import RouterAhead, make_predictor
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    p = make_predictor("router-ahead", engine.model, engine.path)
    assert isinstance(p, RouterAhead)
    x = torch.randn(1, engine.args.hidden_size, generator=torch.Generator().manual_seed(0))
    fast = p.decode_logits(2, None, x, None, None)
    torch.testing.assert_close(torch.from_numpy(fast), p.logits(2, None, x, None, None), atol=1e-5, rtol=1e-5)


def test_router_ahead_routes_and_predicts_in_one_call():
    """Router-ahead computes a decode token's routing at layer l and its prediction for l+1 in one compiled call:
    the routing is the engine's own, the prediction is its product on that same input, taken once; a prediction
    for another input is computed afresh, not reused."""
    from expertcache.engine.moe import route
    from expertcache.engine.predictors import make_predictor
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    p, model = make_predictor("router-ahead", engine.model, engine.path), engine.model
    g = torch.Generator().manual_seed(3)
    x, other = (torch.randn(1, engine.args.hidden_size, generator=g) for _ in range(2))
    weight = model.moe_layers[2]["router"]
    fused, plain = p.route(2, x, weight, model.router), route(x, weight, model.router, 2)
    assert np.array_equal(fused.ids, plain.ids) and np.array_equal(fused.weights, plain.weights)
    want = p.logits(2, None, x, None, None)
    torch.testing.assert_close(torch.from_numpy(p.decode_logits(2, None, x, None, None)), want, atol=1e-5, rtol=1e-5)
    assert p._ahead is None  # taken
    p.route(2, x, weight, model.router)
    torch.testing.assert_close(torch.from_numpy(p.decode_logits(2, None, other, None, None)),
                               p.logits(2, None, other, None, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,threads", [("quasi-hidden", 1), ("estimator", 1), ("hybrid", 1), ("lookahead", 1),
                                          ("lookahead", 2)])
def test_compiled_prediction_equals_torch(name, threads, monkeypatch):
    """Decode's compiled prediction (quasi-hidden's state, and the estimator net on it or on the next layer's
    attention run ahead) gives the logits of the PyTorch path, on every layer; the lookahead's with its sum and
    products split over threads too (as at real size)."""
    from expertcache.engine import predictors
    from expertcache.engine.predictors import QuasiHidden, make_predictor
    monkeypatch.setattr(predictors.threads, "parts", lambda weight_bytes: threads)
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    engine.forward(torch.tensor([5, 6, 7]), 0)  # keys and values for the attention run ahead at position 3
    engine.model.position = 3
    p = make_predictor(name, engine.model, engine.path)
    g = torch.Generator().manual_seed(1)
    a = engine.args
    for layer in range(a.num_moe_layers - 1):
        resid = torch.randn(1, a.hidden_size, generator=g)
        ids = torch.randperm(a.num_experts, generator=g)[:a.top_k][None]
        w = torch.softmax(torch.randn(1, a.top_k, generator=g), -1)
        fast = p.decode_logits(layer, resid, resid, ids.numpy()[0], w.numpy()[0])
        want = p._router_logits(layer, QuasiHidden.quasi_hidden(p, layer, resid, ids, w)) if name == "quasi-hidden" \
            else p.logits(layer, resid, resid, ids, w)
        torch.testing.assert_close(torch.from_numpy(fast), want, atol=1e-5, rtol=1e-5)
    engine.close()


def test_compiled_estimator_with_the_previous_tokens_experts_equals_torch():
    """The compiled estimator adds the previous token's experts as the PyTorch net does, and they change the
    prediction; with none given it predicts as with weights 0."""
    from expertcache.engine.predictors import make_predictor
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    p, a = make_predictor("estimator", engine.model, engine.path), engine.args
    g = torch.Generator().manual_seed(2)
    resid = torch.randn(1, a.hidden_size, generator=g)
    ids = torch.randperm(a.num_experts, generator=g)[:a.top_k][None]
    w = torch.softmax(torch.randn(1, a.top_k, generator=g), -1)
    prev = (torch.randperm(a.num_experts, generator=g)[:a.top_k][None], torch.softmax(torch.randn(1, a.top_k), -1))
    fast = p.decode_logits(1, resid, resid, ids.numpy()[0], w.numpy()[0], (prev[0].numpy()[0], prev[1].numpy()[0]))
    torch.testing.assert_close(torch.from_numpy(fast), p.logits(1, resid, resid, ids, w, prev), atol=1e-5, rtol=1e-5)
    without = p.decode_logits(1, resid, resid, ids.numpy()[0], w.numpy()[0])
    torch.testing.assert_close(torch.from_numpy(without), p.logits(1, resid, resid, ids, w, (prev[0], 0 * prev[1])),
                               atol=1e-5, rtol=1e-5)
    assert np.abs(fast - without).max() > 0.1
    engine.close()


def test_a_decode_token_predicts_with_its_own_sequences_previous_token(calibrated, monkeypatch):
    """The estimator is given, at layer l, the experts that the same sequence's previous token ran at layer
    l+1: after a prompt, its last token's; never those of another sequence swapped in (interleaved requests),
    of a decode batch, or of a token that does not continue where the sequence stopped."""
    from expertcache.engine.generate import TextGeneration, batch_logits
    from expertcache.engine.sampling import SamplingParams
    path, _ = calibrated
    engine = Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.5),
                                       prefetch=PrefetchConfig("estimator", "prefetch")))
    seen, routes = [], []
    predictor, runner = engine.runner.predictor, engine.runner
    real_predict, real_logits, real_call = predictor.decode_logits, predictor.logits, type(runner).__call__
    batched = []

    def spy(layer, resid, x, ids, weights, prev=None):
        seen.append((layer, None if prev is None else tuple(a.copy() for a in prev)))
        return real_predict(layer, resid, x, ids, weights, prev)

    def spy_logits(layer, resid, x, ids, weights, prev=None):
        batched.append(prev)
        return real_logits(layer, resid, x, ids, weights, prev)

    def recording(self, layer, x, router):
        out = real_call(self, layer, x, router)
        routes.append((layer, self.previous[layer][0].copy()))
        return out
    monkeypatch.setattr(predictor, "decode_logits", spy)
    monkeypatch.setattr(predictor, "logits", spy_logits)
    monkeypatch.setattr(type(runner), "__call__", recording)
    ids = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(7))
    engine.forward(ids[:6], 0)
    last = {layer: r for layer, r in routes}  # the prompt's last token's experts, per layer
    engine.forward(ids[6:7], 6)
    assert [l for l, _ in seen] == [0] and seen[0][1] is not None
    np.testing.assert_array_equal(seen[0][1][0], last[1])
    seen.clear()
    engine.forward(ids[7:8], 3)  # not where the sequence stopped: rewriting from an earlier position
    assert seen == [(0, None)]
    seen.clear()
    gens = [TextGeneration(engine, ids[:4].tolist(), SamplingParams(max_tokens=3), own_kv=True) for _ in range(2)]
    for g in gens:
        g.step()  # each prefills in its own keys and values
    seen.clear()
    gens[0].step()  # the second sequence ran last: the first's decode token does not follow it
    assert seen == [(0, None)]
    seen.clear()
    batched.clear()
    batch_logits(engine, gens)
    assert seen == [] and batched == [None]  # a decode batch: several sequences, no one previous token
    engine.close()


def test_a_lookahead_without_expert_sketches_is_refused_in_one_line(calibrated, tmp_path):
    """A lookahead.safetensors of the format before the expert sketches (the net alone) names the command that
    retrains it."""
    from expertcache.engine.checkpoint import LOOKAHEAD_FILE
    from expertcache.engine.predictors import EstimatorNet, save_estimator
    from expertcache.errors import CheckpointError
    path = tmp_path / "model"
    shutil.copytree(calibrated[0], path)
    a = Engine(path, EngineConfig(store="ram")).args
    save_estimator(EstimatorNet(a.hidden_size, a.num_experts, a.num_moe_layers - 1, 32), path, [], {}, LOOKAHEAD_FILE)
    with pytest.raises(CheckpointError, match=r"older expertcache \(without expert sketches\).*predict --train") as e:
        Engine(path, EngineConfig(store="ram", prefetch=PrefetchConfig("lookahead", "prefetch")))
    assert "\n" not in str(e.value)


def test_an_expert_sketch_keeps_its_strongest_neurons_and_the_best_low_rank_map_of_the_rest():
    """ExpertSketch.fit keeps exact the neurons that carry most of an expert's output, and recovers the rest
    where it is a rank-r linear map of the inputs plus a constant, from more tokens than channels (the primal
    system) and from fewer (the dual); an expert never routed sketches to zero; the compiled sum for a decode
    token equals `estimate`, for SwiGLU and GPT-OSS's clamped activation."""
    from expertcache.engine.experts import SWIGLU, ExpertKind, swiglu
    from expertcache.engine.predictors import ExpertSketch
    from expertcache.kernel import dense_decode
    g = torch.Generator().manual_seed(0)
    H, Fd, r, n = 24, 6, 3, 2
    w13, w2 = torch.randn(2 * Fd, H, generator=g), torch.randn(H, Fd, generator=g)
    w2[:, :n] *= 10  # the two strongest neurons
    lin = torch.randn(H, r, generator=g) @ torch.randn(r, H, generator=g)
    for tokens in (200, 16):
        x = torch.randn(tokens, H, generator=g)
        strong = swiglu(x, torch.cat([w13[:n], w13[Fd:Fd + n]]), w2[:, :n])
        y = strong + x @ lin + 0.5
        fit = ExpertSketch.fit(x, y, [w13, w2], SWIGLU, r, n, ridge=1e-6)
        kept, strong_rows = fit[8], w2[:, :n].T
        torch.testing.assert_close(kept[kept[:, 0].argsort()], strong_rows[strong_rows[:, 0].argsort()])  # in any order
        sketch = ExpertSketch(*(t[None, None] for t in fit))
        x2 = torch.randn(5, H, generator=g) if tokens > H else x[:5]  # the dual fit is exact on what it saw
        want = swiglu(x2, torch.cat([w13[:n], w13[Fd:Fd + n]]), w2[:, :n]) + x2 @ lin + 0.5
        got = sketch.estimate(0, x2, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1))
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert all(float(t.abs().sum()) == 0 for t in ExpertSketch.fit(torch.zeros(0, H), None, [w13, w2], SWIGLU, r, n))
    for kind in (SWIGLU, ExpertKind(True, 7.0, 1.702)):
        arrays = [torch.randn(1, 4, *shape, generator=g) for shape in ExpertSketch.shapes(H, r, n)]
        sketch, x, resid = ExpertSketch(*arrays, kind=kind), torch.randn(1, H, generator=g), torch.randn(H)
        ids, w = torch.tensor([[2, 0]]), torch.tensor([[0.7, 0.3]])
        for parts in (1, 2, 3):  # one thread, or the experts split over threads
            out, z, acc = np.empty(H, np.float32), np.empty((parts, r), np.float32), np.empty((parts, H), np.float32)
            dense_decode.sketch_sum(resid.numpy(), x.numpy()[0], *(t[0].numpy() for t in sketch.arrays),
                                    ids.numpy()[0], w.numpy()[0], *sketch.activation, z, acc, out)
            torch.testing.assert_close(torch.from_numpy(out), resid + sketch.estimate(0, x, ids, w)[0], atol=1e-4,
                                       rtol=1e-4)


def test_expert_sketches_explain_more_of_a_layers_output_than_default_vectors():
    """On held-out text of the built-in model, the shipped sketches leave less of each MoE layer's output
    unexplained than the default vectors, on every layer they cover."""
    from expertcache.engine.checkpoint import LOOKAHEAD_FILE, load_default_vectors
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.engine.predictors import load_estimator
    from expertcache.lab.calibrate import encode_text
    from expertcache.lab.prediction import record_states
    ids = encode_text(BUILTIN_MODEL, EVAL_TEXT.read_text(), 300)
    model, s = record_states(BUILTIN_MODEL, ids, pre=True)
    sketch, dv = load_estimator(BUILTIN_MODEL, model, LOOKAHEAD_FILE)[2], load_default_vectors(BUILTIN_MODEL)
    for l in range(len(s.x) - 1):
        true = s.pre[l + 1] - s.resid[l]  # layer l's MoE output
        default = (dv[l][s.ids[l]] * s.weights[l].unsqueeze(-1)).sum(1)
        sketched = sketch.estimate(l, s.x[l], s.ids[l], s.weights[l])
        assert (sketched - true).norm() < 0.6 * (default - true).norm(), l


@pytest.mark.parametrize("case", ["older", "another model", "corrupt", "truncated", "corrupt default vectors",
                                  "a NaN weight", "integer weights", "hybrid layers out of range", "a flipped byte",
                                  "NaN default vectors", "integer default vectors", "another model's default vectors",
                                  "a flipped byte in the default vectors"])
def test_an_estimator_that_does_not_fit_is_refused_in_one_line(calibrated, tmp_path, case):
    """An estimator.safetensors of the format before the per-transition nets, one trained for another model, or
    one that is not a safetensors file names the command that retrains it (and corrupt default vectors, the
    command that recomputes them); the model itself still loads without a predictor. A NaN weight or vector, or
    integer ones, predicted silently worse (or failed in a compiled call), and hybrid layers out of range were
    ignored; a flipped byte in a weight read as another number (the checksum the file was written with)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from expertcache.engine.checkpoint import ESTIMATOR_FILE
    from expertcache.engine.predictors import EstimatorNet, save_estimator
    from expertcache.engine.tensor_file import CHECKSUM, tensors_checksum
    from expertcache.errors import CheckpointError

    def flip(file):  # a byte of the last tensor's data, which safetensors lays out at the end
        raw = bytearray(file.read_bytes())
        raw[-3] ^= 0x10
        file.write_bytes(bytes(raw))
    path = tmp_path / "model"
    shutil.copytree(calibrated[0], path)
    f = path / ESTIMATOR_FILE
    if case == "older":
        save_file({"fc1.weight": torch.zeros(4, 4)}, str(f), metadata={"hidden": "4"})
    elif case == "another model":
        save_estimator(EstimatorNet(16, 8, 5, 32), path, [], {})
    elif case == "corrupt":
        f.write_bytes(b"\x00" * 100)
    elif case == "truncated":
        f.write_bytes(f.read_bytes()[:1000])
    elif case in ("a NaN weight", "integer weights", "hybrid layers out of range"):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
        tensors = load_file(f)
        if case == "a NaN weight":
            tensors["transitions.0.fc2.weight"][3, 1] = float("nan")
        elif case == "integer weights":
            tensors = {k: v.long() for k, v in tensors.items()}
        else:
            meta["hybrid_layers"] = "[0, 9]"
        save_file(tensors, str(f), metadata=meta | {CHECKSUM: tensors_checksum(tensors)})
    elif case == "a flipped byte":
        flip(f)
    elif case == "corrupt default vectors":
        (path / "default_vectors.safetensors").write_bytes(b"\x00" * 100)
    elif case == "a flipped byte in the default vectors":
        flip(path / "default_vectors.safetensors")
    else:
        dv = path / "default_vectors.safetensors"
        vectors = load_file(dv)
        if case == "NaN default vectors":
            vectors["default_vectors"][1, 2, 3] = float("inf")
        elif case == "integer default vectors":
            vectors["default_vectors"] = vectors["default_vectors"].long()
        else:
            vectors["default_vectors"] = vectors["default_vectors"][:, :, :-1].contiguous()
        save_file(vectors, str(dv))
    message = {"older": r"older expertcache.*predict --train", "another model": r"another model.*predict --train",
               "corrupt": r"unreadable.*predict --train", "truncated": r"unreadable.*predict --train",
               "corrupt default vectors": r"default_vectors.safetensors is unreadable.*calibrate",
               "a NaN weight": r"tensor transitions.0.fc2.weight holds NaN or infinite values.*predict --train",
               "integer weights": r"holds int64, not floats.*predict --train",
               "hybrid layers out of range": r"hybrid layers \[0, 9\] are not among its 1 layer transitions",
               "a flipped byte": r"estimator.safetensors: its tensors do not match the checksum.*predict --train",
               "a flipped byte in the default vectors": r"default_vectors.safetensors: its tensors do not match the "
                                                        r"checksum.*calibrate",
               "NaN default vectors": r"default_vectors.safetensors holds default vectors with NaN.*calibrate",
               "integer default vectors": r"default_vectors.safetensors holds default vectors of int64.*calibrate",
               "another model's default vectors": r"default_vectors.safetensors\) of shape \(2, 8, 31\) do not fit "
                                                  r"the model's 2 MoE layers x 8 experts x hidden size 32"}[case]
    with pytest.raises(CheckpointError, match=message) as e:
        Engine(path, EngineConfig(store="ram", prefetch=PrefetchConfig("estimator", "prefetch")))
    assert "\n" not in str(e.value)
    Engine(path, EngineConfig(store="ram")).close()


def test_recorded_states_give_each_token_its_previous_tokens_experts(calibrated):
    """LayerStates.previous: the token before in the same window, and weight 0 at a window's start."""
    model, s = record_states(calibrated[0], list(range(1, 40)), context=16)
    ids, weights = s.previous(1)
    assert s.starts.nonzero().flatten().tolist() == [0, 16, 32]
    assert (weights[s.starts] == 0).all() and (weights[~s.starts].sum(-1) > 0).all()
    torch.testing.assert_close(ids[1:16], s.ids[1][:15])
    torch.testing.assert_close(weights[17:32], s.weights[1][16:31])


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "deepseek_v2"])
def test_the_estimator_trains_and_predicts_exactly_on_other_families(tiny, tmp_path, family):
    """Trained on a router with a logit bias (GPT-OSS), with linear attention and a shared expert (Qwen3-Next) or
    with latent attention (DeepSeek-V2), the estimator and the lookahead predict through decode and leave its
    logits equal to HF's: the attention run ahead writes only keys and values (or latents) that its layer
    writes again, and does not run on linear attention's state."""
    path = tmp_path / "model"
    shutil.copytree(tiny[family][0], path)
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    save_calibration(calibrate(path, ids, context=128), path, "random ids")
    fit_estimator(path, ids, epochs=3)
    ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = tiny[family][1](ids[None]).logits[0]
    for predictor in ("estimator", "lookahead"):
        engine = Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25),
                                           prefetch=PrefetchConfig(predictor, "prefetch")))
        torch.testing.assert_close(decode(engine, ids), ref, atol=1e-4, rtol=0)
        assert engine.stats.predictions >= len(ids) - 6  # one a decode token at least (a prompt's: one a token)
        engine.close()


def test_predict_trains_and_measures_from_the_command_line(tmp_path, capsys):
    """`predict --train` saves an estimator that `predict` then loads and scores, each with its progress bar."""
    from expertcache import cli
    from expertcache.engine.engine import BUILTIN_MODEL
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    (path / "estimator.safetensors").unlink()
    (path / "lookahead.safetensors").unlink()
    common = ["--model", str(path), "--max-tokens", "600"]
    assert cli.main(["predict", "--train", *common, "--epochs", "2"]) == 0
    err = capsys.readouterr().err
    assert "train 4->5" in err and "lookahead 4->5" in err and (path / "lookahead.safetensors").exists()
    out = tmp_path / "recall.json"
    assert cli.main(["predict", *common, "--predictors", "estimator", "--json", str(out)]) == 0
    assert "record" in capsys.readouterr().err
    recall = json.loads(out.read_text())["estimator"]
    assert len(recall) == 5 and all(0.1 < r <= 1 for r in recall)  # above chance (8 of 128) after 2 epochs


def test_predict_measures_speculative_execution_from_the_command_line(tmp_path, capsys):
    """`predict --speculative` runs each predictor's experts in place of the router's: its perplexity against the
    exact model's on the same tokens, with a CI around the increase, and its greedy agreement; --train with it is a
    usage error."""
    from expertcache import cli
    out = tmp_path / "speculative.json"
    assert cli.main(["predict", "--speculative", "--max-tokens", "512", "--predictors", "quasi-hidden", "lookahead",
                     "--json", str(out)]) == 0
    assert "| lookahead |" in capsys.readouterr().out
    r = json.loads(out.read_text())
    for name in ("quasi-hidden", "lookahead"):
        inc = r["increase"][f"speculative/{name}"]
        assert inc["ci"][0] <= inc["pct"] <= inc["ci"][1]
        assert 0 <= r["generation"][f"speculative/{name}"]["identical_token_share"] <= 1
    # the lookahead's routes are nearly the router's, quasi-hidden's much less so (here +0.05% against +8.2%)
    assert r["increase"]["speculative/lookahead"]["pct"] < r["increase"]["speculative/quasi-hidden"]["pct"]
    assert cli.main(["predict", "--speculative", "--train"]) == 2
    assert "--train first" in capsys.readouterr().err
    assert cli.main(["predict", "--speculative", "--max-tokens", "10"]) == 2
    assert "--max-tokens 512 or more" in capsys.readouterr().err


def test_the_attention_run_ahead_is_the_layers_own_and_leaves_no_trace():
    """Given a layer's true input, the attention run ahead gives that layer's MoE input exactly, at the position
    of the forward; a forward after one run ahead on another input gives the logits it gives without; a decode
    batch runs none (linear attention: the families test)."""
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    model = engine.model
    engine.forward(torch.tensor([11, 12, 13, 14]), 0)
    want = engine.forward(torch.tensor([15]), 4).clone()
    h = model.embed[torch.tensor([15])].float()
    model.position = 4
    ahead = model.attention_ahead(0, h)
    torch.testing.assert_close(ahead, model.attention_block(0, h.clone(), 4)[1], atol=0, rtol=0)
    model.attention_ahead(1, torch.randn(1, engine.args.hidden_size))
    torch.testing.assert_close(engine.forward(torch.tensor([15]), 4), want, atol=0, rtol=0)
    model.position = None  # as a decode batch leaves it
    assert model.attention_ahead(0, h) is None
    engine.close()


def test_the_lookahead_trains_on_the_inputs_decode_gives_it():
    """The lookahead's training inputs for a recorded text (add_lookahead) are those decode computes for the same
    tokens one at a time: the attention run ahead against the exact keys of the tokens before."""
    from expertcache.engine.checkpoint import LOOKAHEAD_FILE
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.engine.predictors import load_estimator
    from expertcache.lab.prediction import add_lookahead, record_states
    ids = list(range(40, 52))
    model, states = record_states(BUILTIN_MODEL, ids, pre=True)
    add_lookahead(model, states, load_estimator(BUILTIN_MODEL, model, LOOKAHEAD_FILE)[2])
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0),
                                       prefetch=PrefetchConfig("lookahead", "prefetch")))
    seen, ahead = {}, engine.model.attention_ahead_token

    def spy(i, h, x_out):  # decode's compiled call
        ran = ahead(i, h, x_out)
        assert ran
        seen.setdefault(engine.model.position, []).append(torch.from_numpy(x_out.copy())[None])
        return ran
    engine.model.attention_ahead_token = spy
    decode(engine, torch.tensor(ids))
    assert sorted(seen) == list(range(6, len(ids)))
    for pos, inputs in seen.items():
        assert len(inputs) == engine.args.num_moe_layers - 1
        for l, x in enumerate(inputs):
            torch.testing.assert_close(x, states.ahead[l][pos:pos + 1], atol=1e-4, rtol=1e-4)
    engine.close()


@pytest.mark.parametrize("spec", ["fetch-all", "fetch-all+prefetch/lookahead", "fetch-all+speculative/estimator",
                                  "fetch-all+prefetch/quasi-hidden:budget=4,drop=0,fetched=1"])
def test_the_statistics_name_the_prefetch_as_the_policy_spec_gave_it(spec):
    """`Engine.variant`, which the verbs' statistics lines print, spells the policy and its prefetch as `--policy`
    took them, so the line can be pasted back."""
    from expertcache.lab.bench import parse_variant
    policy, prefetch = parse_variant(spec)
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25), policy=policy,
                                       prefetch=prefetch))
    assert engine.variant == spec
    assert parse_variant(engine.variant) == (policy, prefetch)
    engine.close()


@pytest.mark.parametrize("spec", ["fetch-all+prefetch/quasi-hidden", "fetch-all+prefetch/lookahead:budget=1",
                                  "threshold:tau=0.3+prefetch/estimator:fetched=1",
                                  "fetch-all+prefetch/estimator:confidence=0.5"])
def test_the_replay_prefetches_what_the_engine_does_in_decode(calibrated, spec, tmp_path):
    """Replayed in decode order with the predictors' routes recorded over the trace's tokens, a prefetching
    policy makes the engine's own decisions token by token: the same hits, fetches, prefetches and
    substitutions."""
    path, _ = calibrated
    ids = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(9)).tolist()
    trace = record_trace(path, ids, tmp_path / "t.ectrace", context=48, dtype="float32")
    policy, pre = parse_variant(spec)
    predictions = prediction_routes(path, ids, [pre.predictor], context=48)
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold", policy=policy, prefetch=pre))
    x = torch.tensor(ids)
    for pos in range(len(ids)):
        engine.forward(x[pos:pos + 1], pos)
    sim = replay(trace, spec, CacheConfig(fraction=0.25), window=1, predictions=predictions).stats
    fields = ("hits", "misses", "sync_fetches", "prefetch_fetches", "exposed_prefetches", "predictions",
              "substitutions")
    assert [getattr(sim, f) for f in fields] == [getattr(engine.stats, f) for f in fields]
    assert engine.stats.prefetch_fetches > 0
    engine.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_the_replay_prefetches_what_the_engine_does_on_other_routers(tiny, tmp_path, family):
    """On a sigmoid router with groups and a selection bias (DeepSeek-V3) and on a softmax router with a logit bias
    (GPT-OSS), whose predictions the engine routes outside the compiled prefetch, the replay prefetches as it does."""
    path = tmp_path / "model"
    shutil.copytree(tiny[family][0], path)
    ids = torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    save_calibration(calibrate(path, ids, context=128), path, "random ids")
    ids = ids[:40]
    trace = record_trace(path, ids, tmp_path / "t.ectrace", context=40, dtype="float32")
    predictions = prediction_routes(path, ids, ["quasi-hidden"], context=40)
    for spec in ("fetch-all+prefetch/quasi-hidden", "threshold:tau=0.3+prefetch/quasi-hidden:fetched=1",
                 "fetch-all+prefetch/quasi-hidden:confidence=0.3"):
        policy, pre = parse_variant(spec)
        engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold", policy=policy,
                                           prefetch=pre))
        x = torch.tensor(ids)
        for pos in range(len(ids)):
            engine.forward(x[pos:pos + 1], pos)
        sim = replay(trace, spec, CacheConfig(fraction=0.5), window=1, predictions=predictions).stats
        fields = ("hits", "misses", "sync_fetches", "prefetch_fetches", "exposed_prefetches", "substitutions")
        assert [getattr(sim, f) for f in fields] == [getattr(engine.stats, f) for f in fields], spec
        assert engine.stats.prefetch_fetches > 0
        engine.close()


def test_a_prefill_under_prefetch_makes_no_predictions():
    """A window of one sequence issues no prefetch, so under `prefetch` its predictions would be thrown away: none
    is made (speculation still makes them, to run on)."""
    x = torch.arange(1, 17)
    for mode, predicted in (("prefetch", False), ("speculative", True)):
        engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25),
                                           prefetch=PrefetchConfig("lookahead", mode)))
        engine.forward(x, 0)
        assert (engine.stats.predictions > 0) == predicted and (engine.stats.predict_s > 0) == predicted
        engine.forward(x[:1], 16)  # a decode token predicts in both
        assert engine.stats.predictions > 0
        engine.close()


def test_the_bounds_share_of_the_oracles_gain_is_paired_over_rounds(benchmark_script):
    """prefetch_bound.py's share: 0 for on-demand loading, 1 for the oracle, from the rounds' mean times; None
    where the oracle gained nothing; its interval holds the point."""
    bound = benchmark_script("prefetch_bound")
    on_demand, oracle = np.array([10.0, 20.0, 11.0]), np.array([8.0, 10.0, 9.0])
    variant = np.array([9.0, 19.0, 10.0])  # the second round's drift dwarfs what the variant saves
    resamples = np.random.default_rng(0).integers(0, 3, (200, 3))
    assert bound.share_of_gain(on_demand, on_demand, oracle, resamples)[0] == 0
    assert bound.share_of_gain(on_demand, oracle, oracle, resamples)[0] == pytest.approx(1)
    point, (low, high) = bound.share_of_gain(on_demand, variant, oracle, resamples)
    want = (41 / 38 - 1) / (41 / 27 - 1)  # on the mean times (0.15), not the mean of each round's share (0.32)
    assert point == pytest.approx(want) and low <= point <= high
    assert bound.share_of_gain(on_demand, variant, on_demand, resamples) == (None, None)


@pytest.mark.parametrize("predictor", ["lookahead", "quasi-hidden"])
def test_a_predictor_replayed_prefetches_what_it_did_in_place(calibrated, predictor, benchmark_script):
    """prefetch_bound.py --replayed: a predictor's logits recorded in a decode and replayed at a lookup's cost make
    the same prefetches and synchronous fetches as the predictor run in place, and leave the same slots."""
    bound = benchmark_script("prefetch_bound")
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    prompt, tokens = ids[:6], ids[6:]
    engine = Engine(calibrated[0], EngineConfig(store="ram", cache=CacheConfig(fraction=0.25), policy="fetch-all",
                                                prefetch=PrefetchConfig(predictor)))
    runs = []
    for replayed in (False, True):
        if replayed:
            rows = bound.recorded_rows(engine, prompt, tokens)
            assert rows.shape == (len(tokens), 2, 8) and not rows[:, 0].any() and rows[:, 1].any()
            engine.runner.predictor = bound.replayed_predictor(engine.model, rows, "replayed")
        figures = bound.decode(engine, prompt, tokens)
        runs.append((figures["prefetches"], figures["sync_fetches"], engine.cache.slot_of.copy()))
    assert runs[0][0] > 0 and runs[0][:2] == runs[1][:2] and (runs[0][2] == runs[1][2]).all()
    engine.close()
