"""Model families: model_type -> module with ARCHITECTURE, args_from_config, layer_names."""
from __future__ import annotations

from ..errors import CheckpointError, UnsupportedArchitecture
from . import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe, qwen3_next
from .args import ModelArgs

FAMILIES = {"qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "olmoe": olmoe, "mixtral": mixtral,
            "gpt_oss": gpt_oss, "qwen3_next": qwen3_next, "glm4_moe": glm4_moe, "deepseek_v3": deepseek_v3}


def family_of(config: dict):
    """The family module for config.json's model_type; raises UnsupportedArchitecture for others."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported; supported: "
            + ", ".join(f"{k} ({m.ARCHITECTURE})" for k, m in FAMILIES.items()))
    return FAMILIES[model_type]


def model_args(config: dict) -> ModelArgs:
    """ModelArgs of a config.json; raises CheckpointError naming a missing key."""
    family = family_of(config)
    try:
        return family.args_from_config(config)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r} required by {config['model_type']}; "
                              "restore the config from the model's release") from None
