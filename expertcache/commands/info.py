"""expertcache info: a model's shape, its experts' bytes and what fits in a budget."""
from __future__ import annotations

from ..engine.checkpoint import open_checkpoint
from ..engine.engine import BUILTIN_MODEL
from ..models import model_args
from .options import add_json_argument, add_model_argument, non_negative, positive_int, write_json

HELP = "describe a model: layers, experts, bytes, and how many experts fit in a budget"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    p.add_argument("--budget", type=non_negative, default=None, help="fast-tier budget in MiB for experts")
    p.add_argument("--dtype-bytes", type=positive_int, default=4, help="bytes per weight in the fast tier (fp32: 4)")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    ckpt = open_checkpoint(a.model or BUILTIN_MODEL)
    m = model_args(ckpt.config)
    expert = m.expert_params * a.dtype_bytes
    total = expert * m.num_experts * m.num_moe_layers
    info = {"path": str(ckpt.path), **m.to_dict(), "expert_params": m.expert_params,
            "expert_bytes": expert, "all_experts_bytes": total, "checkpoint_bytes": ckpt.weight_bytes}
    print(f"{m.family} at {ckpt.path}")
    print(f"  {m.num_layers} layers, {m.num_experts} experts per layer, top-{m.top_k}, hidden {m.hidden_size}, "
          f"expert width {m.expert_dim}")
    print(f"  one expert: {m.expert_params:,} weights = {expert / 2**10:.1f} KiB at {a.dtype_bytes} B/weight; "
          f"all experts: {total / 2**20:.1f} MiB")
    if a.budget is not None:
        per_layer = int(a.budget * 2**20 // expert // m.num_moe_layers)
        info["budget_slots_per_layer"] = per_layer
        fits = "enough" if per_layer >= m.top_k else f"too few (top-k is {m.top_k})"
        print(f"  {a.budget:g} MiB holds {per_layer} experts per layer "
              f"({min(per_layer, m.num_experts) / m.num_experts:.0%}): {fits}")
    write_json(a.json, info)
    return 0
