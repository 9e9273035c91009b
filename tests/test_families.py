"""The families' own pieces. GPT-OSS and Qwen3-Next: the chunked gated delta rule equals the
recurrent one, MXFP4 experts load as HF dequantises them, expert biases travel through the disk
store, the router's logit bias routes as HF's. GLM-4.5 and DeepSeek-V3: the sigmoid router with
selection bias and groups against HF's, substitutes within the allowed groups. Every verb runs on
a tiny model of each family, and the simulator's replay counts equal the engine's."""
import json
import shutil

import numpy as np
import pytest
import torch
from hf_models import hf_config, save_gpt_oss_mxfp4, save_tiny

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from expertcache.engine.experts import (
    CompiledExperts,
    ExpertKind,
    experts_grouped,
    experts_one_token,
    swiglu,
)
from expertcache.engine.linear_attention import delta_rule_chunked, delta_rule_recurrent, l2norm
from expertcache.engine.stores import DiskStore, RamStore, convert_to_disk
from expertcache.kernel.routing import Router
from expertcache.models import model_args
from expertcache.policies import Route, make_policy

NEW_FAMILIES = ["gpt_oss", "qwen3_next", "ernie4_5_moe"]
GROUPED = ["glm4_moe", "deepseek_v3"]


def test_chunked_delta_rule_equals_recurrent():
    g = torch.Generator().manual_seed(0)
    H, T, Dk, Dv = 3, 150, 8, 6  # three chunks of 64, the last one padded
    q, k = (l2norm(torch.randn(H, T, Dk, generator=g)) for _ in range(2))
    v = torch.randn(H, T, Dv, generator=g)
    decay = -torch.rand(H, T, generator=g) * 0.5
    beta = torch.rand(H, T, generator=g)
    state = torch.randn(H, Dk, Dv, generator=g)
    o_rec, s_rec = delta_rule_recurrent(q, k, v, decay, beta, state)
    o_chunk, s_chunk = delta_rule_chunked(q, k, v, decay, beta, state, chunk=64)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-4, rtol=0)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-4, rtol=0)


