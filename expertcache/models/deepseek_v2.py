"""DeepSeek-V2 / V2-Lite: DeepSeek-V3's multi-head latent attention, shared experts and dense first
layers, with a softmax router: the top-k of the softmax over every expert, not renormalised (HF's
DeepseekV2TopkRouter ignores norm_topk_prob; the released checkpoints set it false), the layer's
output scaled by routed_scaling_factor. V2-Lite routes greedily; V2 and V2.5 (236B) group-limited
(`topk_method: group_limited_greedy`): the top-k within the topk_group groups of the best single scores
(router kind `softmax_limited`)."""
from ..errors import UnsupportedArchitecture
from .args import ModelArgs, rope_scaling, rope_theta
from .deepseek_v3 import layer_names  # noqa: F401 -- DeepSeek-V3's tensor names, this family's too

ARCHITECTURE = "DeepseekV2ForCausalLM"


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a DeepSeek-V2 config.json."""
    method = c.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedArchitecture(f"deepseek_v2: topk_method {method!r} is not supported; expertcache routes "
                                      "DeepSeek-V2 by 'greedy' (V2-Lite) or 'group_limited_greedy' (V2, V2.5)")
    # greedy ignores the groups (HF's router does): one group, every expert allowed
    n_group, topk_group = (c.get("n_group"), c.get("topk_group")) if method == "group_limited_greedy" else (1, 1)
    if c.get("scoring_func", "softmax") != "softmax" or (c.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedArchitecture("deepseek_v2: only softmax scoring with every layer after "
                                      "first_k_dense_replace routed (moe_layer_freq 1) is supported")
    if c.get("mlp_bias"):
        raise UnsupportedArchitecture("deepseek_v2: mlp_bias true (MLPs and experts with biases) is not supported; "
                                      "expertcache runs DeepSeek-V2's MLPs without biases, as its releases have them")
    return ModelArgs(
        family="deepseek_v2", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_attention_heads"], head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
        norm_topk_prob=False, router="softmax" if method == "greedy" else "softmax_limited", n_group=n_group,
        topk_group=topk_group, rope_theta=rope_theta(c, 10000.0), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=c.get("tie_word_embeddings", False), attention_bias=c.get("attention_bias", False),
        max_position_embeddings=c.get("max_position_embeddings", 2048), attention="mla",
        q_lora_rank=c.get("q_lora_rank", 1536),  # HF: omitted means 1536; null, q projected directly
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], rope_interleave=True,
        rope_scaling=rope_scaling(c), routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        first_dense_layers=c.get("first_k_dense_replace") or 0, dense_dim=c["intermediate_size"],
        shared_expert_dim=(c.get("n_shared_experts", 2) or 0) * c["moe_intermediate_size"], shared_expert_gate=False)
