"""Tiny random HF models of every supported family, saved as real checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def hf_config(family: str, **over):
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Ernie4_5_MoeConfig,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )
    # GLM-4.5 / DeepSeek-V3 shapes in small: 16 experts in 4 groups, 2 groups allowed, top-4, one dense layer
    grouped = dict(num_hidden_layers=3, moe_intermediate_size=16, intermediate_size=48, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                   routed_scaling_factor=2.5, norm_topk_prob=True)
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
    elif family == "glm4_moe":
        c = Glm4MoeConfig(**{**COMMON, **grouped}, use_qk_norm=True, attention_bias=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    elif family == "deepseek_v3":
        c = DeepseekV3Config(**{**COMMON, **grouped, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=16,
                             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, head_dim=4)
    elif family == "deepseek_v2":  # V2-Lite's shape in small: q projected directly, greedy softmax top-k, scaled
        c = DeepseekV2Config(**{**COMMON, **grouped, "num_key_value_heads": 4, "n_group": 1, "topk_group": 1},
                             topk_method="greedy", q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=4, v_head_dim=8)  # grouped's norm_topk_prob True: HF ignores it
    elif family == "deepseek_v3_yarn":  # released checkpoints' YaRN in small: a ramp inside the 8 rotary channels,
        # mscale != mscale_all_dim so that both the rotary tables and the softmax scale change
        c = DeepseekV3Config(**{**COMMON, **grouped, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=16,
                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0,
                                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8,
                                                  original_max_position_embeddings=64))
    elif family == "ernie4_5_moe":  # a dense first layer, two shared experts, full-width RoPE on adjacent pairs
        c = Ernie4_5_MoeConfig(**{**COMMON, "num_hidden_layers": 3}, moe_intermediate_size=16, intermediate_size=48,
                               moe_num_experts=8, moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1,
                               tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(family)
    for k, v in over.items():
        setattr(c, k, v)
    return c


ROUTER_SCALE = 8.0
SIGMOID_ROUTER_SCALE = 10.0


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
            if is_router(name):  # a flat router would hide mistakes in routing; sigmoid scores far from 0.5
                p.mul_(SIGMOID_ROUTER_SCALE if family in SIGMOID_ROUTED else ROUTER_SCALE)
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():  # a selection bias that changes which experts are chosen
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3", "deepseek_v3_yarn")
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "qwen3_next", "glm4_moe", "deepseek_v3",
            "deepseek_v2", "ernie4_5_moe"]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference MXFP4 encoder: w [..., N] (N a multiple of 32) -> (blocks [..., N / 32, 16] uint8,
    scales [..., N / 32] uint8): per group of 32 a power-of-two scale, each value rounded to the nearest FP4 code."""
    from expertcache.engine.quant import FP4_VALUES
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    lut = torch.tensor(FP4_VALUES)
    codes = ((groups / torch.exp2(exp)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def save_gpt_oss_mxfp4(path: Path):
    """A tiny GPT-OSS saved as released checkpoints are, experts in MXFP4 (`*_blocks`, `*_scales`); returns
    the HF reference model running on HF's own dequantisation of the same codes."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf = save_tiny("gpt_oss", path, hidden_size=64, intermediate_size=32)  # MXFP4 groups of 32 inputs
    state = load_file(str(path / "model.safetensors"))
    for i in range(hf.config.num_hidden_layers):
        experts = hf.model.layers[i].mlp.experts
        p = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = quantize_mxfp4(state.pop(p + name).transpose(1, 2))  # stored as [E, out, in]
            state[p + name + "_blocks"], state[p + name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, str(path / "model.safetensors"))
    return hf
