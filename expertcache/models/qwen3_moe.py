"""Qwen3-MoE: per-head q/k RMSNorm, q/k/v/o biases only with attention_bias, softmax router, top-k renormalised
if norm_topk_prob."""
from .args import ModelArgs, head_dim, num_experts, rope_scaling, rope_theta, sliding_fields
from .naming import per_expert_names, qwen_dense_fields

ARCHITECTURE = "Qwen3MoeForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a Qwen3-MoE config.json."""
    return ModelArgs(
        family="qwen3_moe", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", 4), head_dim=head_dim(c), num_experts=num_experts(c),
        top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)), rope_theta=rope_theta(c, 10000.0),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("attention_bias", False), o_proj_bias=c.get("attention_bias", False),  # HF: o_proj too
        qk_norm="head", rope_scaling=rope_scaling(c),
        max_position_embeddings=c.get("max_position_embeddings", 32768), **qwen_dense_fields(c),
        # HF: every layer slides when use_sliding_window is true
        **sliding_fields(c.get("sliding_window") if c.get("use_sliding_window") else None,
                         [True] * c["num_hidden_layers"]))


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    return per_expert_names(i, a, moe="mlp", gate="gate", w1="gate_proj", w3="up_proj", w2="down_proj")
