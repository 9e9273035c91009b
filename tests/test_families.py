"""GLM-4.5 and DeepSeek-V3: the sigmoid router with selection bias and groups against HF's,
substitutes within the allowed groups, and every verb on tiny models of both families."""
import json
import shutil

import numpy as np
import pytest
import torch
from hf_models import hf_config, save_tiny

from expertcache import cli
from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.kernel.routing import Router
from expertcache.policies import Route, make_policy

GROUPED = ["glm4_moe", "deepseek_v3"]


@pytest.mark.parametrize("family", GROUPED)
def test_sigmoid_router_matches_hf(family):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    c = hf_config(family)
    hf = (Glm4MoeTopkRouter if family == "glm4_moe" else DeepseekV3TopkRouter)(c)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(c.n_routed_experts, generator=g))
    x = torch.randn(256, c.hidden_size, generator=g)
    logits, w_ref, ids_ref = (t.detach() for t in hf(x))
    bias = hf.e_score_correction_bias.numpy()[None]
    router = Router(c.num_experts_per_tok, True, "sigmoid", c.n_group, c.topk_group, c.routed_scaling_factor, bias)
    r = router.route(logits.numpy(), 0)
    for t in range(len(x)):  # HF's top-k is unsorted: compare as expert -> gate
        ref = dict(zip(ids_ref[t].tolist(), (w_ref[t] / c.routed_scaling_factor).tolist()))
        got = dict(zip(r.ids[t].tolist(), r.weights[t].tolist()))
        assert got.keys() == ref.keys()
        np.testing.assert_allclose([got[e] for e in ref], list(ref.values()), rtol=1e-5)
    # the ranking follows the selection: biased scores, falling
    sel = np.take_along_axis(r.rows, r.ids, 1)
    assert (np.diff(sel, axis=1) <= 0).all() and np.isfinite(sel).all()
    # the bias and the groups both change the choice on this routing
    unbiased = Router(c.num_experts_per_tok, True, "sigmoid", c.n_group, c.topk_group).route(logits.numpy(), 0)
    ungrouped = Router(c.num_experts_per_tok, True, "sigmoid", 1, 1, 1.0, bias).route(logits.numpy(), 0)
    assert (np.sort(unbiased.ids) != np.sort(r.ids)).any(1).mean() > 0.2
    assert (np.sort(ungrouped.ids) != np.sort(r.ids)).any(1).mean() > 0.2


def test_substitutes_stay_in_the_allowed_groups():
    class Resident:  # a cache view with only what `decide` reads
        def __init__(self, resident):
            from expertcache.engine.cache import CacheConfig, ExpertCache
            from expertcache.engine.stores import ExpertShape
            self.cache = ExpertCache(CacheConfig(fraction=1.0), None, 2, None, torch.float32,
                                     shape=ExpertShape(1, 8, (2, 4), (4, 1)), fetch_bytes=1)
            self.cache.fill(0, np.array(resident))

    # selection row of a grouped router: experts 4..7 are outside the token's groups (-inf)
    row = np.array([0.9, 0.8, 0.3, 0.2, -np.inf, -np.inf, -np.inf, -np.inf], np.float32)
    route = Route(0, np.array([0, 1]), np.array([0.6, 0.4], np.float32), row)
    d = make_policy("substitute-all").decide(route, Resident([4, 5, 3]).cache)
    assert d.experts == [3, 1] and d.fetch == [1]  # 3 substitutes 0; no allowed expert is left for 1: fetched


@pytest.fixture(scope="module", params=GROUPED)
def tokenized(request, tmp_path_factory):
    """A tiny model of the family with the built-in model's tokenizer (so text verbs run)."""
    path = tmp_path_factory.mktemp(request.param)
    vocab = json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"]
    save_tiny(request.param, path, vocab_size=vocab)
    shutil.copy(BUILTIN_MODEL / "tokenizer.json", path / "tokenizer.json")
    assert cli.main(["calibrate", "--model", str(path), "--max-tokens", "512"]) == 0  # warm starts, study
    return path


def test_verbs_run(tokenized, tmp_path, capsys):
    m = str(tokenized)
    assert cli.main(["generate", "--model", m, "-n", "6", "--cache", "0.25", "--json", str(tmp_path / "g.json"),
                     "ROMEO."]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["stats"]["misses"] > 0
    assert cli.main(["ppl", "--model", m, "--max-tokens", "200", "--context", "64", "--cache", "0.5",
                     "--policy", "quality-first"]) == 0
    trace = tmp_path / "t.ectrace"
    assert cli.main(["trace", "--model", m, "--max-tokens", "192", "--context", "64", "--out", str(trace)]) == 0
    assert cli.main(["simulate", str(trace), "--cache", "0.5", "--policies", "fetch-all", "threshold:tau=0.3",
                     "conditional:j=2,m=8", "--json", str(tmp_path / "s.json")]) == 0
    runs = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert len(runs) == 3 and all(r["hit_rate"] > 0 for r in runs)
    capsys.readouterr()


def test_replay_counts_equal_the_engine(tokenized, tmp_path):
    from expertcache.engine.cache import CacheConfig
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.lab.simulator import replay
    from expertcache.lab.trace import record_trace
    ids = torch.randint(0, 8192, (192,), generator=torch.Generator().manual_seed(5)).tolist()
    trace = record_trace(tokenized, ids, tmp_path / "t.ectrace", context=64, dtype="float32")
    assert trace.header["router"] == "sigmoid" and trace.header["num_layers"] == 2
    engine = Engine(tokenized, EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold"))
    for start in range(0, len(ids), 64):
        engine.forward(torch.tensor(ids[start:start + 64]), 0)
    s, e = replay(trace, "fetch-all", CacheConfig(fraction=0.5)).stats, engine.stats
    fields = ("hits", "misses", "sync_fetches", "moe_calls")
    assert [getattr(s, f) for f in fields] == [getattr(e, f) for f in fields] and e.misses > 0


def test_short_study(tokenized):
    from expertcache.lab.study import StudyConfig, run_study
    cfg = StudyConfig(cache_fraction=0.5, tokens_per_domain=128, context=64, prompts_per_domain=1, new_tokens=4, bootstrap=50,
                      policies=("fetch-all", "threshold:tau=0.15", "quality-first"),
                      generation_policies=("fetch-all",))
    res = run_study(tokenized, cfg)
    assert res.runs["fetch-all"]["pct"] == 0 and res.runs["threshold:tau=0.15"]["slots_substituted_pct"] > 0
    assert res.generation["fetch-all"]["identical_token_share"] == 1.0
