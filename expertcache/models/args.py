"""The shape of a decoder-only MoE transformer, common to every family."""
from __future__ import annotations

from dataclasses import dataclass, fields


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
    attention_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "full": over all heads (OLMoE)
    clip_qkv: float | None = None
    shared_expert_dim: int = 0  # an always-on expert (Qwen2-MoE, GLM-4.5, DeepSeek-V3)
    shared_expert_gate: bool = True  # Qwen2-MoE gates the shared expert with a sigmoid; GLM/DeepSeek do not
    max_position_embeddings: int = 4096
    # the router (see kernel/routing.py)
    router: str = "softmax"  # softmax | sigmoid
    router_bias: bool = False  # sigmoid: a per-expert selection bias (e_score_correction_bias)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # dense layers: the first `first_dense_layers` decoder layers run a SwiGLU MLP of `dense_dim`
    first_dense_layers: int = 0
    dense_dim: int = 0
    # attention variants
    rotary_dim: int | None = None  # partial RoPE (GLM): only the first rotary_dim of each head rotate
    attention: str = "gqa"  # gqa | mla (multi-head latent attention, DeepSeek-V3)
    q_lora_rank: int | None = None  # mla: None projects q directly
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    rope_interleave: bool = False  # rotate pairs (x0, x1), (x2, x3), ... (DeepSeek-V3)

    @property
    def moe_layers(self) -> range:
        """Decoder layers with routed experts; the cache, kernel and routing counts index these 0.. in order."""
        return range(self.first_dense_layers, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        """How many decoder layers route to experts."""
        return self.num_layers - self.first_dense_layers

    @property
    def expert_params(self) -> int:
        """Weights in one routed expert (w1, w3 and w2)."""
        return 3 * self.hidden_size * self.expert_dim

    def to_dict(self) -> dict:
        """Every field as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def rope_theta(config: dict, default: float) -> float:
    """transformers 5 writes rope_parameters.rope_theta; older configs say rope_theta."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", default)))


def head_dim(config: dict) -> int:
    """The attention head size: head_dim if the config gives it, else hidden_size / num_attention_heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def num_experts(config: dict) -> int:
    """Released Qwen3 checkpoints say num_experts; transformers 5 writes num_local_experts."""
    return config.get("num_experts") or config["num_local_experts"]
