"""A random-weight HF checkpoint with a real model's expert shape, for timing the engine where
an expert is megabytes, not kilobytes: Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, top-8,
32 query and 4 key-value heads of 128) over fewer layers. Written one safetensors shard per
layer (fp16, as released checkpoints are), with the built-in model's tokenizer (vocab 8192), so
every verb runs on it.

    python benchmarks/make_checkpoint.py --out build/qwen3-30b-shape [--layers 8 | --from-builtin]
    expertcache bench --model build/qwen3-30b-shape --cache 0.25 --decode-tokens 16 --forced-tokens 64

Routing is not flat: the router's weights are drawn at the scale that gives its logits a
standard deviation near 1 over normed inputs.

`--from-builtin` writes the built-in model itself at that shape instead (its 6 layers, 128 experts, top-8):
the same function, its logits to fp16's rounding, so that routes, predictors and perplexity are a trained
model's while every expert is read, held and computed at the real size. Its residual stream lives in a random
160-dimensional subspace of the 2048 channels (every weight that reads or writes it is rotated into it, the
norms' weights folded in), its heads are placed among the 32 query and 4 key-value heads (the others' outputs
are dropped by zero columns of o_proj), each head's 40 channels among 128 with RoPE's frequencies kept
(rope_theta^(128/40)), and each expert's 64 neurons among 768 (the others' up rows are zero, so they add
nothing). The other weights that carry no signal are random where that changes nothing (the other neurons'
gate rows and down columns, the other heads' q, k and v), so that few weights are zero. Every map of the
stream has rank <= 160: what compresses weights by rank would look better on it than on a real model.
"""
from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from expertcache.cli import run_script
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


