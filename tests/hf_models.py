"""Tiny random HF models of every supported family, saved as real checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def hf_config(family: str, **over):
    from transformers import GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig, Qwen3NextConfig
    if family == "qwen3_moe":
        c = Qwen3MoeConfig(**COMMON, moe_intermediate_size=16, intermediate_size=48, num_experts=8,
                           num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)
    elif family == "qwen2_moe":
        c = Qwen2MoeConfig(**COMMON, moe_intermediate_size=16, intermediate_size=48,
                           shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2)
    elif family == "olmoe":
        c = OlmoeConfig(**COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=2, clip_qkv=3.0)
    elif family == "mixtral":
        c = MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    elif family == "gpt_oss":  # a 4-token window in 20-token tests; YaRN ramping inside head_dim; a limit that clamps
        c = GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                         sliding_window=4, swiglu_limit=0.1,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0,
                                              beta_slow=1.0, truncate=False, original_max_position_embeddings=64))
    elif family == "qwen3_next":  # layers: linear, full, linear
        c = Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 3}, full_attention_interval=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=8,
                            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_conv_kernel_dim=4)
    else:
        raise ValueError(family)
    for k, v in over.items():
        setattr(c, k, v)
    return c


ROUTER_SCALE = 8.0


def is_router(name: str) -> bool:
    """Router weights of every family: `mlp.gate.weight` / `block_sparse_moe.gate.weight` / `mlp.router`."""
    return name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight"))


def save_tiny(family: str, path: Path, seed: int = 0, **over):
    """Build a random HF model of `family`, save it to `path`, return it (eval, fp32)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **over)).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so parity sees them
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            if is_router(name):  # a flat router would hide mistakes in routing: make it decisive
                p.mul_(ROUTER_SCALE)
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path)
    return model


FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "qwen3_next"]
