"""GPT-OSS: attention sinks, alternating sliding-window and full attention, YaRN RoPE, q/k/v/o
biases; a router with a bias whose softmax over the top-k logits equals the full softmax
renormalised over the top-k (norm_topk_prob); experts with biases and a clamped SwiGLU.

HF stores the experts fused and transposed, gate and up interleaved (gate_up_proj [E, H, 2F],
columns g0 u0 g1 u1 ...; down_proj [E, F, H]); released checkpoints hold them in MXFP4
(`*_blocks`, `*_scales`). Both are translated at load time into our w13 [E, 2F, H] (gate rows,
then up rows), w2 [E, H, F] and biases b13 [E, 2F], b2 [E, H]; converting MXFP4 experts to an mxfp4
disk store takes their codes and scales as they are (`expert_parts`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..engine.quant import mxfp4_to_float
from .args import (
    LayerExperts,
    ModelArgs,
    head_dim,
    num_experts,
    rope_scaling,
    rope_theta,
)

if TYPE_CHECKING:
    from ..engine.checkpoint import Checkpoint

ARCHITECTURE = "GptOssForCausalLM"

# HF's GptOssConfig gives a config without rope_parameters (or rope_scaling) this YaRN, not plain RoPE
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


def args_from_config(c: dict) -> ModelArgs:
    """ModelArgs from a GPT-OSS config.json."""
    layers = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return ModelArgs(
        family="gpt_oss", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=layers,
        num_heads=c["num_attention_heads"], num_kv_heads=c.get("num_key_value_heads", 8), head_dim=head_dim(c, 64),
        num_experts=num_experts(c), top_k=c.get("num_experts_per_tok", c.get("experts_per_token", 4)),
        expert_dim=c["intermediate_size"], norm_topk_prob=True, rope_theta=rope_theta(c, 150000.0),
        rms_norm_eps=c.get("rms_norm_eps", 1e-5), tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("attention_bias", True), max_position_embeddings=c.get("max_position_embeddings", 131072),
        layer_types=tuple(types), sliding_window=c.get("sliding_window", 128), attention_sinks=True,  # HF defaults
        rope_scaling=rope_scaling(c) if c.get("rope_parameters") or c.get("rope_scaling") else dict(DEFAULT_ROPE),
        router_bias=True,
        expert_bias=True, swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)))


def layer_names(i: int, a: ModelArgs) -> dict:
    """Our name -> checkpoint name for layer i's dense tensors (experts: see `layer_experts`)."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    names = {"attn_norm": p + "input_layernorm.weight", "moe_norm": p + "post_attention_layernorm.weight",
             "wq": attn + "q_proj.weight", "wk": attn + "k_proj.weight", "wv": attn + "v_proj.weight",
             "wo": attn + "o_proj.weight", "sinks": attn + "sinks", "router": p + "mlp.router.weight",
             "router_bias": p + "mlp.router.bias"}
    if a.attention_bias:
        names.update(bq=attn + "q_proj.bias", bk=attn + "k_proj.bias", bv=attn + "v_proj.bias", bo=attn + "o_proj.bias")
    return names


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) g0 u0 g1 u1 ... along dim 1 -> gate rows, then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def expert_tensor_names(ckpt: Checkpoint, a: ModelArgs, layer: int) -> list[str]:
    """The tensors that hold layer `layer`'s experts, as this checkpoint stores them (MXFP4 or float)."""
    p = f"model.layers.{layer}.mlp.experts."
    held = (("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
            if p + "gate_up_proj_blocks" in ckpt.files else ("gate_up_proj", "down_proj"))
    return [p + n for n in ("gate_up_proj_bias", "down_proj_bias", *held)]


def layer_experts(ckpt: Checkpoint, a: ModelArgs, layer: int) -> LayerExperts:
    """Layer `layer`'s experts in our layout, from HF's fused tensors or from MXFP4 blocks and scales."""
    p = f"model.layers.{layer}.mlp.experts."
    biases = ckpt.tensors([p + "gate_up_proj_bias", p + "down_proj_bias"])
    if p + "gate_up_proj_blocks" in ckpt.files:  # released checkpoints: MXFP4, rows already [out, in]
        t = ckpt.tensors([p + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                          "down_proj_scales")])
        gate_up = mxfp4_to_float(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"])  # [E, 2F, H]
        down = mxfp4_to_float(t[p + "down_proj_blocks"], t[p + "down_proj_scales"])  # [E, H, F]
    else:  # HF's in-memory layout: x @ W, so [E, in, out]
        t = ckpt.tensors([p + "gate_up_proj", p + "down_proj"])
        gate_up, down = t[p + "gate_up_proj"].transpose(1, 2), t[p + "down_proj"].transpose(1, 2)
    return LayerExperts(_deinterleave(gate_up).contiguous(), down.contiguous(),
                        _deinterleave(biases[p + "gate_up_proj_bias"]), biases[p + "down_proj_bias"])


def expert_parts(ckpt: Checkpoint, a: ModelArgs, layer: int, expert: int, mxfp4: bool) -> list:
    """One expert of layer `layer` read alone (engine/weights.expert_parts): [w13, w2, b13, b2] in our layout,
    the matrices as floats, or with `mxfp4` as the checkpoint's MXFP4 codes and scales where it holds them."""
    p = f"model.layers.{layer}.mlp.experts."

    def one(name: str) -> torch.Tensor:
        return ckpt.tensor(p + name, expert)[None]  # [1, ...]: the fused layout's leading expert dimension

    def gate_up(t: torch.Tensor) -> torch.Tensor:
        return _deinterleave(t)[0]
    biases = [gate_up(one("gate_up_proj_bias")), one("down_proj_bias")[0]]
    if p + "gate_up_proj_blocks" in ckpt.files:
        blocks, scales = one("gate_up_proj_blocks"), one("gate_up_proj_scales")
        down_b, down_s = one("down_proj_blocks"), one("down_proj_scales")
        if mxfp4:
            return [{"codes": gate_up(blocks).reshape(2 * a.expert_dim, -1), "scales": gate_up(scales)},
                    {"codes": down_b[0].reshape(a.hidden_size, -1), "scales": down_s[0]}, *biases]
        return [gate_up(mxfp4_to_float(blocks, scales)), mxfp4_to_float(down_b, down_s)[0], *biases]
    return [gate_up(one("gate_up_proj").transpose(1, 2)).contiguous(), one("down_proj")[0].t().contiguous(), *biases]
