"""The slow tier: where every expert lives. One interface (base.py), three real places, a module each.

- `ram`: all experts in host memory in the compute dtype; exact and without latency
  (the store the emulation study uses).
- `disk`: one 4 KiB-aligned blob per (layer, expert) in a file written once by `convert` (as is, or
  in a quantized format of quant.py, dequantised on the worker thread),
  read with O_DIRECT so every fetch moves real bytes from the device, never the page cache
  (where O_DIRECT is refused: buffered reads that drop each blob from the page cache, a
  reported read mode), and checked against the blob's CRC32C recorded at convert time.
- `pinned`: all experts in page-locked host memory, copied to a CUDA device asynchronously.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...choices import BUILTIN_MODEL
from ...errors import CheckpointError, UnknownName
from ...models.args import ModelArgs
from ..checkpoint import Checkpoint
from ..quant import ExpertFormat
from .base import (ALIGN, DISK_FORMAT_VERSION, STORES, ExpertShape, ExpertStore, blob_bytes, check_store,
                   staging_bytes)
from .convert import (blob_checksum, checkpoint_stamp, conversion_lock, convert_to_disk, current_store,
                      default_store_dir, format_store_dir, store_format)
from .disk import F_NOCACHE, READ_MODES, DiskStore, open_blob_file
from .ram import PinnedStore, RamStore

__all__ = ["ALIGN", "DISK_FORMAT_VERSION", "F_NOCACHE", "READ_MODES", "STORES", "DiskStore", "ExpertShape",
           "ExpertStore", "PinnedStore", "RamStore", "blob_bytes", "check_store", "conversion_lock",
           "convert_to_disk", "current_store", "default_store_dir", "format_store_dir", "open_blob_file",
           "open_store", "staging_bytes", "store_format"]


def open_store(name: str, ckpt: Checkpoint, args: ModelArgs, store_dir: Path | None = None,
               dtype: torch.dtype = torch.float32, fmt: ExpertFormat | None = None, read_mode: str = "auto",
               verify: bool = True) -> ExpertStore:
    """The slow tier `name` of a checkpoint's experts; `fmt`: the format they are stored in (None:
    the checkpoint's dtype). A disk store missing from `store_dir` is converted first; the default
    folder (`format_store_dir`, under ~/.cache) is also reconverted when it was written in an older
    format version, or from other weights than the checkpoint's now (its first expert's checksum: a folder is named
    by its weight files' sizes and times, which a copy can keep); a store there in another format is refused."""
    check_store(name)
    store_dir = Path(store_dir) if store_dir is not None else None  # a str from the Python API, too
    if name == "ram":
        return RamStore(ckpt, args, dtype, fmt)
    if name == "pinned":
        if fmt is not None and fmt.quantized:
            raise UnknownName(f"store 'pinned' holds float experts; drop the {fmt.dtype} store dtype "
                              "or use --store disk")
        return PinnedStore(ckpt, args, dtype)
    if name == "disk":
        given = store_dir is not None  # a folder of the user's may hold any checkpoint's experts: matched below
        if store_dir is None:
            store_dir = format_store_dir(ckpt, fmt)
            stale = lambda: store_format(store_dir) != DISK_FORMAT_VERSION  # noqa: E731
        else:
            stale = lambda: not (store_dir / "experts.json").exists()  # noqa: E731
        if stale():
            with conversion_lock(store_dir):
                if stale():  # another process may have converted it while this one waited
                    convert_to_disk(ckpt, args, store_dir, fmt=fmt)
        store = DiskStore(store_dir, args, read_mode, verify)
        if fmt is not None and store.format != fmt:
            store.close()
            raise CheckpointError(f"{store_dir} holds experts as {store.format.tag}, not {fmt.tag}; convert to "
                                  f"another folder (`{convert_command(ckpt, fmt, 'DIR')}`), or leave out "
                                  "--store-dtype to run it as it is stored")
        # its first expert encoded again from the checkpoint: a store of other weights than these
        matches = lambda s: blob_checksum(ckpt, args, 0, 0, s.format) == s.checksums[0]  # noqa: E731
        if not matches(store):
            store.close()
            if given:  # a store of another checkpoint of this shape: its experts with these dense weights
                raise CheckpointError(f"{store_dir} holds another checkpoint's experts (expert 0 of layer 0 differs "
                                      f"from {ckpt.path}'s); convert this model into another folder "
                                      f"(`{convert_command(ckpt, fmt, 'DIR')}`), or leave out --store-dir")
            # the default folder, of weights replaced with their sizes and times kept (cp -p, rsync -t): converted again
            with conversion_lock(store_dir):
                store = DiskStore(store_dir, args, read_mode, verify)
                if not matches(store):  # not already converted by another process while this one waited
                    store.close()
                    convert_to_disk(ckpt, args, store_dir, fmt=fmt)
                    store = DiskStore(store_dir, args, read_mode, verify)
        now, then = checkpoint_stamp(ckpt), store.checkpoint
        if given and then is not None and then != now:
            store.close()  # the checkpoint changed after the conversion: an edited expert past the first is not seen
            changed = next(n for n in sorted(now.keys() | then.keys()) if now.get(n) != then.get(n))
            raise CheckpointError(f"{store_dir} was converted from weight files whose sizes or times differ from "
                                  f"{ckpt.path}'s ({changed}): this checkpoint's before an edit, or another's; convert "
                                  f"this model into a folder of its own (`{convert_command(ckpt, store.format, 'DIR')}`"
                                  "), or leave out --store-dir")
        return store
    raise AssertionError(name)  # check_store knows no other


def convert_command(ckpt: Checkpoint, fmt: ExpertFormat | None, out) -> str:
    """The `expertcache convert` command that writes `ckpt`'s experts as `fmt` (None: as stored) into `out`, as an
    error names it: the model given unless it is the built-in one, which convert takes by default."""
    model = "" if Path(ckpt.path).resolve() == BUILTIN_MODEL.resolve() else f" --model {ckpt.path}"
    dtype = f" --dtype {fmt.flags}" if fmt is not None else ""
    return f"expertcache convert{model}{dtype} --out {out}"