def test_biased_clamped_experts_one_token_equals_grouped():
    g = torch.Generator().manual_seed(3)
    S, H, F, T, k = 6, 16, 8, 5, 2
    w13, w2 = torch.randn(S, 2 * F, H, generator=g), torch.randn(S, H, F, generator=g)
    b13, b2 = torch.randn(S, 2 * F, generator=g), torch.randn(S, H, generator=g)
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    kind = ExpertKind(bias=True, limit=1.5)
    ref = torch.stack([sum(weights[t, j] * swiglu(x[t:t + 1], w13[s], w2[s], b13[s], b2[s], kind)[0]
                           for j, s in enumerate(slots[t].tolist())) for t in range(T)])
    grouped = experts_grouped(x, slots, weights, w13, w2, b13, b2, kind)
    one = torch.cat([experts_one_token(x[t:t + 1], slots[t:t + 1], weights[t:t + 1], w13, w2, b13, b2, kind)
                     for t in range(T)])
    torch.testing.assert_close(grouped, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(one, ref, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(ref, experts_grouped(x, slots, weights, w13, w2, b13, b2, ExpertKind(bias=True)))


@pytest.mark.parametrize("kind", [ExpertKind(), ExpertKind(bias=True, limit=1.5)], ids=["swiglu", "clamped+bias"])
def test_compiled_decode_experts_equal_torch(kind):
    g = torch.Generator().manual_seed(4)
    S, H, F, k = 9, 40, 24, 4  # odd sizes: the vectorised sums have remainders
    w13, w2 = torch.randn(S, 2 * F, H, generator=g), torch.randn(S, H, F, generator=g)
    b13, b2 = (torch.randn(S, 2 * F, generator=g), torch.randn(S, H, generator=g)) if kind.bias else (None, None)
    for _ in range(5):
        x = torch.randn(1, H, generator=g)
        slots, weights = torch.randperm(S, generator=g)[:k].view(1, k), torch.rand(1, k, generator=g)
        ref = experts_one_token(x, slots, weights, w13, w2, b13, b2, kind)
        compiled = CompiledExperts.of_floats(w13, w2, b13, b2, kind)(x, slots[0].numpy(), weights[0].numpy())
        # to fp32 rounding: an output near zero is a difference of sums as large as the largest output
        torch.testing.assert_close(compiled, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)
    x = torch.randn(11, H, generator=g)  # a window: the same kinds through the grouped compiled call
    slots, weights = torch.randint(0, S, (11, k), generator=g), torch.rand(11, k, generator=g)
    window = CompiledExperts.of_floats(w13, w2, b13, b2, kind).window(x, slots.numpy(), weights.numpy())
    torch.testing.assert_close(window, experts_grouped(x, slots, weights, w13, w2, b13, b2, kind), atol=1e-4,
                               rtol=1e-5)


def test_disk_store_holds_expert_biases(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["gpt_oss"][0])
    args = model_args(ckpt.config)
    ram = RamStore(ckpt, args)
    disk = DiskStore(convert_to_disk(ckpt, args, tmp_path), args)
    assert json.loads((tmp_path / "experts.json").read_text())["bias"] is True
    bufs = [torch.empty(s) for s in ram.shape.parts]
    for layer in range(args.num_layers):
        for e in range(args.num_experts):
            disk.read_into(layer, e, *bufs)
            assert all(torch.equal(b, r) for b, r in zip(bufs, ram._sources(layer, e)))
    assert ram.b13.abs().sum() > 0 and ram.b2.abs().sum() > 0


def test_gpt_oss_mxfp4_checkpoint_matches_hf(tmp_path):
    hf = save_gpt_oss_mxfp4(tmp_path)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(tmp_path, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25), initial="cold",
                                           store_dir=tmp_path / "store"))
    torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
    assert engine.stats.sync_fetches > 0
    engine.close()


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """family -> a tiny checkpoint with the built-in model's tokenizer (so text verbs run)."""
    out = {}
    for fam in NEW_FAMILIES:
        path = tmp_path_factory.mktemp(fam + "_tok")
        save_tiny(fam, path, vocab_size=json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"])
        shutil.copy(BUILTIN_MODEL / "tokenizer.json", path)
        out[fam] = path
    return out


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_every_verb_runs(with_tokenizer, family, tmp_path, capsys):
    from expertcache.lab.study import StudyConfig, run_study
    model = str(with_tokenizer[family])
    common = ["--model", model, "--store", "disk", "--cache", "0.25"]
    assert cli.main(["generate", *common, "-n", "6", "--json", str(tmp_path / "g.json"), "ROMEO."]) == 0
    assert len(json.loads((tmp_path / "g.json").read_text())["tokens"]) == 6
    assert cli.main(["ppl", *common, "--max-tokens", "200", "--context", "64", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["ppl"] > 1
    trace = tmp_path / "t.ectrace"
    assert cli.main(["trace", "--model", model, "--max-tokens", "128", "--context", "64", "--out", str(trace)]) == 0
    # 8 experts: 0.25 leaves top-k slots only, too few for quality-first's admissions
    assert cli.main(["simulate", str(trace), "--cache", "0.5", "0.75", "--policies", "fetch-all", "quality-first",
                     "--json", str(tmp_path / "s.json")]) == 0
    rows = {(r["policy"], r["cache"]): r for r in json.loads((tmp_path / "s.json").read_text())["runs"]}
    assert rows[("fetch-all", 0.75)]["hit_rate"] > rows[("fetch-all", 0.5)]["hit_rate"]
    assert cli.main(["calibrate", "--model", model, "--max-tokens", "256"]) == 0  # the study starts warm
    capsys.readouterr()
    res = run_study(with_tokenizer[family], StudyConfig(
        tokens_per_domain=64, context=64, prompts_per_domain=1, new_tokens=4, bootstrap=50,
        policies=("fetch-all", "substitute-all", "threshold:tau=0.15"), generation_policies=("fetch-all",)))
    assert res.runs["fetch-all"]["pct"] == 0 and res.runs["substitute-all"]["slots_substituted_pct"] > 0
    assert res.generation["fetch-all"]["identical_token_share"] == 1.0


def test_logit_bias_router_matches_hf():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    c = hf_config("gpt_oss")
    hf = GptOssTopKRouter(c)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        hf.bias.copy_(2.0 * torch.randn(c.num_local_experts, generator=g))
    x = torch.randn(256, c.hidden_size, generator=g)
    biased, w_ref, ids_ref = (t.detach() for t in hf(x))
    raw = (x @ hf.weight.t()).detach().numpy()
    bias = hf.bias.detach().numpy()
    router = Router(c.num_experts_per_tok, True, bias=np.stack([np.zeros_like(bias), bias]))
    r = router.route(raw, 1)  # the bias of MoE layer 1, added before top-k and softmax
    assert (r.ids == ids_ref.numpy()).all()
    np.testing.assert_allclose(r.weights, w_ref.numpy(), rtol=1e-5)
    np.testing.assert_allclose(r.rows, biased.numpy(), rtol=1e-5, atol=1e-5)  # the kernel ranks the biased logits
    assert r.scores is r.rows  # a softmax routing: one row ranks and weighs
    assert (router.route(raw, 0).ids != r.ids).any(1).mean() > 0.2  # the bias changes the choice


def test_softmax_selection_router_matches_hf():
    """ERNIE 4.5's router: experts selected by softmax probability plus a per-expert bias, weighed by their
    unbiased probabilities renormalised; the kernel ranks the selection row."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    c = hf_config("ernie4_5_moe")
    hf = Ernie4_5_MoeTopKRouter(c)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(2.0 * torch.randn(hf.weight.shape, generator=g))
        hf.moe_statics.e_score_correction_bias.copy_(0.1 * torch.randn(1, c.moe_num_experts, generator=g))
    x = torch.randn(256, c.hidden_size, generator=g)
    logits, w_ref, ids_ref = (t.detach() for t in hf(x))
    bias = hf.moe_statics.e_score_correction_bias.detach().numpy()
    r = Router(c.moe_k, True, "softmax_selection", bias=bias).route(logits.numpy(), 0)
    assert (r.ids == ids_ref.numpy()).all()  # HF's top-k is sorted here: by the selection row
    np.testing.assert_allclose(r.weights, w_ref.numpy(), rtol=1e-5)
    np.testing.assert_allclose(r.scores, torch.softmax(logits, -1).numpy(), rtol=1e-5, atol=1e-7)
    sel = np.take_along_axis(r.rows, r.ids, 1)
    assert (np.diff(sel, axis=1) <= 0).all()
    plain = Router(c.moe_k, True).route(logits.numpy(), 0)  # the bias changes the choice on this routing
    assert (np.sort(plain.ids) != np.sort(r.ids)).any(1).mean() > 0.1


def assert_selected_as_hf(r, ids_ref, w_ref, scale: float) -> None:
    """A selection router's routes r equal HF's top-k ids and weights (scaled by `scale` there), compared as
    expert -> gate since HF's top-k is unsorted; r's ranking follows its selection row, falling and finite."""
    for t in range(len(r.ids)):
        ref = dict(zip(ids_ref[t].tolist(), (w_ref[t] / scale).tolist()))
        got = dict(zip(r.ids[t].tolist(), r.weights[t].tolist()))
        assert got.keys() == ref.keys()
        np.testing.assert_allclose([got[e] for e in ref], list(ref.values()), rtol=1e-5)
    sel = np.take_along_axis(r.rows, r.ids, 1)
    assert (np.diff(sel, axis=1) <= 0).all() and np.isfinite(sel).all()


def test_group_limited_router_matches_hf():
    """DeepSeek-V2's group-limited greedy router: the top-k of the softmax within the topk_group groups of the best
    single scores, weighed by those scores unnormalised; the kernel ranks the selection row."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    c = hf_config("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    hf = DeepseekV2TopkRouter(c)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.weight.copy_(2.0 * torch.randn(hf.weight.shape, generator=g))
    x = torch.randn(256, c.hidden_size, generator=g)
    logits, w_ref, ids_ref = (t.detach() for t in hf(x))
    r = Router(c.num_experts_per_tok, False, "softmax_limited", 4, 2, c.routed_scaling_factor).route(logits.numpy(), 0)
    assert_selected_as_hf(r, ids_ref, w_ref, c.routed_scaling_factor)
    greedy = Router(c.num_experts_per_tok, False).route(logits.numpy(), 0)  # the groups change the choice
    assert (np.sort(greedy.ids) != np.sort(r.ids)).any(1).mean() > 0.2
    summed = Router(c.num_experts_per_tok, False, "softmax_selection", 4, 2).route(logits.numpy(), 0)
    assert (np.sort(summed.ids) != np.sort(r.ids)).any(1).any()  # a group's worth is its best, not its two best


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
    assert_selected_as_hf(r, ids_ref, w_ref, c.routed_scaling_factor)
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


def replay_and_engine_counts(model, tmp_path, fraction: float = 0.5):
    """(replay's, the engine's) hits, misses, sync fetches and MoE calls over the same 192 tokens in windows of 64,
    and the trace."""
    from expertcache.lab.simulator import replay
    from expertcache.lab.trace import record_trace
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (192,), generator=torch.Generator().manual_seed(5)).tolist()
    trace = record_trace(model, ids, tmp_path / "t.ectrace", context=64, dtype="float32")
    engine = Engine(model, EngineConfig(cache=CacheConfig(fraction=fraction), initial="cold"))
    for start in range(0, len(ids), 64):
        engine.forward(torch.tensor(ids[start:start + 64]), 0)
    s, e = replay(trace, "fetch-all", CacheConfig(fraction=fraction)).stats, engine.stats
    fields = ("hits", "misses", "sync_fetches", "moe_calls")
    return [getattr(s, f) for f in fields], [getattr(e, f) for f in fields], trace


def test_replay_counts_equal_the_engine_with_a_logit_bias(tiny, tmp_path):
    replayed, engine, trace = replay_and_engine_counts(tiny["gpt_oss"][0], tmp_path)
    assert trace.header["router"] == "softmax" and np.shape(trace.header["router_bias"]) == (2, 8)
    assert replayed == engine and engine[1] > 0


def test_replay_counts_equal_the_engine_with_a_softmax_selection_router(tiny, tmp_path):
    replayed, engine, trace = replay_and_engine_counts(tiny["ernie4_5_moe"][0], tmp_path)
    assert trace.header["router"] == "softmax_selection" and np.shape(trace.header["router_bias"]) == (2, 8)
    assert replayed == engine and engine[1] > 0


def test_replay_counts_equal_the_engine(tokenized, tmp_path):
    replayed, engine, trace = replay_and_engine_counts(tokenized, tmp_path)
    assert trace.header["router"] == "sigmoid" and trace.header["num_layers"] == 2
    assert replayed == engine and engine[1] > 0


def test_short_study(tokenized):
    from expertcache.lab.study import StudyConfig, run_study
    cfg = StudyConfig(cache_fraction=0.5, tokens_per_domain=128, context=64, prompts_per_domain=1, new_tokens=4,
                      bootstrap=50,
                      policies=("fetch-all", "threshold:tau=0.15", "quality-first"),
                      generation_policies=("fetch-all",))
    res = run_study(tokenized, cfg)
    assert res.runs["fetch-all"]["pct"] == 0 and res.runs["threshold:tau=0.15"]["slots_substituted_pct"] > 0
    assert res.generation["fetch-all"]["identical_token_share"] == 1.0


def test_deepseek_v2_runs_every_model_verb_and_replays_as_the_engine(tmp_path, capsys):
    """DeepSeek-V2-Lite's layout (a dense first layer, q projected without a low rank, greedy softmax top-k,
    scaled routed output; parity with HF is in test_parity): the text verbs run, and the replay of its trace
    counts what the engine does; so with V2's group-limited routing, whose logits are HF's too. An unknown
    topk_method is refused in one line."""
    vocab = json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"]
    save_tiny("deepseek_v2", tmp_path / "m", vocab_size=vocab)
    shutil.copy(BUILTIN_MODEL / "tokenizer.json", tmp_path / "m" / "tokenizer.json")
    m = str(tmp_path / "m")
    assert cli.main(["generate", "--model", m, "-n", "6", "--cache", "0.25", "--store", "disk", "ROMEO."]) == 0
    assert cli.main(["ppl", "--model", m, "--max-tokens", "200", "--context", "64", "--cache", "0.5",
                     "--policy", "quality-first", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["ppl"] > 1
    replayed, engine, trace = replay_and_engine_counts(tmp_path / "m", tmp_path)
    assert trace.header["router"] == "softmax" and trace.header["routed_scaling_factor"] == 2.5
    assert replayed == engine and engine[1] > 0
    hf = save_tiny("deepseek_v2", tmp_path / "g", vocab_size=vocab, topk_method="group_limited_greedy", n_group=4,
                   topk_group=2)
    ids = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(tmp_path / "g", EngineConfig(store="disk", store_dir=tmp_path / "store",
                                                 cache=CacheConfig(fraction=0.25)))
    torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
    engine.close()
    replayed, engine, trace = replay_and_engine_counts(tmp_path / "g", tmp_path / "g")
    assert trace.header["router"] == "softmax_limited" and trace.header["n_group"] == 4
    assert replayed == engine and engine[1] > 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "topk_method": "noaux_tc"}))
    capsys.readouterr()
    assert cli.main(["info", "--model", m]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "topk_method 'noaux_tc'" in err, err


@pytest.fixture(scope="module")
def deepseek_yarn(tmp_path_factory):
    """A tiny DeepSeek-V3 with YaRN RoPE: (checkpoint folder, HF reference model)."""
    path = tmp_path_factory.mktemp("deepseek_v3_yarn")
    return path, save_tiny("deepseek_v3_yarn", path)


def test_deepseek_v3_yarn_matches_hf(deepseek_yarn):
    """Logits (disk store, fetch-every-miss) and KV-cache decode equal HF's: YaRN frequencies, the attention
    factor on the rotary tables and the softmax scale times mscale(factor, mscale_all_dim) ** 2."""
    path, hf = deepseek_yarn
    assert model_args(open_checkpoint(path).config).rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(path, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25), initial="cold",
                                       store_dir=path / "store"))
    torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
    assert engine.stats.sync_fetches == engine.stats.misses > 0
    engine.close()
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold"))
    prompt = 8
    out = [engine.forward(ids[:prompt], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(prompt, len(ids))]
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-4, rtol=0)
    engine.close()


