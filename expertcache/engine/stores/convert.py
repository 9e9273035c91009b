"""Writing a disk store: a checkpoint's experts as aligned blobs with their CRC32C, into a folder under
~/.cache keyed by the checkpoint's files, one process at a time."""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

import crc32c
import torch

from ...atomic import named_error
from ...errors import BadInput, NotEnoughDisk, size_text
from ...models.args import ModelArgs
from ...progress import progress_bar
from ..checkpoint import Checkpoint
from ..quant import ExpertFormat, encode
from ..weights import expert_dtype, expert_parts
from .base import ALIGN, DISK_FORMAT_VERSION, ExpertShape, blob_bytes

# Written bytes a conversion holds in the page cache at most: a layer of a real model's experts is a GiB or more
# (Qwen3-30B-A3B's in fp16: 1.1 GiB), past a budget that holds a quarter of them.
FLUSH_BYTES = 64 * 2**20


def default_store_dir(ckpt: Checkpoint) -> Path:
    """~/.cache/expertcache/<model>-<digest of its weight files>, so a changed checkpoint reconverts."""
    h = hashlib.sha1()
    for f in sorted(set(ckpt.files.values())):
        st = f.stat()
        h.update(os.fsencode(f.resolve()) + f":{st.st_size}:{st.st_mtime_ns}".encode())  # a path's own bytes: one
        # not UTF-8 is held as surrogates, which str.encode refused (the same digest as before for any other)
    return expertcache_home() / "stores" / f"{ckpt.path.resolve().name}-{h.hexdigest()[:12]}"


def expertcache_home() -> Path:
    """$EXPERTCACHE_HOME, its ~ expanded (quoted, EXPERTCACHE_HOME='~/x' made a folder named ~ where it ran), else
    ~/.cache/expertcache; set but empty (EXPERTCACHE_HOME=$UNSET) is unset, as XDG_CACHE_HOME is."""
    home = os.environ.get("EXPERTCACHE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "expertcache"


def checkpoint_stamp(ckpt: Checkpoint) -> dict[str, list[int]]:
    """Each weight file's size and modification time, by name: what a store records of the checkpoint it was
    converted from, so that a store of the checkpoint as it was before an edit is not used with it."""
    return {f.name: [st.st_size, st.st_mtime_ns] for f in sorted(set(ckpt.files.values())) for st in [f.stat()]}


def format_store_dir(ckpt: Checkpoint, fmt: ExpertFormat | None) -> Path:
    """The default folder of a store in `fmt`: `default_store_dir`, suffixed by the format's tag
    unless it is None (the checkpoint's own dtype)."""
    base = default_store_dir(ckpt)
    return base if fmt is None else base.with_name(f"{base.name}-{fmt.tag}")


def make_store_dir(store_dir: Path) -> None:
    """The store's folder made where missing; BadInput naming the folder where it cannot be (a file on its path,
    no permission): the Python API's road has no command line to word an OSError."""
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot make the store folder {store_dir} ({e.strerror}); give a folder that can be written "
                       "(--store-dir or --out; store_dir in Python), or set EXPERTCACHE_HOME") from None


