"""GLM-4.5 / GLM-4.5-Air: GQA with partial RoPE, attention biases, optional per-head q/k norm;
sigmoid router with a selection bias and group-limited top-k; shared experts without a gate;
the first `first_k_dense_replace` layers dense."""
from .args import ModelArgs, head_dim, partial_rotary_factor, rope_scaling, rope_theta
from .naming import attention_names, deepseek_mlp_names, sigmoid_router_fields

ARCHITECTURE = "Glm4MoeForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a GLM-4.5 config.json."""
    hd = head_dim(c)
    return ModelArgs(
        family="glm4_moe", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", 8), head_dim=hd, num_experts=c["n_routed_experts"],
        top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"], rope_theta=rope_theta(c, 10000.0),
        rms_norm_eps=c.get("rms_norm_eps", 1e-5), tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("attention_bias", False), qk_norm="head" if c.get("use_qk_norm") else None,
        partial_rotary_factor=partial_rotary_factor(c, 0.5), rope_scaling=rope_scaling(c),
        max_position_embeddings=c.get("max_position_embeddings", 131072),
        **sigmoid_router_fields(c, n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                                n_shared_experts=1))  # HF's defaults for keys config.json omits


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    return {**attention_names(i, a), **deepseek_mlp_names(i, a)}
