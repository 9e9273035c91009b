"""Mixtral: plain GQA attention, router softmax over the top-k logits (always renormalised)."""
from .args import ModelArgs, head_dim, num_experts, rope_scaling, rope_theta, sliding_fields
from .naming import per_expert_names

ARCHITECTURE = "MixtralForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a Mixtral config.json."""
    return ModelArgs(
        family="mixtral", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", 8), head_dim=head_dim(c), num_experts=num_experts(c),
        top_k=c["num_experts_per_tok"], expert_dim=c["intermediate_size"], norm_topk_prob=True,
        rope_theta=rope_theta(c, 1e6), rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=c.get("tie_word_embeddings", False), rope_scaling=rope_scaling(c),
        max_position_embeddings=c.get("max_position_embeddings", 131072),
        **sliding_fields(c.get("sliding_window"), [True] * c["num_hidden_layers"]))  # HF: every layer, when set


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    return per_expert_names(i, a, moe="block_sparse_moe", gate="gate", w1="w1", w3="w3", w2="w2")
