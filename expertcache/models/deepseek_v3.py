"""DeepSeek-V3 (and Kimi K2's layout): multi-head latent attention (low-rank q and kv, a
rope/nope split of each head, interleaved RoPE); sigmoid router with a selection bias and
group-limited top-k; shared experts without a gate; the first `first_k_dense_replace` layers dense;
plain or YaRN RoPE (released checkpoints: YaRN, which also rescales the softmax, see engine/mla.py)."""
from .args import ModelArgs, rope_scaling, rope_theta
from .naming import deepseek_mlp_names, sigmoid_router_fields

ARCHITECTURE = "DeepseekV3ForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a DeepSeek-V3 config.json."""
    return ModelArgs(
        family="deepseek_v3", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_attention_heads"], head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
        rope_theta=rope_theta(c, 10000.0), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=c.get("tie_word_embeddings", False), attention_bias=c.get("attention_bias", False),
        max_position_embeddings=c.get("max_position_embeddings", 4096), attention="mla",
        q_lora_rank=c.get("q_lora_rank", 1536),  # HF: omitted means 1536; null, q projected directly
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        rope_interleave=c.get("rope_interleave", True), rope_scaling=rope_scaling(c),
        **sigmoid_router_fields(c, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                                n_shared_experts=1))  # HF's defaults for keys config.json omits


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    names = {"attn_norm": p + "input_layernorm.weight", "moe_norm": p + "post_attention_layernorm.weight",
             "wkv_a": attn + "kv_a_proj_with_mqa.weight", "kv_a_norm": attn + "kv_a_layernorm.weight",
             "wkv_b": attn + "kv_b_proj.weight", "wo": attn + "o_proj.weight"}
    if a.q_lora_rank:
        names.update(wq_a=attn + "q_a_proj.weight", q_a_norm=attn + "q_a_layernorm.weight",
                     wq_b=attn + "q_b_proj.weight")
    else:
        names["wq"] = attn + "q_proj.weight"
    if a.attention_bias:
        names.update(bkv_a=attn + "kv_a_proj_with_mqa.bias", bo=attn + "o_proj.bias")
        if a.q_lora_rank:
            names["bq_a"] = attn + "q_a_proj.bias"
    return {**names, **deepseek_mlp_names(i, a)}
