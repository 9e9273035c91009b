"""The shape of a decoder-only MoE transformer, common to every family."""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import NamedTuple

import torch

from ..errors import CheckpointError


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a decoder-only MoE transformer, read from a family's config.json."""
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_dim: int  # F: each routed expert is SwiGLU H -> F -> H
    norm_topk_prob: bool
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False  # and the output projection's (Qwen3-MoE, Qwen3-Next, OLMoE with attention_bias)
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "full": over all heads (OLMoE)
    clip_qkv: float | None = None
    shared_expert_dim: int = 0  # an always-on expert (Qwen2-MoE, GLM-4.5, DeepSeek-V3)
    shared_expert_gate: bool = True  # Qwen2-MoE gates the shared expert with a sigmoid; GLM/DeepSeek do not
    max_position_embeddings: int = 4096
    # Attention variants (GPT-OSS, Qwen3-Next, GLM-4.5, DeepSeek-V3); the defaults are plain causal GQA with
    # full RoPE.
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention | linear_attention
    sliding_window: int | None = None
    attention_sinks: bool = False  # a learned per-head logit in the softmax denominator
    attention_gate: bool = False  # q_proj doubled: a sigmoid gate on the attention output per channel
    partial_rotary_factor: float = 1.0  # partial RoPE (GLM-4.5, Qwen3-Next): the share of each head that rotates
    rope_scaling: dict | None = None  # rope_parameters beyond rope_theta (YaRN: factor, beta_fast, ...)
    attention: str = "gqa"  # gqa | mla (multi-head latent attention, DeepSeek-V3)
    q_lora_rank: int | None = None  # mla: None projects q directly
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    rope_interleave: bool = False  # rotate pairs (x0, x1), (x2, x3), ... (DeepSeek-V3)
    # Gated DeltaNet (linear_attention layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # The router (see kernel/routing.py)
    router: str = "softmax"  # one of kernel.routing.KINDS
    # a per-expert bias of each MoE layer: added to the logits before top-k and softmax (GPT-OSS), or a
    # sigmoid router's selection bias (e_score_correction_bias: GLM-4.5, DeepSeek-V3)
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Experts
    expert_bias: bool = False  # b13 [2F] and b2 [H] per expert
    swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * glu
    swiglu_alpha: float = 1.702
    # Dense layers run a SwiGLU MLP of `dense_dim` instead of experts: the first `first_dense_layers` decoder
    # layers (DeepSeek, GLM), and those in `dense_layers` (Qwen's mlp_only_layers and decoder_sparse_step)
    first_dense_layers: int = 0
    dense_layers: tuple[int, ...] = ()
    dense_dim: int = 0

    def layer_type(self, i: int) -> str:
        """Layer i's attention kind: full_attention, sliding_attention or linear_attention."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    def is_dense(self, i: int) -> bool:
        """Whether decoder layer i runs a dense MLP instead of experts."""
        return i < self.first_dense_layers or i in self.dense_layers

    @cached_property  # read per layer call (the prefetch's lookahead): worked out once
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder layers with routed experts; the cache, kernel and routing counts index these 0.. in order."""
        return tuple(i for i in range(self.num_layers) if not self.is_dense(i))

    @property
    def num_moe_layers(self) -> int:
        """How many decoder layers route to experts."""
        return len(self.moe_layers)

    @property
    def expert_params(self) -> int:
        """Weights in one routed expert (w1, w3 and w2)."""
        return 3 * self.hidden_size * self.expert_dim

    def to_dict(self) -> dict:
        """Every field as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def rope_parameters(config: dict) -> dict:
    """The config's RoPE dict: rope_parameters (transformers 5), else rope_scaling (before it), which transformers
    reads the same way, rope_theta and partial_rotary_factor included (over the top-level keys)."""
    name = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(name) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json's {name} is a JSON {type(params).__name__}, not an object of RoPE "
                              "parameters; restore the model's own config.json")
    return params


def rope_theta(config: dict, default: float) -> float:
    """transformers 5 writes rope_parameters.rope_theta; older configs say rope_theta (or put it in rope_scaling)."""
    return float(rope_parameters(config).get("rope_theta", config.get("rope_theta", default)))


def head_dim(config: dict, default: int | None = None) -> int:
    """The attention head size: head_dim if the config gives it, else `default` if the key is absent (a family
    whose HF config has one: transformers reads the omitted key as that), else hidden_size / num_attention_heads."""
    return config.get("head_dim", default) or config["hidden_size"] // config["num_attention_heads"]


def num_experts(config: dict) -> int:
    """Released Qwen3 checkpoints say num_experts; transformers 5 writes num_local_experts."""
    # present with 0 it is that value, refused by the size checks, not "lacks num_local_experts"; neither given,
    # the releases' name is the one missing
    for key in ("num_experts", "num_local_experts"):
        if config.get(key) is not None:
            return config[key]
    raise KeyError("num_experts")


def rope_type(params: dict | None) -> str:
    """The kind of RoPE scaling that `params` (ModelArgs.rope_scaling) describe; older configs say `type`."""
    params = params or {}
    return params.get("rope_type", params.get("type", "default"))


def rope_scaling(config: dict) -> dict | None:
    """The RoPE parameters beyond rope_theta (rope_parameters in transformers 5, rope_scaling before),
    or None for plain RoPE."""
    params = {k: v for k, v in rope_parameters(config).items() if k not in ("rope_theta", "partial_rotary_factor")}
    return None if rope_type(params) == "default" else params


def sliding_fields(window, sliding: list[bool]) -> dict:
    """ModelArgs fields of sliding-window attention: the layers that slide (each family's rule, as HF reads its
    config) over the last `window` positions; none when there is no window or no layer slides."""
    if window is None or not any(sliding):
        return {}
    return dict(layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                sliding_window=window)


def partial_rotary_factor(config: dict, default: float = 1.0) -> float:
    """The share of each head that RoPE rotates (the RoPE dict's or the top-level key; `default` if absent)."""
    return float(rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", default)))


class LayerExperts(NamedTuple):
    """One layer's experts stacked: w13 [E, 2F, H] (gate rows then up rows), w2 [E, H, F], and for
    families with expert biases b13 [E, 2F] (gate then up) and b2 [E, H]."""
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