def builtin_at_shape(seed: int, shape: dict = SHAPE) -> tuple[dict, Iterator[tuple[str, dict[str, torch.Tensor]]]]:
    """The built-in model's config at `shape` and its shards, one at a time, fp16: the same function (see the
    module's doc). `shape` may be any at least as large in each dimension, with the built-in's experts and
    top-k."""
    b = json.loads((BUILTIN_MODEL / "config.json").read_text())
    H0, H, D0, D = b["hidden_size"], shape["hidden_size"], b["head_dim"], shape["head_dim"]
    F0, F, E = b["moe_intermediate_size"], shape["moe_intermediate_size"], b["num_experts"]
    if (E, b["num_experts_per_tok"]) != (shape["num_experts"], shape["num_experts_per_tok"]):
        raise SystemExit("the built-in model's experts differ from the shape's in number or top-k")
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(H, H0, generator=g, dtype=torch.float64))[0].float()  # the stream's subspace
    # RMSNorm over H channels of which H0 carry the stream: its mean square is H0/H of the built-in's, which the
    # readers' scale and the epsilon's undo
    root = (H0 / H) ** 0.5

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02
    w = {k: t.float() for k, t in load_file(str(BUILTIN_MODEL / "model.safetensors")).items()}

    def reader(W: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """A linear map of a normed stream, its norm's weight folded in: [out, H0] -> [out, H]."""
        return root * (W * norm) @ U.T

    def writer(W: torch.Tensor) -> torch.Tensor:
        """A linear map into the stream: [H0, in] -> [H, in]."""
        return U @ W
    heads0, kv0 = b["num_attention_heads"], b["num_key_value_heads"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    # each built-in head keeps its key-value group: head h of group h // (heads0 / kv0) goes to that group's block
    place = [(h // (heads0 // kv0)) * (heads // kv) + h % (heads0 // kv0) for h in range(heads0)]
    half0, half = D0 // 2, D // 2
    rope_dims = torch.cat([torch.arange(half0), half + torch.arange(half0)])  # rotate-half pairs stay pairs

    def fp16(name: str, t: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        return name, {k: v.half().contiguous() for k, v in t.items()}

    def shards():
        lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # the built-in model ties them
        yield fp16("model-dense.safetensors", {"model.embed_tokens.weight": w["model.embed_tokens.weight"] @ U.T,
                                               "model.norm.weight": torch.ones(H),
                                               "lm_head.weight": reader(lm_head, w["model.norm.weight"])})
        for i in range(b["num_hidden_layers"]):
            yield fp16(f"model-layer-{i:03d}.safetensors", layer(i))

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        ln, post = w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]
        q, k, v = rand(heads * D, H), rand(kv * D, H), rand(kv * D, H)
        o = torch.zeros(H0, heads * D)
        q0, k0 = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
        v0, o0 = w[p + "self_attn.v_proj.weight"], w[p + "self_attn.o_proj.weight"]
        for h, t in enumerate(place):
            q[t * D:(t + 1) * D] = 0
            q[t * D + rope_dims] = reader(q0[h * D0:(h + 1) * D0], ln)
            o[:, t * D:t * D + D0] = o0[:, h * D0:(h + 1) * D0]
        for group in range(kv0):
            k[group * D:(group + 1) * D] = 0
            k[group * D + rope_dims] = reader(k0[group * D0:(group + 1) * D0], ln)
            v[group * D:group * D + D0] = reader(v0[group * D0:(group + 1) * D0], ln)
        # q/k norms over D channels of which D0 are the head's: q's normed values come out sqrt(D/D0) larger,
        # which undoes the attention's 1/sqrt(D) against the built-in's 1/sqrt(D0); k's are scaled back
        qn, kn = torch.ones(D), torch.ones(D)
        qn[rope_dims] = w[p + "self_attn.q_norm.weight"]
        kn[rope_dims] = w[p + "self_attn.k_norm.weight"] * (D0 / D) ** 0.5
        t = {p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
             p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
             p + "self_attn.o_proj.weight": writer(o), p + "self_attn.q_norm.weight": qn,
             p + "self_attn.k_norm.weight": kn, p + "mlp.gate.weight": reader(w[p + "mlp.gate.weight"], post)}
        for e in range(E):
            x = p + f"mlp.experts.{e}."
            gate, up, down = rand(F, H), torch.zeros(F, H), rand(H, F)
            gate[:F0] = reader(w[x + "gate_proj.weight"], post)
            up[:F0] = reader(w[x + "up_proj.weight"], post)
            down[:, :F0] = writer(w[x + "down_proj.weight"])
            t |= {x + "gate_proj.weight": gate, x + "up_proj.weight": up, x + "down_proj.weight": down}
        return t
    c = {**shape, "num_hidden_layers": b["num_hidden_layers"], "vocab_size": b["vocab_size"],
         "eos_token_id": b["eos_token_id"], "pad_token_id": b["pad_token_id"],
         "max_position_embeddings": b["max_position_embeddings"],
         "rope_theta": b["rope_theta"] ** (D / D0), "rms_norm_eps": b["rms_norm_eps"] * H0 / H}
    return c, shards()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=None, help="random weights: this many layers (default 8)")
    p.add_argument("--from-builtin", action="store_true",
                   help="the built-in model's weights at the shape, the same function (its 6 layers)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.from_builtin and a.layers is not None:
        p.error("--from-builtin writes the built-in model's 6 layers; leave out --layers")
    if a.from_builtin:
        write(a.out, *builtin_at_shape(a.seed))
        print(f"its predictors (for prefetch and speculative policies; ~20 min here): expertcache calibrate --model "
              f"{a.out} --max-tokens 8192 && expertcache predict --train --model {a.out} --max-tokens 16384")
        return
    a.layers = 8 if a.layers is None else a.layers
    if a.layers < 1:
        p.error(f"--layers {a.layers} must be >= 1")
    write(a.out, *random_at_shape(a.layers, a.seed))


def random_at_shape(layers: int, seed: int) -> tuple[dict, Iterator[tuple[str, dict[str, torch.Tensor]]]]:
    """A random model's config at SHAPE with `layers` layers and its shards, one at a time."""
    vocab = json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"]
    c = {**SHAPE, "num_hidden_layers": layers, "vocab_size": vocab, "eos_token_id": 0, "pad_token_id": 0}
    g = torch.Generator().manual_seed(seed)
    H = c["hidden_size"]

    def shards():
        yield "model-dense.safetensors", {"model.embed_tokens.weight": torch.randn(vocab, H, generator=g).half(),
                                          "model.norm.weight": torch.ones(H, dtype=torch.half),
                                          "lm_head.weight": (torch.randn(vocab, H, generator=g) * 0.02).half()}
        for i in range(layers):
            yield f"model-layer-{i:03d}.safetensors", layer_tensors(i, c, g)
    return c, shards()


def write(out: Path, c: dict, shards: Iterator[tuple[str, dict[str, torch.Tensor]]]) -> None:
    """The checkpoint's shards (the dense one, then one per layer), its index, config and tokenizer in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for name, tensors in tqdm(shards, total=c["num_hidden_layers"] + 1, desc="shards", unit="shard"):
        save_file(tensors, str(out / name))
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(c, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL / f, out / f)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    H, F = c["hidden_size"], c["moe_intermediate_size"]
    print(f"{out}: {c['num_hidden_layers']} layers x {c['num_experts']} experts of {3 * H * F:,} parameters "
          f"({3 * H * F * 2 / 2**20:.1f} MiB fp16 each), {size / 2**30:.2f} GiB")


if __name__ == "__main__":
    run_script(main)
