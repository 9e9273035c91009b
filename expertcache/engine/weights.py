"""Translate a family's checkpoint tensors into our layout: dense weights and stacked experts."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..errors import CheckpointError
from ..kernel.routing import Router
from ..models import family_of
from ..models.args import LayerExperts, ModelArgs
from .checkpoint import Checkpoint

VOCAB = ("embed", "lm_head")  # the largest dense tensors, read whole for every decoded token's logits


def dense_weights(ckpt: Checkpoint, args: ModelArgs, dtype=torch.float32,
                  keep_16bit_vocab: bool = False) -> dict[str, torch.Tensor]:
    """Every non-expert tensor under our names ('layers.{i}.wq', 'embed', ...), as `dtype`; with
    `keep_16bit_vocab`, the embedding and output matrices stay fp16 or bf16 when the checkpoint
    stores them so (exact in fp32 arithmetic, half the bytes to read per token)."""
    family = family_of(ckpt.config)
    wanted = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not args.tie_word_embeddings:
        wanted["lm_head"] = "lm_head.weight"
    for i in range(args.num_layers):
        for ours, theirs in family.layer_names(i, args).items():
            if ours != "experts":
                wanted[f"layers.{i}.{ours}"] = theirs
    loaded = ckpt.tensors(list(wanted.values()))
    def kept(ours: str, t: torch.Tensor) -> bool:
        return keep_16bit_vocab and ours in VOCAB and t.dtype in (torch.float16, torch.bfloat16)
    out = {ours: loaded[theirs] if kept(ours, loaded[theirs]) else loaded[theirs].to(dtype)
           for ours, theirs in wanted.items()}
    if hasattr(family, "adapt_dense"):  # a family's own conventions, e.g. RMSNorm weights stored as w - 1
        out = family.adapt_dense(out, args)
    _check_shapes(out, args)
    return out


def _check_shapes(w: dict[str, torch.Tensor], a: ModelArgs) -> None:
    first = a.moe_layers[0]
    attn = next((i for i in range(a.num_layers) if a.layer_type(i) != "linear_attention"), None)
    expect = {"embed": (a.vocab_size, a.hidden_size), f"layers.{first}.router": (a.num_experts, a.hidden_size)}
    if a.router_bias:
        expect[f"layers.{first}.router_bias"] = (a.num_experts,)
    if attn is not None and a.attention == "gqa":  # a gated attention's q_proj also yields the gate
        expect[f"layers.{attn}.wq"] = ((2 if a.attention_gate else 1) * a.num_heads * a.head_dim, a.hidden_size)
    for name, shape in expect.items():
        if tuple(w[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(w[name].shape)}, config.json implies {shape}; "
                                  "the config does not belong to these weights")


def layer_experts(ckpt: Checkpoint, args: ModelArgs, layer: int) -> LayerExperts:
    """MoE layer `layer`'s experts in our stacked layout (a family may translate its own storage)."""
    family = family_of(ckpt.config)
    decoder = args.moe_layers[layer]  # the decoder layer the checkpoint names
    if hasattr(family, "layer_experts"):
        experts = family.layer_experts(ckpt, args, decoder)
    else:
        experts = _standard_layer_experts(ckpt, args, decoder, family.layer_names(decoder, args)["experts"])
    E, F, H = args.num_experts, args.expert_dim, args.hidden_size
    w13, w2 = experts.w13, experts.w2
    if tuple(w13.shape) != (E, 2 * F, H) or tuple(w2.shape) != (E, H, F):
        raise CheckpointError(f"layer {decoder} experts have shapes {tuple(w13.shape)}, {tuple(w2.shape)}; "
                              f"config.json implies {(E, 2 * F, H)}, {(E, H, F)}")
    if args.expert_bias and (experts.b13 is None or tuple(experts.b13.shape) != (E, 2 * F)
                             or tuple(experts.b2.shape) != (E, H)):
        raise CheckpointError(f"layer {decoder} expert biases are missing or not of shapes {(E, 2 * F)}, {(E, H)}; "
                              "the config does not belong to these weights")
    return experts


def _standard_layer_experts(ckpt: Checkpoint, args: ModelArgs, layer: int, names: dict) -> LayerExperts:
    fused = names["w1"][0].rsplit(".experts.", 1)[0] + ".experts."
    if fused + "gate_up_proj" in ckpt.files:  # checkpoints that store experts fused
        t = ckpt.tensors([fused + "gate_up_proj", fused + "down_proj"])
        w13, w2 = t[fused + "gate_up_proj"], t[fused + "down_proj"]
    else:
        t = ckpt.tensors(names["w1"] + names["w3"] + names["w2"])
        F, H = args.expert_dim, args.hidden_size
        for group, want in ((names["w1"], (F, H)), (names["w3"], (F, H)), (names["w2"], (H, F))):
            odd = [n for n in group if tuple(t[n].shape) != want]  # one expert of another shape cannot be stacked
            if odd:
                raise CheckpointError(f"tensor {odd[0]} has shape {tuple(t[odd[0]].shape)}, where config.json "
                                      f"implies {want}; the checkpoint is corrupt, mixed or of another config")
        w13 = torch.stack([torch.cat([t[a], t[b]]) for a, b in zip(names["w1"], names["w3"])])
        w2 = torch.stack([t[n] for n in names["w2"]])
    return LayerExperts(w13, w2)


def all_layer_experts(ckpt: Checkpoint, args: ModelArgs) -> Iterator[LayerExperts]:
    """Each MoE layer's stacked experts in order."""
    for layer in range(args.num_moe_layers):
        yield layer_experts(ckpt, args, layer)


def stored_layer_parts(ckpt: Checkpoint, args: ModelArgs, layer: int, fmt_dtype: str | None) -> list | None:
    """MoE layer `layer`'s expert parts (w13, w2, then biases; stacked [E, ...]) as the checkpoint already
    stores them in the disk format `fmt_dtype` (GPT-OSS's MXFP4: quant.py's segments by role), so a conversion
    writes them as they are; None when the checkpoint holds them otherwise."""
    family = family_of(ckpt.config)
    if fmt_dtype == "mxfp4" and hasattr(family, "layer_experts_mxfp4"):
        return family.layer_experts_mxfp4(ckpt, args, args.moe_layers[layer])
    return None


def router_of(args: ModelArgs, weights: dict[str, torch.Tensor]) -> Router:
    """The model's Router; its bias [L, E] (a softmax router's logit bias, a sigmoid router's selection
    bias) from the MoE layers' dense weights ('layers.{i}.router_bias' in our names)."""
    bias = None
    if args.router_bias:
        bias = np.stack([weights[f"layers.{i}.router_bias"].float().cpu().numpy() for i in args.moe_layers])
    return Router(args.top_k, args.norm_topk_prob, args.router, args.n_group, args.topk_group,
                  args.routed_scaling_factor, bias)
