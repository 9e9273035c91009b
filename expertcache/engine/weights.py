"""Translate a family's checkpoint tensors into our layout: dense weights and stacked experts."""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from ..errors import CheckpointError
from ..kernel.routing import Router
from ..models import family_of
from ..models.args import LayerExperts, ModelArgs
from .checkpoint import CONFIG_DTYPES, Checkpoint

# the dense matrices a family may have, in our names (after Transformer joins q, k, v and gate, up): held in
# their own dtype (or quantized) and run as engine.linear.Linear; every other dense tensor (norms, biases, a
# linear attention's conv and decay parameters) is a vector in the compute dtype
MATRICES = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "lin_qkvz", "lin_ba", "lin_out", "shared_w1",
            "shared_w3", "shared_w2", "shared_gate", "dense_w1", "dense_w3", "dense_w2", "router")
VOCAB = ("embed", "lm_head")  # the largest dense tensors, read whole for every decoded token's logits


def is_matrix(name: str) -> bool:
    """Whether dense tensor `name` ('layers.{i}.wq', 'embed', ...) is one of the matrices (see MATRICES)."""
    return name in VOCAB or name.rsplit(".", 1)[-1] in MATRICES


def dense_names(ckpt: Checkpoint, args: ModelArgs) -> dict[str, str]:
    """Our name -> checkpoint name of every non-expert tensor."""
    family = family_of(ckpt.config)
    # tied, with only the output matrix saved: HF ties the embeddings to it, where it was refused as missing them
    head_only = args.tie_word_embeddings and "model.embed_tokens.weight" not in ckpt.files \
        and "lm_head.weight" in ckpt.files
    wanted = {"embed": "lm_head.weight" if head_only else "model.embed_tokens.weight", "norm": "model.norm.weight"}
    # a saved output matrix is used even where config.json ties it, as HF transformers 5 unties one that differs
    if not args.tie_word_embeddings or ("lm_head.weight" in ckpt.files and not head_only):
        wanted["lm_head"] = "lm_head.weight"
    for i in range(args.num_layers):
        for ours, theirs in family.layer_names(i, args).items():
            if ours != "experts":
                wanted[f"layers.{i}.{ours}"] = theirs
    return wanted


def expert_dtype(ckpt: Checkpoint, args: ModelArgs) -> torch.dtype:
    """The float dtype the checkpoint's experts read as (fp8 and MXFP4 ones dequantised), from its headers."""
    decoder = args.moe_layers[0]
    p = f"model.layers.{decoder}.mlp.experts."
    if p + "gate_up_proj_blocks" in ckpt.files:  # GPT-OSS's MXFP4: decoded to fp32
        return torch.float32
    names = family_of(ckpt.config).layer_names(decoder, args).get("experts")
    name = p + "gate_up_proj" if p + "gate_up_proj" in ckpt.files or names is None else names["w1"][0]
    dtype = ckpt.info(name).dtype
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return CONFIG_DTYPES.get(ckpt.config.get("dtype") or ckpt.config.get("torch_dtype"), torch.bfloat16)
    if dtype == torch.float64:  # a model saved after .double(): fp32, the widest format a store holds, in which the
        return torch.float32  # engine computes (the disk store and convert failed on it with a KeyError)
    return dtype


def dense_weights(ckpt: Checkpoint, args: ModelArgs, dtype=torch.float32,
                  matrix_dtype: torch.dtype | None = None) -> DenseWeights:
    """Every non-expert tensor under our names ('layers.{i}.wq', 'embed', ...): vectors (norms, biases, ...) as
    `dtype`; the matrices (`is_matrix`) as `matrix_dtype`, or None: as the checkpoint stores them (fp16 or bf16
    kept: exact in fp32 arithmetic, half the bytes to read per token; fp32 otherwise). Each is read when asked for
    (DenseWeights)."""
    return DenseWeights(ckpt, args, dtype, matrix_dtype)


