"""expertcache convert: write a checkpoint's experts into the disk store's aligned layout."""
from __future__ import annotations

from pathlib import Path

from ..engine.checkpoint import open_checkpoint
from ..engine.engine import BUILTIN_MODEL
from ..engine.stores import convert_to_disk, default_store_dir
from ..models import model_args
from .options import add_model_argument

HELP = "convert a checkpoint's experts into a disk store (one aligned blob per expert)"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    p.add_argument("--out", type=Path, default=None, help="store folder (default: ~/.cache/expertcache/stores/...)")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    ckpt = open_checkpoint(a.model or BUILTIN_MODEL)
    args = model_args(ckpt.config)
    out = convert_to_disk(ckpt, args, a.out or default_store_dir(ckpt))
    size = (out / "experts.bin").stat().st_size
    print(f"wrote {args.num_moe_layers} x {args.num_experts} experts, {size / 2**20:.1f} MiB, to {out}")
    return 0
