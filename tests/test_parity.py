"""Every family against HF transformers on tiny random checkpoints: a forward pass and
decode steps with the KV cache, with all experts resident and with fetch-every-miss."""
import copy
import json

import pytest
import torch
from hf_models import FAMILIES

from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.models import model_args

TOL = dict(atol=1e-4, rtol=0)


def hf_moe_outputs(hf, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """HF's logits [T, V] and each MoE layer's routed-expert output [T, H] (before any shared expert;
    dense layers have no experts)."""
    outs, hooks = [], [layer.mlp.experts.register_forward_hook(lambda m, i, o: outs.append(o))
                       for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            logits = hf(ids[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def engine_moe_outputs(engine, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The engine's logits and each MoE layer's routed output, recorded around its MoE function."""
    outs, moe = [], engine.model.moe

    def recording(*args):
        y = moe(*args)
        outs.append(y.clone())
        return y
    engine.model.moe = recording
    try:
        return engine.forward(ids, 0), outs
    finally:
        engine.model.moe = moe


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("store,fraction,quota,eviction", [
    ("ram", 1.0, "layer", None), ("ram", 0.25, "layer", None), ("disk", 0.25, "layer", None),
    ("ram", 0.25, "global", None), ("ram", 0.25, "layer", "lfu"), ("ram", 0.25, "global", "freq"),
    ("ram", 0.25, "layer", "demand")])
def test_forward_matches_hf(tiny, family, store, fraction, quota, eviction):
    """Logits and every layer's routed-expert output equal HF's under fetch-every-miss, whatever
    the store, quota and eviction order; routing is decisive (scaled routers), not flat."""
    path, hf = tiny[family]
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    ref, ref_moe = hf_moe_outputs(hf, ids)
    engine = Engine(path, EngineConfig(store=store, cache=CacheConfig(fraction=fraction, quota=quota),
                                       eviction=eviction, initial="cold"))
    logits, moe = engine_moe_outputs(engine, ids)
    torch.testing.assert_close(logits, ref, **TOL)
    assert len(moe) == len(ref_moe)
    for ours, theirs in zip(moe, ref_moe):
        torch.testing.assert_close(ours, theirs.reshape(ours.shape), **TOL)
    assert engine.stats.misses > 0 and engine.stats.sync_fetches == engine.stats.misses
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2"])
def test_conditional_keeping_the_top_k_is_exact(tiny, family):
    """conditional:j=k runs the router's top-k with the family's own gate weights: renormalised
    (qwen3_moe here) or the router's probabilities (qwen2_moe, olmoe: norm_topk_prob=False; deepseek_v2, scaled)."""
    path, hf = tiny[family]
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = {}
    for spec in ("fetch-all", "conditional:j=2,m=4"):
        engine = Engine(path, EngineConfig(policy=spec, cache=CacheConfig(fraction=0.5), initial="cold"))
        out[spec] = engine.forward(ids, 0)
        engine.close()
    torch.testing.assert_close(out["conditional:j=2,m=4"], out["fetch-all"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["fetch-all"], ref, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_with_kv_cache_matches_hf(tiny, family):
    path, hf = tiny[family]
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold"))
    prompt = 8
    out = [engine.forward(ids[:prompt], 0)]
    for pos in range(prompt, len(ids)):
        out.append(engine.forward(ids[pos:pos + 1], pos))
    torch.testing.assert_close(torch.cat(out), ref, **TOL)
    engine.close()


def test_hf_generate_agrees_with_engine(tiny):
    path, hf = tiny["qwen3_moe"]
    from expertcache.engine.generate import generate
    prompt = [5, 17, 33, 2]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    engine = Engine(path, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25), initial="cold"))
    assert list(generate(engine, prompt, 10)) == ref


def test_disk_and_ram_give_the_same_perplexity(tiny):
    from expertcache.engine.perplexity import perplexity
    path, _ = tiny["mixtral"]
    ids = torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    results = []
    for store in ("ram", "disk"):
        engine = Engine(path, EngineConfig(store=store, cache=CacheConfig(fraction=0.25), initial="cold"))
        results.append(perplexity(engine, ids, context=64))
        engine.close()
    ram, disk = results
    assert ram.ppl == pytest.approx(disk.ppl, rel=1e-6)
    assert ram.stats["sync_fetches"] == disk.stats["sync_fetches"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpoint_matches_hf(tiny, family, tmp_path):
    """A checkpoint saved in bf16, as releases are: the engine (disk store, bf16 slots) equals HF's model
    loaded from the same files in fp32, so no weight is rounded on the way (e.g. a norm's 1 + w)."""
    from transformers import AutoModelForCausalLM
    copy.deepcopy(tiny[family][1]).to(torch.bfloat16).save_pretrained(tmp_path)  # the shared reference stays fp32
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
    engine = disk_engine(tmp_path, 0.5)
    torch.testing.assert_close(engine.forward(ids, 0), hf_logits(ref_model, ids), **TOL)
    engine.close()


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """An HF model's logits [T, V] for one sequence of ids [T]."""
    with torch.no_grad():
        return model(ids[None]).logits[0]


def disk_engine(path, fraction: float) -> Engine:
    """An engine over the checkpoint at `path` with a disk store beside it and a cold cache of `fraction`."""
    return Engine(path, EngineConfig(store="disk", cache=CacheConfig(fraction=fraction), initial="cold",
                                     store_dir=path / "store"))


@pytest.mark.parametrize("family,over", [
    ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    ("qwen2_moe", dict(num_hidden_layers=4, layer_types=["full_attention"] * 4, decoder_sparse_step=2)),
    ("qwen3_next", dict(mlp_only_layers=[0]))])
def test_dense_layers_of_the_qwen_families_match_hf(family, over, tmp_path):
    """Qwen configs that make some layers dense (mlp_only_layers, decoder_sparse_step): those layers run HF's
    MLP, the others index the cache as MoE layers 0..; logits and KV-cache decode equal HF's under
    fetch-every-miss, with the next MoE layer prefetched across a dense one."""
    from hf_models import save_tiny

    from expertcache.engine.moe import PrefetchConfig
    hf = save_tiny(family, tmp_path, **over)
    a = model_args(json.loads((tmp_path / "config.json").read_text()))
    assert a.dense_layers and a.num_moe_layers == sum(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(6))
    ref, engine = hf_logits(hf, ids), disk_engine(tmp_path, 0.25)
    torch.testing.assert_close(engine.forward(ids, 0), ref, **TOL)
    engine.reset()
    engine.set_prefetch(PrefetchConfig("router-ahead"))
    out = [engine.forward(ids[:8], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(8, len(ids))]
    torch.testing.assert_close(torch.cat(out), ref, **TOL)
    assert engine.stats.misses > 0 and engine.stats.predictions > 0
    engine.close()


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
LINEAR = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)


@pytest.mark.parametrize("family,over", [
    ("qwen3_moe", dict(rope_parameters=YARN, use_sliding_window=True, sliding_window=4)),
    ("qwen2_moe", dict(rope_parameters=LINEAR, use_sliding_window=True, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"])),
    ("mixtral", dict(rope_parameters=YARN, sliding_window=4, head_dim=8)),
    ("olmoe", dict(rope_parameters=LINEAR))])
def test_rope_scaling_and_sliding_windows_of_the_gqa_families_match_hf(family, over, tmp_path):
    """Configs that scale RoPE (YaRN, as Qwen3's long-context setting; linear) or slide a window over the keys
    (Mixtral's sliding_window, Qwen's use_sliding_window) compute what HF computes, in a window and in KV-cache
    decode past the window: they were read as plain RoPE over every key, another model's output."""
    from hf_models import save_tiny
    hf = save_tiny(family, tmp_path, **over)
    ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(7))
    ref, engine = hf_logits(hf, ids), disk_engine(tmp_path, 0.25)
    torch.testing.assert_close(engine.forward(ids, 0), ref, **TOL)
    engine.reset()
    out = [engine.forward(ids[:6], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(6, len(ids))]
    torch.testing.assert_close(torch.cat(out), ref, **TOL)
    engine.close()


def test_rope_scaling_that_varies_with_the_length_is_refused(tmp_path):
    """Dynamic NTK scaling changes the positions with the sequence's length: refused in one line, not read as
    plain RoPE."""
    from hf_models import save_tiny

    from expertcache.errors import UnsupportedArchitecture
    save_tiny("qwen3_moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="'dynamic' is not supported"):
        Engine(tmp_path, EngineConfig(store="ram"))


@pytest.mark.parametrize("norm_min", [0.5, "0.5"])
def test_ernies_floor_on_the_gates_sum_is_refused_where_it_could_change_them(tmp_path, norm_min):
    """HF divides ERNIE's gates by max(their sum, moe_norm_min); the router divides by the sum, which at 0.5 moved
    every logit (0.7% on a tiny model): refused past the released 1e-12, which changes nothing."""
    from hf_models import save_tiny

    from expertcache.errors import UnsupportedArchitecture
    save_tiny("ernie4_5_moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_norm_min": norm_min}))
    with pytest.raises(UnsupportedArchitecture, match="moe_norm_min"):
        Engine(tmp_path, EngineConfig(store="ram"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_norm_min": 1e-12}))
    Engine(tmp_path, EngineConfig(store="ram")).close()


def rope_theta(theta: float) -> dict:
    return dict(rope_parameters=dict(rope_type="default", rope_theta=theta))


CONFIG_OPTIONS = {  # each family's config options that change its forward, each set away from the tiny default
    "qwen3_moe": [dict(tie_word_embeddings=True), dict(attention_bias=True), dict(norm_topk_prob=False),
                  dict(rms_norm_eps=1e-2), dict(head_dim=16), rope_theta(500.0), dict(num_key_value_heads=4)],
    "qwen2_moe": [dict(tie_word_embeddings=True), dict(norm_topk_prob=True), dict(qkv_bias=False),
                  dict(shared_expert_intermediate_size=8), rope_theta(500.0), dict(num_key_value_heads=1)],
    "olmoe": [dict(clip_qkv=None), dict(norm_topk_prob=True), dict(attention_bias=True), dict(tie_word_embeddings=True)],
    "mixtral": [dict(head_dim=16), dict(tie_word_embeddings=True), rope_theta(500.0), dict(num_key_value_heads=4)],
    "gpt_oss": [dict(swiglu_limit=7.0), dict(sliding_window=2), dict(layer_types=["full_attention", "sliding_attention"]),
                dict(attention_bias=False), dict(tie_word_embeddings=True)],
    "glm4_moe": [dict(use_qk_norm=False), dict(norm_topk_prob=False), dict(attention_bias=False),
                 dict(first_k_dense_replace=0), dict(n_shared_experts=2), dict(routed_scaling_factor=1.0),
                 dict(head_dim=16)],
    "deepseek_v3": [dict(q_lora_rank=None), dict(norm_topk_prob=False), dict(first_k_dense_replace=0),
                    dict(n_shared_experts=2), dict(rope_interleave=False), dict(attention_bias=True)],
    "deepseek_v2": [dict(q_lora_rank=24), dict(routed_scaling_factor=2.0), dict(n_shared_experts=2),
                    dict(attention_bias=True)],
    "qwen3_next": [dict(norm_topk_prob=False), dict(partial_rotary_factor=0.5), dict(attention_bias=True)],
}


@pytest.mark.parametrize("family,over", [(f, o) for f, opts in CONFIG_OPTIONS.items() for o in opts],
                         ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_each_config_option_computes_what_hf_computes(family, over, tmp_path):
    """Every option of a family's config that changes HF's forward, set away from the tiny model's default, gives
    HF's logits in a window and in KV-cache decode: none is read and left out (attention_bias once gave q/k/v
    biases without the output projection's, which Qwen3-MoE, Qwen3-Next and OLMoE also have)."""
    from hf_models import save_tiny
    hf = save_tiny(family, tmp_path, **over)
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(5))
    engine = Engine(tmp_path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.5), initial="cold"))
    out = torch.cat([engine.forward(ids[:8], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(8, 14)])
    torch.testing.assert_close(out, hf_logits(hf, ids), **TOL)
    engine.close()


GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)
OMITTED_KEYS = [  # (family, the tiny model with the key at HF's default, the key config.json then omits)
    ("deepseek_v3", {}, "routed_scaling_factor"), ("deepseek_v3", {}, "n_shared_experts"),  # tiny: 2.5, 1
    ("deepseek_v3", dict(n_group=8, topk_group=4), "topk_group"),
    ("deepseek_v3", dict(n_group=8, topk_group=4), "n_group"),
    ("deepseek_v3", dict(num_hidden_layers=4, first_k_dense_replace=3), "first_k_dense_replace"),
    ("deepseek_v3", dict(q_lora_rank=1536), "q_lora_rank"),
    ("deepseek_v2", dict(n_shared_experts=2), "n_shared_experts"),
    ("deepseek_v2", dict(q_lora_rank=1536), "q_lora_rank"),
    ("glm4_moe", {}, "n_shared_experts"), ("glm4_moe", {}, "first_k_dense_replace"),  # tiny: 1, 1
    ("qwen2_moe", dict(shared_expert_intermediate_size=5632), "shared_expert_intermediate_size"),
    ("qwen3_next", dict(shared_expert_intermediate_size=512), "shared_expert_intermediate_size"),
    ("qwen3_next", dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
     "rope_parameters.partial_rotary_factor"),
    ("qwen3_next", dict(head_dim=256), "head_dim"),
    ("gpt_oss", dict(head_dim=64), "head_dim"), ("gpt_oss", dict(sliding_window=128), "sliding_window"),
    ("gpt_oss", dict(rope_parameters=GPT_OSS_ROPE), "rope_parameters"),
]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "qwen3_next", "glm4_moe",
                                    "deepseek_v3", "deepseek_v2"])
def test_omitted_head_and_context_sizes_read_as_hfs_defaults(family):
    """Key-value heads and the context length that config.json leaves out are HF's config class defaults (Mixtral's
    8 key-value heads, Qwen3-MoE's 32,768 positions), not the engine's own: those refused such a config, or capped
    its sequences below HF's. 16 attention heads, so that every family's default divides them."""
    from hf_models import hf_config
    from transformers import AutoConfig
    config = {**hf_config(family).to_dict(), "num_attention_heads": 16}
    for key in ("num_key_value_heads", "max_position_embeddings"):
        del config[key]
    hf, a = AutoConfig.for_model(**config), model_args(config)
    assert a.max_position_embeddings == hf.max_position_embeddings
    if a.attention != "mla":  # MLA has no key-value heads to share
        assert a.num_kv_heads == hf.num_key_value_heads


@pytest.mark.parametrize("family,over,key", OMITTED_KEYS, ids=[f"{f}-{k}" for f, _, k in OMITTED_KEYS])
def test_a_key_the_config_omits_reads_as_hfs_default(family, over, key, tmp_path):
    """A config.json without a key (hand-written, or older tooling's) runs as transformers runs it, with the key at
    its HF config class's default: the engine's own defaults were other numbers (DeepSeek-V3's routed_scaling_factor
    1.0 for HF's 2.5, no shared experts for HF's one, Qwen3-Next's full RoPE for HF's 0.25, GPT-OSS's plain RoPE for
    HF's YaRN) or a refusal of a checkpoint HF runs."""
    from hf_models import save_tiny
    from transformers import AutoModelForCausalLM
    save_tiny(family, tmp_path, **over)
    config = json.loads((tmp_path / "config.json").read_text())
    where, name = (config["rope_parameters"], key.split(".")[1]) if "." in key else (config, key)
    del where[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # HF's default fits the weights
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(5))
    engine = Engine(tmp_path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.5), initial="cold"))
    out = torch.cat([engine.forward(ids[:8], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(8, 14)])
    torch.testing.assert_close(out, hf_logits(hf.eval(), ids), **TOL)
    engine.close()


def test_a_saved_output_matrix_is_used_where_the_config_ties_it(tiny, tmp_path):
    """tie_word_embeddings true beside an lm_head.weight of its own: HF transformers 5 keeps the saved matrix (it
    unties one that differs from the embedding); the engine took the embedding, another model's logits."""
    import shutil

    from transformers import AutoModelForCausalLM
    path = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).eval()(ids[None]).logits[0]
    engine = Engine(path)
    torch.testing.assert_close(engine.forward(ids, 0), ref, **TOL)
    engine.close()
