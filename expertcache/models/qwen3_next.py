"""Qwen3-Next: hybrid layers -- Gated DeltaNet linear attention in every layer but each
full_attention_interval-th, which has gated full attention (q_proj doubled with a sigmoid output
gate, per-head q/k RMSNorm, partial RoPE); a shared expert behind a sigmoid gate; softmax top-k
routing renormalised if norm_topk_prob. Its RMSNorms scale by (1 + w): the weights are shifted
by one at load time, so the decoder's plain RMSNorm applies them."""
from __future__ import annotations

import torch

from .args import ModelArgs, head_dim, num_experts, partial_rotary_factor, rope_scaling, rope_theta
from .naming import per_expert_names, qwen_dense_fields

ARCHITECTURE = "Qwen3NextForCausalLM"

OFFSET_NORMS = ("attn_norm", "moe_norm", "q_norm", "k_norm")  # Qwen3NextRMSNorm; the DeltaNet's gated norm is plain


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a Qwen3-Next config.json."""
    layers = c["num_hidden_layers"]
    interval = c.get("full_attention_interval", 4)
    types = c.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                     for i in range(layers)]
    return ModelArgs(
        family="qwen3_next", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=layers,
        num_heads=c["num_attention_heads"], num_kv_heads=c.get("num_key_value_heads", 2), head_dim=head_dim(c, 256),
        num_experts=num_experts(c), top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", True)), rope_theta=rope_theta(c, 10000.0),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("attention_bias", False), o_proj_bias=c.get("attention_bias", False),  # HF: o_proj too
        qk_norm="head",
        shared_expert_dim=c.get("shared_expert_intermediate_size", 512),  # HF's defaults where config.json omits
        max_position_embeddings=c.get("max_position_embeddings", 32768), layer_types=tuple(types),
        attention_gate=True, partial_rotary_factor=partial_rotary_factor(c, 0.25), rope_scaling=rope_scaling(c),
        linear_num_key_heads=c["linear_num_key_heads"], linear_num_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel=c.get("linear_conv_kernel_dim", 4), **qwen_dense_fields(c))


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's tensors; experts as lists indexed by expert id."""
    names = per_expert_names(i, a, moe="mlp", gate="gate", w1="gate_proj", w3="up_proj", w2="down_proj")
    p = f"model.layers.{i}."
    if a.layer_type(i) == "linear_attention":
        for k in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm"):
            names.pop(k, None)
        la = p + "linear_attn."
        names.update(lin_qkvz=la + "in_proj_qkvz.weight", lin_ba=la + "in_proj_ba.weight",
                     lin_conv=la + "conv1d.weight", lin_dt_bias=la + "dt_bias", lin_A_log=la + "A_log",
                     lin_norm=la + "norm.weight", lin_out=la + "out_proj.weight")
    m = p + "mlp."
    if a.shared_expert_dim and not a.is_dense(i):
        names.update(shared_w1=m + "shared_expert.gate_proj.weight", shared_w3=m + "shared_expert.up_proj.weight",
                     shared_w2=m + "shared_expert.down_proj.weight", shared_gate=m + "shared_expert_gate.weight")
    return names


def adapt_dense(w: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    """(1 + w) RMSNorm weights as plain ones; the depthwise conv weight [C, 1, K] as [C, K]."""
    out = dict(w)
    for name, t in w.items():
        if name == "norm" or name.rsplit(".", 1)[-1] in OFFSET_NORMS:
            out[name] = 1.0 + t.float()
        elif name.endswith(".lin_conv"):
            out[name] = t.squeeze(1)
    return {k: v.to(w[k].dtype) for k, v in out.items()}  # 1 + w in the compute dtype: a 16-bit embedding's is not
