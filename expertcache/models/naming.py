"""Checkpoint tensor names shared by the families (HF's layout of attention and experts)."""
from __future__ import annotations

from ..errors import UnsupportedArchitecture
from .args import ModelArgs


def dense_layers_unsupported(c: dict) -> None:
    """Raise UnsupportedArchitecture if the config has dense (non-MoE) layers."""
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedArchitecture(
            f"{c.get('model_type')}: dense (non-MoE) layers via mlp_only_layers/decoder_sparse_step are not "
            "supported; use a checkpoint whose every layer is MoE")


def per_expert_names(i: int, a: ModelArgs, moe: str, gate: str, w1: str, w3: str, w2: str) -> dict:
    """Our name -> checkpoint name for layer i; experts as lists indexed by expert id."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    names = {"attn_norm": p + "input_layernorm.weight", "moe_norm": p + "post_attention_layernorm.weight",
             "wq": attn + "q_proj.weight", "wk": attn + "k_proj.weight", "wv": attn + "v_proj.weight",
             "wo": attn + "o_proj.weight", "router": p + f"{moe}.{gate}.weight"}
    if a.attention_bias:
        names.update(bq=attn + "q_proj.bias", bk=attn + "k_proj.bias", bv=attn + "v_proj.bias")
    if a.qk_norm:
        names.update(q_norm=attn + "q_norm.weight", k_norm=attn + "k_norm.weight")
    e = p + f"{moe}.experts."
    names["experts"] = {"w1": [f"{e}{j}.{w1}.weight" for j in range(a.num_experts)],
                        "w3": [f"{e}{j}.{w3}.weight" for j in range(a.num_experts)],
                        "w2": [f"{e}{j}.{w2}.weight" for j in range(a.num_experts)]}
    return names
