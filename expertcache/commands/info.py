"""expertcache info: a model's shape, its experts' bytes and what fits in a budget; with
--config, a real checkpoint sized from its config.json alone, before anyone downloads it."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..choices import BUILTIN_MODEL, SLOT_DTYPES
from ..errors import BadInput, CheckpointError
from .options import (
    add_json_argument,
    add_model_argument,
    byte_size,
    non_negative,
    positive_int,
    write_json,
)

HELP = "describe a model: layers, experts, bytes, and how many experts fit in a budget"

# bits per weight of an expert in each slow-tier format (group-wise formats: group 32 with an
# fp16 scale and minimum per group; MXFP4: 4-bit values with an 8-bit scale per 32)
FORMAT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "int8": 8.0 + 32 / 32, "int4": 4.0 + 32 / 32, "mxfp4": 4.25}
BUDGETS_GB = (8, 16, 24)
CONTEXT = 4096  # tokens of KV cache reserved when sizing what fits
PLAIN_MIB_MAX = 2**24  # 16 TiB: a plain number above it is bytes given without a unit, not a fast tier's MiB


def budget_mib(text: str) -> float:
    """An argparse type: MiB, as a plain number (e.g. 512) or a size with a unit like every other size flag
    (e.g. 16G, 64M)."""
    try:
        mib = non_negative(text)
    except argparse.ArgumentTypeError:
        if text.strip()[-1:].isdigit():
            raise
        return byte_size(text) / 2**20
    if mib > PLAIN_MIB_MAX:  # read as MiB it would be petabytes: everything would fit, silently
        raise argparse.ArgumentTypeError(f"{text!r} MiB is {mib / 2**30:.1f} PiB; a plain number is MiB here: "
                                         f"for bytes add B ({text.strip()}B), or give a size such as 16G")
    return mib


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    p.add_argument("--config", type=Path, default=None,
                   help="a config.json alone (or the folder holding it): size that checkpoint (needs transformers to "
                        "count dense weights)")
    p.add_argument("--budget", type=budget_mib, default=None,
                   help="fast-tier bytes for experts: a size such as 16G or 512M, or a plain number of MiB")
    p.add_argument("--slot-dtype", default="auto", choices=SLOT_DTYPES,
                   help="the experts' format in the fast tier, as the engine's option: auto (the checkpoint's fp16 "
                        "or bf16, else fp32; with --config, fp16), fp32, fp16, bf16, int8, int4 (group 32, asym), "
                        "mxfp4")
    p.add_argument("--dtype-bytes", type=positive_int, default=None,
                   help="bytes per weight in the fast tier (overrides --slot-dtype)")
    add_json_argument(p)


def parameter_counts(config: dict) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of the HF model a config describes, counted on
    the meta device: no memory, no download."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise BadInput("sizing from a config counts its tensors with transformers; pip install transformers") from None
    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name and "shared" not in name:
            experts += p.numel()
    return total, experts


def size_config(config: dict, budget_mib: float | None = None, slot: str = "fp16") -> dict:
    """Bytes of a checkpoint from its config: per expert in each format, dense weights (bf16),
    KV cache per token (fp16), how many experts per layer fit next to them in 8/16/24 GB, and in
    `budget_mib` MiB for experts alone when given, with experts in the fast tier as `slot`."""
    if slot not in FORMAT_BITS:
        raise BadInput(f"--slot-dtype {slot} cannot size a config alone; choose one of {', '.join(FORMAT_BITS)}")
    from ..models import model_args
    a = model_args(config)
    layers = getattr(a, "num_moe_layers", a.num_layers)
    total, expert_params = parameter_counts(config)
    if not expert_params:  # transformers built a dense model: its model_type is another family's
        raise BadInput(f"transformers builds this config (model_type {config.get('model_type')!r}) without routed "
                       "experts; give the MoE family's model_type (architectures says "
                       f"{(config.get('architectures') or ['none'])[0]!r})")
    per_expert = expert_params // (layers * a.num_experts)
    dense = total - expert_params
    attn = [i for i in range(a.num_layers) if getattr(a, "layer_type", lambda i: "full_attention")(i)
            != "linear_attention"]
    if a.attention == "mla":  # a latent and one rotary key per position, not keys and values per head
        kv_per_token = len(attn) * (a.kv_lora_rank + a.qk_rope_head_dim) * 2
    else:
        kv_per_token = 2 * len(attn) * a.num_kv_heads * a.head_dim * 2
    out = {"family": a.family, "moe_layers": layers, "experts": a.num_experts, "top_k": a.top_k,
           "params": total, "expert_params": per_expert, "dense_params": dense, "dense_bytes": 2 * dense,
           "kv_bytes_per_token": kv_per_token,
           "expert_bytes": {f: int(per_expert * bits / 8) for f, bits in FORMAT_BITS.items()}, "slot": slot,
           "fits": {}}
    for gb in BUDGETS_GB:
        left = gb * 2**30 - out["dense_bytes"] - CONTEXT * kv_per_token
        slots = max(0, left // out["expert_bytes"][slot]) // layers
        out["fits"][gb] = {"experts_per_layer": int(min(slots, a.num_experts)),
                           "fraction": min(slots, a.num_experts) / a.num_experts, "enough": slots >= a.top_k}
    if budget_mib is not None:
        slots = min(int(budget_mib * 2**20 // out["expert_bytes"][slot] // layers), a.num_experts)
        out["budget"] = {"mib": budget_mib, "experts_per_layer": slots, "fraction": slots / a.num_experts,
                         "enough": slots >= a.top_k}
    return out


def params_text(n: int) -> str:
    """A parameter count as model cards write it: 30.5B, or 12.3M for a small model (not 0.0B)."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _print_config(path: Path, s: dict) -> None:
    print(f"{s['family']} from {path}: {params_text(s['params'])} parameters, {s['moe_layers']} MoE layers x "
          f"{s['experts']} experts, top-{s['top_k']}")
    print("  one expert: " + ", ".join(f"{f} {b / 2**20:.2f} MiB" for f, b in s["expert_bytes"].items()))
    print(f"  dense weights (bf16): {s['dense_bytes'] / 2**30:.2f} GiB; KV cache: "
          f"{s['kv_bytes_per_token'] / 2**10:.0f} KiB per token (fp16)")
    def verdict(f: dict) -> str:
        return f"{f['experts_per_layer']} experts per layer ({f['fraction']:.0%})" if f["enough"] else \
            f"not enough for top-{s['top_k']}"
    for gb, f in s["fits"].items():
        print(f"  {gb} GiB fast tier ({s['slot']} experts, {CONTEXT}-token KV cache): {verdict(f)}")
    if "budget" in s:
        mib = s["budget"]["mib"]
        size = f"{mib / 1024:g} GiB" if mib >= 1024 else f"{mib:g} MiB"
        print(f"  {size} for {s['slot']} experts alone: {verdict(s['budget'])}")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    if a.config is not None and a.model is not None:
        raise BadInput("--config sizes a checkpoint from its config alone and --model a checkpoint on disk; give one")
    if a.config is not None:
        if a.config.is_dir():  # a downloaded folder of configs, or a checkpoint's: its config.json
            a.config = a.config / "config.json"
            if not a.config.exists():
                raise CheckpointError(f"{a.config.parent} holds no config.json; give a model's config.json")
        try:
            config = json.loads(a.config.read_text())
        except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
            raise CheckpointError(f"{a.config} is not valid JSON ({e}); give a model's config.json") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{a.config} is a JSON {type(config).__name__}, not an object; give a model's "
                                  "config.json")
        slot = "fp16" if a.slot_dtype == "auto" else a.slot_dtype
        if a.dtype_bytes is not None:
            raise BadInput("--dtype-bytes sizes a loaded model; with --config give --slot-dtype instead")
        s = size_config(config, a.budget, slot)
        _print_config(a.config, s)
        write_json(a.json, s)
        return 0
    import torch

    from ..engine.slots import slot_bytes, slot_format
    from ..engine.checkpoint import open_checkpoint
    from ..engine.quant import ExpertFormat
    from ..engine.stores import ExpertShape
    from ..engine.weights import check_config_fits_weights, layer_experts
    from ..models import model_args
    ckpt = open_checkpoint(a.model or BUILTIN_MODEL)
    m = model_args(ckpt.config)
    check_config_fits_weights(ckpt, m)
    if a.dtype_bytes is not None:
        expert, per_weight = m.expert_params * a.dtype_bytes, f"{a.dtype_bytes} B/weight"
    else:
        stored = ExpertFormat.parse(a.slot_dtype) if a.slot_dtype in ("int8", "int4", "mxfp4") else \
            ExpertFormat.of_dtype(layer_experts(ckpt, m, 0).w13.dtype)
        fmt = slot_format(a.slot_dtype, torch.device("cpu"), stored)
        expert, per_weight = slot_bytes(ExpertShape.of(m), fmt), f"{fmt.tag} slots"
    total = expert * m.num_experts * m.num_moe_layers
    info = {"path": str(ckpt.path), **m.to_dict(), "moe_layers": m.num_moe_layers, "expert_params": m.expert_params,
            "expert_bytes": expert, "slot": per_weight, "all_experts_bytes": total,
            "checkpoint_bytes": ckpt.weight_bytes}
    print(f"{m.family} at {ckpt.path}")
    dense = m.num_layers - m.num_moe_layers
    print(f"  {m.num_layers} layers ({m.num_moe_layers} MoE" + (f", {dense} dense)" if dense else ")") +
          f", {m.num_experts} experts per MoE layer, top-{m.top_k}, hidden {m.hidden_size}, "
          f"expert width {m.expert_dim}")
    print(f"  one expert: {m.expert_params:,} weights = {expert / 2**10:.1f} KiB in {per_weight}; "
          f"all experts: {total / 2**20:.1f} MiB")
    if a.budget is not None:
        per_layer = min(int(a.budget * 2**20 // expert // m.num_moe_layers), m.num_experts)  # a layer has no more
        info["budget_slots_per_layer"] = per_layer
        # the line's figures, as --config's JSON keeps them
        info["budget"] = {"mib": a.budget, "experts_per_layer": per_layer, "fraction": per_layer / m.num_experts,
                          "enough": per_layer >= m.top_k}
        fits = "enough" if per_layer >= m.top_k else f"too few (top-k is {m.top_k})"
        every = " (every expert)" if per_layer == m.num_experts else ""
        print(f"  {a.budget:g} MiB holds {per_layer} experts per MoE layer{every} "
              f"({per_layer / m.num_experts:.0%}): {fits}")
    write_json(a.json, info)
    return 0
