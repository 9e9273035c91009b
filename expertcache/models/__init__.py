"""Model families: model_type -> module with ARCHITECTURE, args_from_config, layer_names."""
from __future__ import annotations

import math

from ..errors import CheckpointError, UnsupportedArchitecture
from . import (deepseek_v2, deepseek_v3, ernie4_5_moe, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe,
               qwen3_next)
from .args import ModelArgs, rope_type

ROPE_TYPES = ("default", "linear", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# config.json's switches, which the families read as truth values
BOOL_KEYS = ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "qkv_bias", "use_bias", "mlp_bias",
             "use_sliding_window", "use_qk_norm", "rope_interleave")

FAMILIES = {"qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "olmoe": olmoe, "mixtral": mixtral,
            "gpt_oss": gpt_oss, "qwen3_next": qwen3_next, "glm4_moe": glm4_moe, "deepseek_v3": deepseek_v3,
            "deepseek_v2": deepseek_v2, "ernie4_5_moe": ernie4_5_moe}


def family_of(config: dict):
    """The family module for config.json's model_type, or else for its architectures (a release may name its own
    model_type for a family's architecture: Kimi K2's kimi_k2 is DeepseekV3ForCausalLM); raises
    UnsupportedArchitecture for others."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    architectures = config.get("architectures")
    for family in FAMILIES.values():
        if isinstance(architectures, list) and family.ARCHITECTURE in architectures:
            return family
    raise UnsupportedArchitecture(
        f"model_type {model_type!r} is not supported; supported: "
        + ", ".join(f"{k} ({m.ARCHITECTURE})" for k, m in FAMILIES.items()))


def _whole(v, least: int = 1) -> bool:
    """Whether a config value is a whole number (not a bool) of at least `least`."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _number(v) -> bool:
    """Whether a config value is a number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


MAX_EXPERTS = 65_536  # per layer: 128 times the most of any released model (512)
MAX_LAYERS = 10_000  # 100 times the most of any released MoE model: each is named before any weight is read
MAX_VOCAB = 2**24  # 64 times the largest released tokenizer's: past it the memory check blamed --max-seq


def model_args(config: dict) -> ModelArgs:
    """ModelArgs of a config.json; raises CheckpointError naming a missing key."""
    family = family_of(config)
    # read as truth values: the string "false" is true, so it renormalised the top-k or slid the window in silence
    # (HF refuses any value that is not a JSON boolean; null reads as false in both)
    flags = [f"{k} {v!r}" for k in BOOL_KEYS if (v := config.get(k)) is not None and not isinstance(v, bool)]
    if flags:
        raise CheckpointError(f"config.json gives {', '.join(flags)}; each must be true or false (a JSON boolean, "
                              "unquoted): restore the config from the model's release")
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > MAX_LAYERS:  # 3 million ran for minutes
        raise CheckpointError(f"config.json gives {layers:,} layers (num_hidden_layers), more than {MAX_LAYERS:,}; "
                              "restore the config from the model's release")
    name = next(k for k, m in FAMILIES.items() if m is family)  # found by its architecture, model_type may be absent
    try:
        a = family.args_from_config(config)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r} required by {name}; "
                              "restore the config from the model's release") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # a value of the wrong type (a list
        # where an object of RoPE parameters goes), or 0 where it divides
        raise CheckpointError(f"config.json has a value {name} cannot take ({e}); restore the "
                              "config from the model's release") from None
    sizes = {"vocab_size": a.vocab_size, "hidden_size": a.hidden_size, "num_hidden_layers": a.num_layers,
             "num_attention_heads": a.num_heads, "number of experts": a.num_experts,
             "experts per token (top-k)": a.top_k, "expert intermediate size": a.expert_dim,
             "max_position_embeddings": a.max_position_embeddings}
    if "linear_attention" in a.layer_types:
        sizes |= {"linear_num_key_heads": a.linear_num_key_heads, "linear_num_value_heads": a.linear_num_value_heads,
                  "linear_key_head_dim": a.linear_key_head_dim, "linear_value_head_dim": a.linear_value_head_dim,
                  "linear_conv_kernel_dim": a.linear_conv_kernel}
    if a.attention == "mla":
        sizes |= {"kv_lora_rank": a.kv_lora_rank, "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim}
        if a.q_lora_rank:  # null (or 0): q projected directly
            sizes["q_lora_rank"] = a.q_lora_rank
    bad = [f"{name} {v!r}" for name, v in sizes.items() if not _whole(v)]
    if bad:
        raise CheckpointError(f"config.json gives {', '.join(bad)}; each must be a whole number >= 1: restore the "
                              "config from the model's release")
    if a.vocab_size > MAX_VOCAB:
        raise CheckpointError(f"config.json gives vocab_size {a.vocab_size:,}, more than {MAX_VOCAB:,}; restore the "
                              "config from the model's release")
    if a.num_experts > MAX_EXPERTS:  # each expert is named before any weight is read: 10^9 of them ate the memory
        raise CheckpointError(f"config.json gives {a.num_experts:,} experts per layer, more than {MAX_EXPERTS:,}; "
                              "restore the config from the model's release")
    if a.attention == "mla" and not _whole(a.qk_nope_head_dim, 0):
        raise CheckpointError(f"config.json gives qk_nope_head_dim {a.qk_nope_head_dim!r}; it must be a whole number "
                              ">= 0: restore the config from the model's release")
    if "linear_attention" in a.layer_types and a.linear_num_value_heads % a.linear_num_key_heads:
        raise CheckpointError(f"config.json gives {a.linear_num_value_heads} linear-attention value heads over "
                              f"{a.linear_num_key_heads} key heads, which do not divide them: restore the config "
                              "from the model's release")
    if not (math.isfinite(a.routed_scaling_factor) and a.routed_scaling_factor > 0):  # below 0 the experts' sum
        # flipped sign in silence
        raise CheckpointError(f"config.json gives routed_scaling_factor {a.routed_scaling_factor!r}; it must be a "
                              "finite number > 0: restore the config from the model's release")
    if a.swiglu_limit is not None and not (math.isfinite(a.swiglu_limit) and a.swiglu_limit > 0):
        raise CheckpointError(f"config.json gives swiglu_limit {a.swiglu_limit!r}; it must be a finite number > 0: "
                              "restore the config from the model's release")
    if not (math.isfinite(a.rope_theta) and a.rope_theta > 0):  # 0, negative or NaN: non-finite logits, blamed on
        # the weights; infinite: positions never rotated
        raise CheckpointError(f"config.json gives rope_theta {a.rope_theta!r}; it must be a finite number > 0: restore "
                              "the config from the model's release")
    if not 0 <= a.partial_rotary_factor <= 1:  # past 1 or below 0 it failed in the first forward's RoPE tables
        raise CheckpointError(f"config.json gives partial_rotary_factor {a.partial_rotary_factor!r}, the share of each "
                              "head that RoPE rotates; it must be from 0 to 1: restore the config from the model's "
                              "release")
    if a.clip_qkv is not None and not (_number(a.clip_qkv) and a.clip_qkv > 0):  # a string failed mid-forward
        raise CheckpointError(f"config.json gives clip_qkv {a.clip_qkv!r}; it must be a number > 0, or null for no "
                              "clipping: restore the config from the model's release")
    if not _number(a.rms_norm_eps) or not a.rms_norm_eps >= 0:
        raise CheckpointError(f"config.json gives rms_norm_eps {a.rms_norm_eps!r}; it must be a number >= 0: restore "
                              "the config from the model's release")
    if not _whole(a.num_kv_heads) or a.num_heads % a.num_kv_heads:
        raise CheckpointError(f"config.json gives {a.num_heads} attention heads over {a.num_kv_heads!r} key-value "
                              "heads, which must be a whole number >= 1 that divides them: restore the config from "
                              "the model's release")
    act = config.get("hidden_act", "silu")
    if a.family != "gpt_oss" and act not in ("silu", "swish"):  # GPT-OSS's clamped SwiGLU is its own (swiglu_*)
        raise UnsupportedArchitecture(f"config.json's hidden_act is {act!r}: expertcache computes experts and MLPs "
                                      "as SwiGLU with silu, so its output would be another model's; supported: silu")
    if a.top_k > a.num_experts:
        raise CheckpointError(f"config.json routes each token to {a.top_k} experts of only {a.num_experts}; "
                              "restore the config from the model's release")
    groups_ok = _whole(a.n_group) and _whole(a.topk_group) and a.topk_group <= a.n_group \
        and a.num_experts % a.n_group == 0 and a.top_k <= a.topk_group * (a.num_experts // a.n_group)
    if not groups_ok:
        raise CheckpointError(f"config.json routes top-{a.top_k} of {a.num_experts} experts within {a.topk_group!r} of "
                              f"{a.n_group!r} groups; the groups must divide the experts and hold the top-k: restore "
                              "the config from the model's release")
    if "sliding_attention" in a.layer_types and not _whole(a.sliding_window):
        raise CheckpointError(f"config.json gives sliding_window {a.sliding_window!r} for its sliding-window layers; "
                              "it must be a whole number >= 1: restore the config from the model's release")
    if len(a.layer_types) not in (0, a.num_layers):
        raise CheckpointError(f"config.json gives {len(a.layer_types)} layer_types for {a.num_layers} layers: restore "
                              "the config from the model's release")
    if unknown := sorted(set(a.layer_types) - set(LAYER_TYPES)):  # HF's config validation refuses them too
        raise CheckpointError(f"config.json gives layer_types {', '.join(map(repr, unknown))}; supported: "
                              f"{', '.join(LAYER_TYPES)}: restore the config from the model's release")
    rope, kind = a.rope_scaling or {}, rope_type(a.rope_scaling)
    if kind not in ROPE_TYPES:
        raise UnsupportedArchitecture(f"config.json's RoPE scaling {kind!r} is not supported (its positions would be "
                                      f"another model's); supported: {', '.join(ROPE_TYPES)}")
    factor = rope.get("factor")
    factor_ok = (factor is None and kind == "yarn") or (  # YaRN without one: max / original positions
        _number(factor) and math.isfinite(factor) and factor > 0)
    original_ok = kind != "yarn" or _whole(rope.get("original_max_position_embeddings"))
    if kind != "default" and not (factor_ok and original_ok):
        needs = "a factor > 0" + (" and original_max_position_embeddings >= 1" if kind == "yarn" else "")
        raise CheckpointError(f"config.json's {kind} RoPE scaling needs {needs} (it gives {rope}): restore the "
                              "config from the model's release")
    # RoPE turns pairs of channels: an odd count rounds up to the next pair (HF's tables too), which a partial
    # rotary (GLM-4.5, Qwen3-Next) has beside it, but a whole head or MLA's rope part has not: it failed inside the
    # first forward pass, as it fails in HF's
    rotated, channels = ((a.qk_rope_head_dim, a.qk_rope_head_dim) if a.attention == "mla"
                         else (int(a.head_dim * a.partial_rotary_factor), a.head_dim))
    roped = any(a.layer_type(i) != "linear_attention" for i in range(a.num_layers))
    if roped and rotated % 2 and rotated == channels:
        what = "qk_rope_head_dim" if a.attention == "mla" else "head_dim"
        raise CheckpointError(f"config.json gives {what} {rotated}, an odd number of rotary channels per head, but "
                              "RoPE rotates pairs of channels: restore the config from the model's release")
    if a.num_moe_layers < 1:
        raise CheckpointError("config.json describes no MoE layer (every layer dense); expertcache runs "
                              "Mixture-of-Experts models")
    return a
