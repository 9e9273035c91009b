"""expertcache convert: write a checkpoint's experts into the disk store's aligned layout."""
from __future__ import annotations

from ..choices import BUILTIN_MODEL
from .options import add_format_arguments, add_model_argument, format_from_args, output_dir

HELP = "convert a checkpoint's experts into a disk store (one aligned blob per expert), as is or quantized"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    p.add_argument("--out", type=output_dir, default=None,
                   help="store folder (default: ~/.cache/expertcache/stores/...)")
    p.add_argument("--force", action="store_true",
                   help="convert again where the folder already holds this checkpoint's experts in this format")
    add_format_arguments(p, "--dtype", "stored format: fp16, bf16, fp32, int8/int4 with group-wise scales along "
                                       "the input dimension, or mxfp4 (an MXFP4 checkpoint's experts kept as they "
                                       "are) (default: the checkpoint's dtype)")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..engine.checkpoint import open_checkpoint
    from ..engine.stores import conversion_lock, convert_to_disk, current_store, format_store_dir
    from ..models import model_args
    ckpt = open_checkpoint(a.model or BUILTIN_MODEL)
    args = model_args(ckpt.config)
    fmt = format_from_args(a, a.dtype)
    out = a.out or format_store_dir(ckpt, fmt)
    flags = ([f"--store-dir {out}"] if a.out is not None else []) + ([f"--store-dtype {fmt.flags}"] if fmt else [])
    use = f" (a run reads it with {' '.join(flags)})" if flags else ""
    with conversion_lock(out):  # not while a run converts the same folder
        if not a.force and current_store(ckpt, args, out, fmt):  # a real model's conversion takes minutes
            print(f"{out} already holds these experts ({fmt.tag if fmt else 'checkpoint dtype'}), converted from the "
                  f"weight files as they are{use}; nothing written (--force converts them again)")
            return 0
        convert_to_disk(ckpt, args, out, fmt=fmt, progress=True)
    size = (out / "experts.bin").stat().st_size
    per = size // (args.num_moe_layers * args.num_experts)
    print(f"wrote {args.num_moe_layers} x {args.num_experts} experts ({fmt.tag if fmt else 'checkpoint dtype'}, "
          f"{per} bytes each), {size / 2**20:.1f} MiB, to {out}{use}")
    return 0