class DenseWeights(Mapping):
    """dense_weights' tensors, each read from the checkpoint (converted, adapted to our conventions, its shape
    checked) when asked for, and not kept: a consumer that converts them in turn (Transformer, into int8 or int4)
    holds one of them at a time beside what it made. Read all at once, the real-shape checkpoint's 294 MB of bf16
    stood beside their 118 MB of int4 while loading, 125 MiB past a memory budget of a tenth of its experts."""

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype: torch.dtype, matrix_dtype: torch.dtype | None):
        self.ckpt, self.args, self.dtype, self.matrix_dtype = ckpt, args, dtype, matrix_dtype
        self.family = family_of(ckpt.config)
        self.names = dense_names(ckpt, args)
        for theirs in self.names.values():  # before any is read, as reading them all at once refused it
            if theirs not in ckpt.files:
                raise CheckpointError(f"{ckpt.path}: tensor {theirs!r} is missing; re-export the checkpoint")

    def __getitem__(self, ours: str) -> torch.Tensor:
        theirs = self.names[ours]
        t = self.ckpt.tensors([theirs])[theirs]
        if not is_matrix(ours):
            t = t.to(self.dtype)
        elif self.matrix_dtype is not None:
            t = t.to(self.matrix_dtype)
        elif t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            t = t.float()
        if hasattr(self.family, "adapt_dense"):  # a family's own conventions, e.g. RMSNorm weights stored as w - 1
            t = self.family.adapt_dense({ours: t}, self.args)[ours]
        _check_shapes({ours: t}, self.args, self.names)
        return t

    def __contains__(self, ours: object) -> bool:  # without reading the tensor, as Mapping's would
        return ours in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def dense_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for each dense tensor, by our name's last part ('wq', 'router', ...); the
    top-level 'embed', 'lm_head' and 'norm' too."""
    H, nh, nkv, hd = a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
    q = (2 if a.attention_gate else 1) * nh * hd  # a gated attention's q_proj also yields the gate
    heads = {"head": (hd, hd), "full": (nh * hd, nkv * hd)}.get(a.qk_norm, (hd, hd))
    S, D, E = a.shared_expert_dim, a.dense_dim, a.num_experts
    out = {"embed": (a.vocab_size, H), "lm_head": (a.vocab_size, H), "norm": (H,), "attn_norm": (H,),
           "moe_norm": (H,), "router": (E, H), "router_bias": (E,), "shared_w1": (S, H), "shared_w3": (S, H),
           "shared_w2": (H, S), "shared_gate": (1, H), "dense_w1": (D, H), "dense_w3": (D, H), "dense_w2": (H, D),
           "sinks": (nh,), "q_norm": (heads[0],), "k_norm": (heads[1],)}
    if a.attention == "gqa":
        out |= {"wq": (q, H), "wk": (nkv * hd, H), "wv": (nkv * hd, H), "wo": (H, nh * hd), "bq": (q,),
                "bk": (nkv * hd,), "bv": (nkv * hd,), "bo": (H,)}
    else:  # mla: the latent's and the heads' dimensions
        nope, rope, vd, rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        out |= {"wkv_a": (rank + rope, H), "kv_a_norm": (rank,), "wkv_b": (nh * (nope + vd), rank),
                "wo": (H, nh * vd), "wq_a": (a.q_lora_rank, H), "q_a_norm": (a.q_lora_rank,),
                "wq_b": (nh * (nope + rope), a.q_lora_rank), "wq": (nh * (nope + rope), H)}
    if "linear_attention" in a.layer_types:  # Gated DeltaNet: keys and values of their own head counts and sizes
        nk, nv = a.linear_num_key_heads, a.linear_num_value_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        out |= {"lin_qkvz": (2 * nk * dk + 2 * nv * dv, H), "lin_ba": (2 * nv, H),
                "lin_conv": (2 * nk * dk + nv * dv, a.linear_conv_kernel), "lin_dt_bias": (nv,), "lin_A_log": (nv,),
                "lin_norm": (dv,), "lin_out": (H, nv * dv)}
    return out


def _check_shapes(w: dict[str, torch.Tensor], a: ModelArgs, names: dict[str, str]) -> None:
    # every layer's, not only the first's: a tensor of another shape in a later layer crashed inside the first
    # forward, or (a router of more experts) read past its buffers in the compiled kernels
    expect = dense_shapes(a)
    for name, t in w.items():
        want = expect.get(name.rsplit(".", 1)[-1])
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(f"tensor {names.get(name, name)} has shape {tuple(t.shape)}, config.json implies "
                                  f"{want}; the config does not belong to these weights")


def check_config_fits_weights(ckpt: Checkpoint, args: ModelArgs) -> None:
    """CheckpointError where the weights hold more decoder layers than config.json gives, or a MoE layer's router,
    from its header, does not route its number of experts over its hidden size: a config of another model read as
    this one was blamed on the files beside it (routing counts, predictors) or, read alone (`info`), reported as
    it says."""
    names, want = dense_names(ckpt, args), dense_shapes(args)["router"]
    # layers past the config's (less the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 ship after theirs)
    # were left unread: a config cut to fewer layers ran a shallower model in silence
    mtp = ckpt.config.get("num_nextn_predict_layers") or 0
    named = [int(m.group(1)) for n in ckpt.files if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    if named and max(named) >= args.num_layers + (mtp if isinstance(mtp, int) else 0):
        raise CheckpointError(f"the weights hold decoder layers up to {max(named)}, config.json gives "
                              f"num_hidden_layers {args.num_layers}; the config does not belong to these weights: "
                              "restore it from the model's release")
    for decoder in args.moe_layers:
        name = names.get(f"layers.{decoder}.router")
        if name is None or name not in ckpt.files:
            continue  # a family's own storage: its loading checks it
        shape = tuple(ckpt.info(name).shape)
        if shape != want:
            raise CheckpointError(f"tensor {name} has shape {shape}, config.json implies {want} ({args.num_experts} "
                                  f"experts over hidden size {args.hidden_size}); the config does not belong to these "
                                  "weights")


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


def _fused(ckpt: Checkpoint, names: dict) -> tuple[str, str] | None:
    """The names of a layer's fused stacks (gate_up_proj [E, 2F, H], down_proj [E, H, F]) where the checkpoint
    stores its experts so; None where it stores one tensor an expert and projection (`names`)."""
    prefix = names["w1"][0].rsplit(".experts.", 1)[0] + ".experts."
    return (prefix + "gate_up_proj", prefix + "down_proj") if prefix + "gate_up_proj" in ckpt.files else None


def _standard_layer_experts(ckpt: Checkpoint, args: ModelArgs, layer: int, names: dict) -> LayerExperts:
    fused = _fused(ckpt, names)
    if fused is not None:
        t = ckpt.tensors(list(fused))
        w13, w2 = (t[n] for n in fused)
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


def expert_tensor_names(ckpt: Checkpoint, args: ModelArgs, layer: int) -> list[str]:
    """The checkpoint's tensors that hold MoE layer `layer`'s experts."""
    family = family_of(ckpt.config)
    decoder = args.moe_layers[layer]
    if hasattr(family, "expert_tensor_names"):  # a family's own storage
        return family.expert_tensor_names(ckpt, args, decoder)
    names = family.layer_names(decoder, args)["experts"]
    fused = _fused(ckpt, names)
    return list(fused) if fused is not None else names["w1"] + names["w3"] + names["w2"]


def check_expert_tensors(ckpt: Checkpoint, args: ModelArgs) -> None:
    """CheckpointError naming the first expert tensor the checkpoint lacks, from its headers alone: a store that
    reads the experts on first use would otherwise find it at the first fetch, a server at its first request."""
    for layer in range(args.num_moe_layers):
        for name in expert_tensor_names(ckpt, args, layer):
            ckpt.info(name)


def all_layer_experts(ckpt: Checkpoint, args: ModelArgs) -> Iterator[LayerExperts]:
    """Each MoE layer's stacked experts in order."""
    for layer in range(args.num_moe_layers):
        yield layer_experts(ckpt, args, layer)