@contextmanager
def conversion_lock(store_dir: Path):
    """Held while a store folder is converted: two processes that start on a fresh machine at once (a server and
    a generate) would otherwise write the same file together, and the second find it renamed away."""
    make_store_dir(store_dir)
    with open(store_dir / ".convert.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a real model's conversion takes minutes: a wait without a word read as a hang
            print(f"waiting for another process converting into {store_dir}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def current_store(ckpt: Checkpoint, args: ModelArgs, out_dir: Path, fmt: ExpertFormat | None = None) -> bool:
    """Whether `out_dir` holds what convert_to_disk would write there now: a header of this format version, in `fmt`
    (None: the checkpoint's dtype) and the model's shape, converted from its weight files as they are (sizes and
    times), over an experts.bin of the size that makes. The blobs are not read: their checksums catch damage."""
    try:
        meta = json.loads((out_dir / "experts.json").read_text())
        size = (out_dir / "experts.bin").stat().st_size
    except (OSError, ValueError):
        return False
    want, shape = fmt or ExpertFormat.of_dtype(expert_dtype(ckpt, args)), ExpertShape.of(args)
    return isinstance(meta, dict) and meta.get("format_version") == DISK_FORMAT_VERSION and \
        all(meta.get(k) == v for k, v in want.meta().items()) and meta.get("checkpoint") == checkpoint_stamp(ckpt) and \
        (meta.get("num_layers"), meta.get("num_experts")) == (shape.num_layers, shape.num_experts) and \
        size == shape.num_layers * shape.num_experts * blob_bytes(shape, want)


def convert_to_disk(ckpt: Checkpoint, args: ModelArgs, out_dir: Path, dtype: torch.dtype | None = None,
                    fmt: ExpertFormat | None = None, progress: bool | None = None) -> Path:
    """Write experts.bin (aligned blobs in (layer, expert) order) and experts.json (shapes, the
    format and a CRC32C per encoded blob); returns out_dir. The experts are stored in `fmt`, else
    as `dtype`, else in the checkpoint's dtype; a checkpoint already in `fmt` (GPT-OSS's MXFP4) is
    written as it is, not requantised. `progress`: a bar of layers on stderr (None: where stderr is a
    terminal, as a model's first run converts it)."""
    shape = ExpertShape.of(args)
    make_store_dir(out_dir)
    outdated = outdated_stores(ckpt, out_dir)
    tmp = out_dir / "experts.bin.partial"
    checksums, flushed = [], 0
    fmt = fmt or ExpertFormat.of_dtype(dtype if dtype is not None else expert_dtype(ckpt, args))
    blob = blob_bytes(shape, fmt)
    # checked before anything is removed, so that a refused conversion leaves an earlier store as it was; the files
    # this one replaces (an earlier store, a partial file a killed conversion left) are space it gets back
    need, earlier, partial = shape.num_layers * shape.num_experts * blob, _file_bytes(out_dir / "experts.bin"), \
        _file_bytes(tmp)
    _check_space(out_dir, need, earlier + partial + sum(outdated.values()))
    if need > shutil.disk_usage(out_dir).free + earlier + partial:  # their space was counted: removed first (a
        # re-downloaded model on a disk holding one store failed every run), else once this one is written
        _remove_outdated(ckpt, outdated)
        outdated = {}
    # an earlier store in this folder is kept whole until the new one is written, so that an interrupted conversion
    # leaves it usable; where the disk cannot hold both it goes first (its space, counted above)
    keep = need <= shutil.disk_usage(out_dir).free + partial
    if not keep:
        (out_dir / "experts.json").unlink(missing_ok=True)  # no header may describe a half-written file
        (out_dir / "experts.bin").unlink(missing_ok=True)  # a reader keeps its open file
    replaced = not keep  # whether experts.bin is this conversion's (removed again if it fails before its header)
    try:
        bar_args = dict(total=args.num_moe_layers, unit="layer", desc=f"convert to {out_dir.name}")
        with progress_bar(progress, **bar_args) as bar, open(tmp, "wb") as f:
            for layer in range(args.num_moe_layers):
                for e in range(args.num_experts):  # one expert at a time: a conversion holds one, not a layer
                    # w13, w2 (and b13, b2): the blob's order; as stored when the checkpoint is in `fmt` already
                    parts = expert_parts(ckpt, args, layer, e, mxfp4=fmt.mx)
                    data = encode(parts, shape.parts, fmt, blob)
                    checksums.append(crc32c.crc32c(data))  # of the stored bytes: the same check for every format
                    f.write(data)
                    if f.tell() - flushed >= FLUSH_BYTES:
                        flushed = _written(f, flushed)
                bar.update()
            _written(f, flushed)
        (out_dir / "experts.json").unlink(missing_ok=True)  # the earlier header, from here on the wrong one
        replaced = True
        os.replace(tmp, out_dir / "experts.bin")
        meta = {"format_version": DISK_FORMAT_VERSION, **fmt.meta(),
                "num_layers": shape.num_layers, "num_experts": shape.num_experts, "w13": list(shape.w13),
                "w2": list(shape.w2), "bias": shape.bias, "blob_bytes": blob, "align": ALIGN,
                "checksum": "crc32c", "checksums": checksums, "checkpoint": checkpoint_stamp(ckpt),
                "source": str(ckpt.path.resolve())}
        with open(out_dir / "experts.json.partial", "w") as f:
            f.write(json.dumps(meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(out_dir / "experts.json.partial", out_dir / "experts.json")
    except BaseException as e:  # a full disk, an interrupt: no partial file is left to fill the disk, nor a whole
        # experts.bin without the header that makes it a store (tens of GB that no run would use or remove)
        for name in (tmp.name, "experts.json.partial") + (("experts.bin",) if replaced else ()):
            (out_dir / name).unlink(missing_ok=True)
        if (named := named_error(e, out_dir, tmp)) is not None:  # a full disk's names no file: the store's folder
            raise named from e
        raise
    _fsync_folder(out_dir)  # the two renames too: a power loss after a conversion of hours keeps the store
    _remove_outdated(ckpt, outdated)
    return out_dir


def _remove_outdated(ckpt: Checkpoint, outdated: dict[Path, int]) -> None:
    """Remove `outdated_stores`' folders, naming each."""
    for folder, size in outdated.items():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"removed {folder} ({size_text(size)}), a store of {ckpt.path.resolve()}'s weight files as they were "
              "before", file=sys.stderr)


def outdated_stores(ckpt: Checkpoint, out_dir: Path) -> dict[Path, int]:
    """Where `out_dir` is one of the default folders, the default folders of this checkpoint's weight files as they
    were before (edited, downloaded again: each converted into a folder of its own, in every format) and their
    bytes: a conversion removes them once it has written its own, or before where it needs their space (a real
    model's store is tens of GB, and none of them would be read again; a run still reading one keeps its open
    file). Stores that do not record their
    checkpoint's folder (written by earlier versions) are left."""
    source, base = ckpt.path.resolve(), default_store_dir(ckpt)
    default = re.compile(rf"{re.escape(source.name)}-[0-9a-f]{{12}}(-.+)?")  # default_store_dir's, format_store_dir's
    if out_dir.resolve().parent != base.parent.resolve() or not (out_dir.name == base.name or
                                                                  out_dir.name.startswith(f"{base.name}-")):
        return {}  # a folder of the user's (--out, --store-dir): nothing else is touched
    stamp, out = checkpoint_stamp(ckpt), {}
    for folder in sorted(base.parent.glob(f"{glob.escape(source.name)}-*")):
        if folder.resolve() == out_dir.resolve() or not default.fullmatch(folder.name):  # a folder the user named
            continue
        try:
            meta = json.loads((folder / "experts.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("source") == str(source) and meta.get("checkpoint") != stamp:
            out[folder] = sum(_file_bytes(f) for f in folder.iterdir())
    return out


def blob_checksum(ckpt: Checkpoint, args: ModelArgs, layer: int, expert: int, fmt: ExpertFormat) -> int:
    """The CRC32C that `convert_to_disk` records for expert (layer, expert) of `ckpt` in `fmt`: its blob encoded
    again from the checkpoint, so that a store can be matched to the weights it is used with."""
    shape = ExpertShape.of(args)
    parts = expert_parts(ckpt, args, layer, expert, mxfp4=fmt.mx)
    return crc32c.crc32c(encode(parts, shape.parts, fmt, blob_bytes(shape, fmt)))


def _check_space(out_dir: Path, need: int, reclaimed: int = 0) -> None:
    """NotEnoughDisk unless the folder's filesystem has `need` bytes free, counting `reclaimed` bytes of files the
    conversion removes or overwrites (a store of a real model is tens of GB, and a conversion that ran out of space
    would fail near its end)."""
    free = shutil.disk_usage(out_dir).free + reclaimed
    if need > free:
        raise NotEnoughDisk(f"the disk store needs {size_text(need)} and {out_dir} has {size_text(free)} free; free "
                            "disk space or choose a folder on another disk (--store-dir or --out, or EXPERTCACHE_HOME)")


def _file_bytes(path: Path) -> int:
    """The disk space a regular file at `path` takes (0 for none, or for a link: removing it frees nothing)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0


def _fsync_folder(folder: Path) -> None:
    """Make the renames into `folder` durable (a file's fsync does not cover its name in the folder)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _written(f, start: int) -> int:
    """Flush what a conversion wrote since `start` to the disk and drop it from the page cache: the store's file
    would otherwise stay cached, charged to the process (and its memory cgroup) as it grows. Returns where the
    file ends now."""
    f.flush()
    os.fsync(f.fileno())
    end = f.tell()
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), start, end - start, os.POSIX_FADV_DONTNEED)
    return end


def store_format(store_dir: Path) -> int | None:
    """The format version recorded in a store's experts.json; None if there is no readable one."""
    try:
        return json.loads((store_dir / "experts.json").read_text()).get("format_version")
    except (OSError, ValueError, AttributeError):
        return None
