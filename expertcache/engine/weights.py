"""Translate a family's checkpoint tensors into our layout: dense weights and stacked experts."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..errors import CheckpointError
from ..models import family_of
from ..kernel.routing import Router
from ..models.args import ModelArgs
from .checkpoint import Checkpoint


def dense_weights(ckpt: Checkpoint, args: ModelArgs, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every non-expert tensor under our names ('layers.{i}.wq', 'embed', ...), as `dtype`."""
    family = family_of(ckpt.config)
    wanted = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not args.tie_word_embeddings:
        wanted["lm_head"] = "lm_head.weight"
    for i in range(args.num_layers):
        for ours, theirs in family.layer_names(i, args).items():
            if ours != "experts":
                wanted[f"layers.{i}.{ours}"] = theirs
    loaded = ckpt.tensors(list(wanted.values()))
    out = {ours: loaded[theirs].to(dtype) for ours, theirs in wanted.items()}
    _check_shapes(out, args)
    return out


def _check_shapes(w: dict[str, torch.Tensor], a: ModelArgs) -> None:
    first = a.first_dense_layers
    expect = {"embed": (a.vocab_size, a.hidden_size), f"layers.{first}.router": (a.num_experts, a.hidden_size)}
    if a.attention == "gqa":
        expect["layers.0.wq"] = (a.num_heads * a.head_dim, a.hidden_size)
    for name, shape in expect.items():
        if tuple(w[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(w[name].shape)}, config.json implies {shape}; "
                                  "the config does not belong to these weights")


def layer_experts(ckpt: Checkpoint, args: ModelArgs, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE layer `layer`'s experts stacked: w13 [E, 2F, H] (gate rows then up rows), w2 [E, H, F]."""
    names = family_of(ckpt.config).layer_names(args.moe_layers[layer], args)["experts"]
    fused = names["w1"][0].rsplit(".experts.", 1)[0] + ".experts."
    if fused + "gate_up_proj" in ckpt.files:  # checkpoints that store experts fused
        t = ckpt.tensors([fused + "gate_up_proj", fused + "down_proj"])
        w13, w2 = t[fused + "gate_up_proj"], t[fused + "down_proj"]
    else:
        t = ckpt.tensors(names["w1"] + names["w3"] + names["w2"])
        w13 = torch.stack([torch.cat([t[a], t[b]]) for a, b in zip(names["w1"], names["w3"])])
        w2 = torch.stack([t[n] for n in names["w2"]])
    E, F, H = args.num_experts, args.expert_dim, args.hidden_size
    if tuple(w13.shape) != (E, 2 * F, H) or tuple(w2.shape) != (E, H, F):
        raise CheckpointError(f"layer {layer} experts have shapes {tuple(w13.shape)}, {tuple(w2.shape)}; "
                              f"config.json implies {(E, 2 * F, H)}, {(E, H, F)}")
    return w13, w2


def all_layer_experts(ckpt: Checkpoint, args: ModelArgs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's stacked experts in order: w13 [E, 2F, H], w2 [E, H, F]."""
    for layer in range(args.num_moe_layers):
        yield layer_experts(ckpt, args, layer)


def router_of(args: ModelArgs, weights: dict[str, torch.Tensor]) -> Router:
    """The model's Router; a sigmoid router's selection bias [L, E] from the MoE layers' dense
    weights ('layers.{i}.router_bias' in our names)."""
    bias = None
    if args.router_bias:
        bias = np.stack([weights[f"layers.{i}.router_bias"].float().cpu().numpy() for i in args.moe_layers])
    return Router(args.top_k, args.norm_topk_prob, args.router, args.n_group, args.topk_group,
                  args.routed_scaling_factor, bias)