def expert_parts(ckpt: Checkpoint, args: ModelArgs, layer: int, expert: int, mxfp4: bool = False) -> list:
    """One expert of MoE layer `layer`, read alone (a conversion's memory is then one expert's, not a layer's):
    [w13 [2F, H], w2 [H, F]] (and b13 [2F], b2 [H]) as the checkpoint's float tensors, or with `mxfp4` and a
    checkpoint that holds them in MXFP4 its matrices as {"codes": [rows, cols / 2], "scales": [rows, blocks]}
    (quant.encode repacks them without requantising)."""
    family = family_of(ckpt.config)
    decoder = args.moe_layers[layer]
    if hasattr(family, "expert_parts"):  # a family's own storage (it has a layer_experts too)
        parts = family.expert_parts(ckpt, args, decoder, expert, mxfp4)
    else:
        names = family.layer_names(decoder, args)["experts"]
        fused = _fused(ckpt, names)
        if fused is not None:
            parts = [ckpt.tensor(n, expert) for n in fused]
        else:
            t = ckpt.tensors([names["w1"][expert], names["w3"][expert], names["w2"][expert]])
            w1, w3, w2 = (t[names[k][expert]] for k in ("w1", "w3", "w2"))
            F, H = args.expert_dim, args.hidden_size
            for name, w, want in ((names["w1"][expert], w1, (F, H)), (names["w3"][expert], w3, (F, H)),
                                  (names["w2"][expert], w2, (H, F))):
                if tuple(w.shape) != want:
                    raise CheckpointError(f"tensor {name} has shape {tuple(w.shape)}, where config.json implies "
                                          f"{want}; the checkpoint is corrupt, mixed or of another config")
            parts = [torch.cat([w1, w3]), w2]
    F, H = args.expert_dim, args.hidden_size
    want = [(2 * F, H), (H, F)] + ([(2 * F,), (H,)] if args.expert_bias else [])
    got = [(p["codes"].shape[0], *w[1:]) if isinstance(p, dict) else tuple(p.shape) for p, w in zip(parts, want)]
    if len(parts) != len(want) or got != want:
        raise CheckpointError(f"layer {decoder} expert {expert} has parts of shapes {got}; config.json implies "
                              f"{want}: the config does not belong to these weights")
    return parts


def router_of(args: ModelArgs, weights: dict[str, torch.Tensor]) -> Router:
    """The model's Router; its bias [L, E] (a softmax router's logit bias, a sigmoid router's selection
    bias) from the MoE layers' dense weights ('layers.{i}.router_bias' in our names)."""
    bias = None
    if args.router_bias:
        bias = np.stack([weights[f"layers.{i}.router_bias"].float().cpu().numpy() for i in args.moe_layers])
    return Router(args.top_k, args.norm_topk_prob, args.router, args.n_group, args.topk_group,
                  args.routed_scaling_factor, bias)