def test_released_deepseek_v3_rope_scaling_equals_hf():
    """The released DeepSeek-V3 config.json (old-style rope_scaling, type yarn, 64 rotary channels): our
    frequencies, attention factor and softmax scale equal HF's."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from expertcache.engine.attention import rope_frequencies
    from expertcache.engine.mla import latent_softmax_scale
    scaling = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096, "type": "yarn"}
    config = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
                  num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=2048, intermediate_size=18432, n_group=8, topk_group=4, n_shared_experts=1,
                  first_k_dense_replace=3, routed_scaling_factor=2.5, max_position_embeddings=163840,
                  rope_theta=10000, rope_scaling=scaling)
    a = model_args(config)
    hf = DeepseekV3Config(**{k: v for k, v in config.items() if k != "model_type"})
    inv_freq, factor = rope_frequencies(a, a.qk_rope_head_dim)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    torch.testing.assert_close(inv_freq, ref_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-9)
    assert latent_softmax_scale(a) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192 ** -0.5), rel=1e-9)
    assert latent_softmax_scale(a) > 1.3 * 192 ** -0.5  # mscale(40, 1) ** 2 ~ 1.87


def test_qwen3_next_512_experts_top_10_through_the_disk_store(tmp_path):
    """Qwen3-Next's released routing shape (512 experts, top-10, a shared expert) in small: logits and each
    layer's routed output equal HF's through the disk store at a tenth of the experts (fetch-every-miss), and
    decode steps with the KV cache and the DeltaNet state too."""
    from test_parity import engine_moe_outputs, hf_moe_outputs
    hf = save_tiny("qwen3_next", tmp_path, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=8)
    args = model_args(open_checkpoint(tmp_path).config)
    assert (args.num_experts, args.top_k, args.shared_expert_dim) == (512, 10, 24)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    ref, ref_moe = hf_moe_outputs(hf, ids)
    config = EngineConfig(store="disk", cache=CacheConfig(fraction=0.1), initial="cold", store_dir=tmp_path / "store")
    engine = Engine(tmp_path, config)
    assert engine.cache.per_layer < 20 * args.top_k  # the window's routes overflow the cache: slots are reused
    logits, moe = engine_moe_outputs(engine, ids)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    for ours, theirs in zip(moe, ref_moe, strict=True):
        torch.testing.assert_close(ours, theirs.reshape(ours.shape), atol=1e-4, rtol=0)
    assert engine.stats.sync_fetches == engine.stats.misses > 0
    engine.close()
    engine = Engine(tmp_path, config)
    out = [engine.forward(ids[:8], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(8, len(ids))]
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-4, rtol=0)
    engine.close()


def computes_as_hf(path, ids: torch.Tensor, ref: torch.Tensor, store_dir) -> None:
    """The checkpoint at `path` gives HF's logits `ref` on `ids` through the ram and the disk store, half its
    experts cached and each fetched on its first use."""
    for store in ("ram", "disk"):
        engine = Engine(path, EngineConfig(store=store, cache=CacheConfig(fraction=0.5), initial="cold",
                                           store_dir=store_dir))
        torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
        assert engine.stats.sync_fetches > 0
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_block_fp8_checkpoint_is_read_dequantised(family, tmp_path, capsys):
    """An fp8 release's layout (float8_e4m3fn projections, a weight_scale_inv per block of weight_block_size,
    blocks that do not divide the matrices): the engine equals HF's model from the dequantised weights, from the
    ram and the disk store; another quantization is refused in one line."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    save_tiny(family, tmp_path / "float")
    block = (16, 12)  # 32 columns: two whole blocks and a partial one
    sd, fp8, meant = load_file(tmp_path / "float" / "model.safetensors"), {}, {}
    for name, w in sd.items():
        fp8[name] = meant[name] = w
        if name.endswith("proj.weight") and w.dim() == 2:
            rows, cols = w.shape
            grid = w.new_zeros(-(-rows // block[0]), -(-cols // block[1]))
            for i in range(grid.shape[0]):
                for j in range(grid.shape[1]):
                    b = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                    grid[i, j] = b.abs().max().clamp_min(1e-12) / 448.0
            full = grid.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            codes = (w / full).to(torch.float8_e4m3fn)
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = codes, grid
            meant[name] = codes.float() * full  # what the fp8 checkpoint means
    save_file(meant, tmp_path / "float" / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    (tmp_path / "fp8").mkdir()
    save_file(fp8, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["dtype"] = "float32"
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    computes_as_hf(tmp_path / "fp8", ids, ref, tmp_path / "store")
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli.main(["info", "--model", str(tmp_path / "fp8")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'gptq' cannot be read" in err, err


def test_a_float64_checkpoint_runs_through_every_store_as_hfs_model(tiny, tmp_path):
    """A model saved after .double() (safetensors F64): its experts are held in fp32, the widest format a store
    holds and what the engine computes in, through the ram and the disk store alike; the disk store and `convert`
    failed on it with a KeyError."""
    from copy import deepcopy
    path, hf = tiny["qwen3_moe"]
    deepcopy(hf).double().save_pretrained(tmp_path / "f64")
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    computes_as_hf(tmp_path / "f64", ids, ref, tmp_path / "store")
    assert cli.main(["convert", "--model", str(tmp_path / "f64"), "--out", str(tmp_path / "converted")]) == 0
    assert json.loads((tmp_path / "converted" / "experts.json").read_text())["dtype"] == "float32"


def test_tied_embeddings_saved_only_as_the_output_matrix_run_as_hfs_model(tiny, tmp_path):
    """A tied checkpoint that holds lm_head.weight but no model.embed_tokens.weight: HF ties the embeddings to the
    output matrix, and so does the engine, through the ram and the disk store; it was refused as missing them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    src = tiny["qwen3_moe"][0]
    shutil.copytree(src, tmp_path / "m")
    sd = load_file(src / "model.safetensors")
    del sd["model.embed_tokens.weight"]
    save_file(sd, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    computes_as_hf(tmp_path / "m", ids, ref, tmp_path / "store")


@pytest.mark.parametrize("family, rope", [
    ("qwen3_moe", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}),  # over a top-level 500
    ("qwen3_moe", {"rope_type": "default", "rope_theta": 1000.0}),
    ("glm4_moe", {"rope_type": "default", "partial_rotary_factor": 0.25, "rope_theta": 10000.0}),
])
def test_rope_theta_and_partial_rotary_inside_a_legacy_rope_scaling_are_read_as_hf_reads_them(tmp_path, family, rope):
    """transformers takes rope_theta and partial_rotary_factor from a config's rope_scaling where it has no
    rope_parameters; the engine read them from rope_parameters or the top level only, and ran another model's
    positions (5-11% of the logits on these tiny models, from position 1 on)."""
    from transformers import AutoModelForCausalLM
    save_tiny(family, tmp_path, **({"head_dim": 16} if family == "glm4_moe" else {}))
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.pop("partial_rotary_factor", None)
    config.update(rope_theta=500.0, rope_scaling=rope)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(tmp_path, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
    engine.close()
