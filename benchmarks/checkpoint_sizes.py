"""Real checkpoints sized from their config alone (`expertcache info --config`): the shapes of
released MoE models, as their published config.json files give them, and what fits in a fast
tier of 8, 16 and 24 GiB. Writes each config to --out and prints the table of docs/families.md.

    python benchmarks/checkpoint_sizes.py --out build/configs
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from expertcache.cli import run_script
from expertcache.commands.info import BUDGETS_GB, size_config

# The shape-defining keys of each released config.json (everything else takes its default).
CONFIGS = {
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "moe_intermediate_size": 768, "intermediate_size": 6144, "num_experts": 128,
                      "num_experts_per_tok": 8, "vocab_size": 151936, "norm_topk_prob": True,
                      "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "Qwen3-Next-80B-A3B": {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
                           "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                           "intermediate_size": 5120, "num_experts": 512, "num_experts_per_tok": 10,
                           "vocab_size": 151936, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                           "full_attention_interval": 4, "partial_rotary_factor": 0.25, "norm_topk_prob": True,
                           "rope_theta": 10000000.0, "tie_word_embeddings": False},
    "gpt-oss-20b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
                    "rope_theta": 150000.0, "tie_word_embeddings": False},
    "gpt-oss-120b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                     "num_local_experts": 128, "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
                     "rope_theta": 150000.0, "tie_word_embeddings": False},
    "GLM-4.5-Air": {"model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46,
                    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                    "moe_intermediate_size": 1408, "intermediate_size": 10944, "n_routed_experts": 128,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5,
                    "vocab_size": 151552, "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False,
                    "tie_word_embeddings": False},
    "DeepSeek-V2-Lite": {"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
                         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "moe_intermediate_size": 1408, "intermediate_size": 10944, "n_routed_experts": 64,
                         "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                         "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                         "norm_topk_prob": False, "vocab_size": 102400, "rope_theta": 10000,
                         "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 0.707, "mscale_all_dim": 0.707,
                                          "original_max_position_embeddings": 4096},
                         "max_position_embeddings": 163840, "tie_word_embeddings": False},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/configs"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print("| model | family | MoE layers x experts, top-k | params | one expert fp16 / int4 / mxfp4 | dense (bf16) "
          "| KV per token | experts per layer that fit in " + " / ".join(f"{g} GiB" for g in BUDGETS_GB) + " |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, config in CONFIGS.items():
        (a.out / f"{name}.json").write_text(json.dumps(config, indent=1))
        try:
            s = size_config(config)
        except Exception as e:  # a family this checkout does not implement yet
            print(f"| {name} | {config['model_type']} | not supported here: {e} |")
            continue
        eb = s["expert_bytes"]
        fits = " / ".join(f"{f['experts_per_layer']} ({f['fraction']:.0%})" if f["enough"] else "too few"
                          for f in s["fits"].values())
        print(f"| {name} | `{s['family']}` | {s['moe_layers']} x {s['experts']}, top-{s['top_k']} | "
              f"{s['params'] / 1e9:.1f}B | {eb['fp16'] / 2**20:.2f} / {eb['int4'] / 2**20:.2f} / "
              f"{eb['mxfp4'] / 2**20:.2f} MiB | {s['dense_bytes'] / 2**30:.2f} GiB | "
              f"{s['kv_bytes_per_token'] / 2**10:.0f} KiB | {fits} |")


if __name__ == "__main__":
    run_script(main)
