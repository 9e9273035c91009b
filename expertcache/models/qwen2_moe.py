"""Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate, softmax router."""
from .args import ModelArgs, head_dim, num_experts, rope_scaling, rope_theta, sliding_fields
from .naming import per_expert_names, qwen_dense_fields

ARCHITECTURE = "Qwen2MoeForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a Qwen2-MoE config.json."""
    return ModelArgs(
        family="qwen2_moe", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", 16), head_dim=head_dim(c), num_experts=num_experts(c),
        top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)), rope_theta=rope_theta(c, 10000.0),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("qkv_bias", True),
        shared_expert_dim=c.get("shared_expert_intermediate_size", 5632),  # HF's default where config.json omits it
        rope_scaling=rope_scaling(c), max_position_embeddings=c.get("max_position_embeddings", 32768),
        **qwen_dense_fields(c), **sliding_fields(c.get("sliding_window") if c.get("use_sliding_window") else None,
                                                 sliding_layers(c)))


def sliding_layers(c: dict) -> list[bool]:
    """Which layers slide, as HF's Qwen2-MoE config says: its layer_types, else every other layer from the first
    below max_window_layers, when use_sliding_window is true."""
    types = c.get("layer_types")
    if types is not None:
        return [t == "sliding_attention" for t in types]
    below = c.get("max_window_layers", 28)
    return [bool(c.get("use_sliding_window")) and (i + 1) % 2 == 1 and i < below
            for i in range(c["num_hidden_layers"])]


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    names = per_expert_names(i, a, moe="mlp", gate="gate", w1="gate_proj", w3="up_proj", w2="down_proj")
    p = f"model.layers.{i}.mlp."
    if a.shared_expert_dim and not a.is_dense(i):
        names.update(shared_w1=p + "shared_expert.gate_proj.weight", shared_w3=p + "shared_expert.up_proj.weight",
                     shared_w2=p + "shared_expert.down_proj.weight", shared_gate=p + "shared_expert_gate.weight")
    return names
