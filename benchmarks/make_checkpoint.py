"""A random-weight HF checkpoint with a real model's expert shape, for timing the engine where
an expert is megabytes, not kilobytes: Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, top-8,
32 query and 4 key-value heads of 128) over fewer layers. Written one safetensors shard per
layer (fp16, as released checkpoints are), with the built-in model's tokenizer (vocab 8192), so
every verb runs on it.

    python benchmarks/make_checkpoint.py --out build/qwen3-30b-shape [--layers 8]
    expertcache bench --model build/qwen3-30b-shape --cache 0.25 --decode-tokens 16 --forced-tokens 64

Routing is not flat: the router's weights are drawn at the scale that gives its logits a
standard deviation near 1 over normed inputs.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from expertcache.engine.engine import BUILTIN_MODEL

SHAPE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
         "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False,
         "hidden_act": "silu", "torch_dtype": "float16"}


def layer_tensors(i: int, c: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer i's tensors under Qwen3-MoE's checkpoint names, fp16."""
    H, D, F, E = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"], c["num_experts"]
    p = f"model.layers.{i}."

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).half()
    t = {p + "input_layernorm.weight": torch.ones(H, dtype=torch.half),
         p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.half),
         p + "self_attn.q_proj.weight": rand(c["num_attention_heads"] * D, H),
         p + "self_attn.k_proj.weight": rand(c["num_key_value_heads"] * D, H),
         p + "self_attn.v_proj.weight": rand(c["num_key_value_heads"] * D, H),
         p + "self_attn.o_proj.weight": rand(H, c["num_attention_heads"] * D),
         p + "self_attn.q_norm.weight": torch.ones(D, dtype=torch.half),
         p + "self_attn.k_norm.weight": torch.ones(D, dtype=torch.half),
         p + "mlp.gate.weight": rand(E, H, std=H ** -0.5)}
    for e in range(E):
        q = p + f"mlp.experts.{e}."
        t[q + "gate_proj.weight"], t[q + "up_proj.weight"] = rand(F, H), rand(F, H)
        t[q + "down_proj.weight"] = rand(H, F)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.layers < 1:
        p.error(f"--layers {a.layers} must be >= 1")
    vocab = json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"]
    c = {**SHAPE, "num_hidden_layers": a.layers, "vocab_size": vocab, "eos_token_id": 0, "pad_token_id": 0}
    a.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(a.seed)
    H = c["hidden_size"]
    shards = [("model-dense.safetensors", {"model.embed_tokens.weight": (torch.randn(vocab, H, generator=g)).half(),
                                           "model.norm.weight": torch.ones(H, dtype=torch.half),
                                           "lm_head.weight": (torch.randn(vocab, H, generator=g) * 0.02).half()})]
    weight_map = {name: shards[0][0] for name in shards[0][1]}
    save_file(shards[0][1], str(a.out / shards[0][0]))
    for i in tqdm(range(a.layers), desc="layers", unit="layer"):
        name, tensors = f"model-layer-{i:03d}.safetensors", layer_tensors(i, c, g)
        save_file(tensors, str(a.out / name))
        weight_map.update({k: name for k in tensors})
    (a.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (a.out / "config.json").write_text(json.dumps(c, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL / f, a.out / f)
    size = sum(f.stat().st_size for f in a.out.glob("*.safetensors"))
    print(f"{a.out}: {a.layers} layers x {c['num_experts']} experts of {3 * H * c['moe_intermediate_size']:,} "
          f"parameters ({3 * H * c['moe_intermediate_size'] * 2 / 2**20:.1f} MiB fp16 each), {size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
