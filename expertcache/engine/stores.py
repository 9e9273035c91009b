"""The slow tier: where every expert lives. One interface, three real places.

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

import errno
import fcntl
import functools
import hashlib
import json
import math
import mmap
import os
import sys
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np
import torch

from ..errors import (
    BadInput,
    CheckpointError,
    FetchError,
    ReadModeUnsupported,
    UnknownName,
)
from ..kernel.decode_blob import NO_PART, decode_blob
from ..models.args import ModelArgs
from ..progress import progress_bar
from .checkpoint import Checkpoint
from .quant import (
    FLOAT_DTYPES,
    ExpertFormat,
    decode_into,
    decode_plan,
    encode,
    encoded_bytes,
    layout,
    roundtrip,
)
from .weights import all_layer_experts, expert_parts, layer_experts

ALIGN = 4096
DISK_FORMAT_VERSION = 3  # 2: a CRC32C per blob in experts.json; 3: quantized matrices in row blocks of 16 (quant.py)
F_NOCACHE = getattr(fcntl, "F_NOCACHE", 48 if sys.platform == "darwin" else None)  # macOS: no page cache
READ_MODES = ("auto", "direct", "buffered")  # auto: O_DIRECT where the platform and filesystem allow it


@dataclass(frozen=True)
class ExpertShape:
    """The shapes of one model's experts: MoE layers, experts per layer, w13 [2F, H], w2 [H, F],
    and whether each expert also holds biases."""
    num_layers: int
    num_experts: int
    w13: tuple[int, int]  # (2F, H)
    w2: tuple[int, int]  # (H, F)
    bias: bool = False  # each expert also holds b13 [2F] and b2 [H]

    @classmethod
    def of(cls, a: ModelArgs) -> "ExpertShape":
        """The expert shape of a model's arguments."""
        return cls(a.num_moe_layers, a.num_experts, (2 * a.expert_dim, a.hidden_size), (a.hidden_size, a.expert_dim),
                   a.expert_bias)

    @property
    def parts(self) -> list[tuple[int, ...]]:
        """The shapes one expert's blob holds, in order: w13, w2, then b13 and b2 if the family has biases."""
        return [self.w13, self.w2] + ([(self.w13[0],), (self.w2[0],)] if self.bias else [])

    @property
    def numel(self) -> int:
        """Elements of one expert, all parts together."""
        return sum(math.prod(p) for p in self.parts)


class ExpertStore(ABC):
    """Holds every (layer, expert); `read_into` copies one expert into fast-tier tensors."""

    name: str
    read_mode: str  # how fetches reach the slow tier, reported in RunStats
    inline = False  # True: a copy costs less than a hand-off to a worker, so transfers run in place
    pinned_host = False  # True: `host_parts` are page-locked, a CUDA copy needs no staging buffer

    def __init__(self, shape: ExpertShape, dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype

    @property
    def expert_bytes(self) -> int:
        """Bytes one fetch moves from the slow tier."""
        return self.shape.numel * self.dtype.itemsize

    @abstractmethod
    def read_into(self, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> int:
        """Copy expert (layer, expert) into w13 [2F, H] and w2 [H, F] (and b13 [2F], b2 [H] when the
        shape has biases); returns bytes moved. Safe to call from worker threads."""

    def read_encoded(self, layer: int, expert: int, dst: torch.Tensor) -> int:
        """Copy expert (layer, expert)'s encoded blob as it is stored, unpadded, into dst (uint8):
        the fill of a quantized slot. The disk store and a ram store of an int8/int4 format keep them."""
        raise BadInput(f"the {self.name} store holds no encoded blobs for quantized slots; use --store disk")

    @property
    def stored_format(self) -> ExpertFormat:
        """The format the store serves experts in."""
        return ExpertFormat.of_dtype(self.dtype)

    def buffer_bytes(self, workers: int) -> int:
        """Fast-tier memory the store's reads need besides the slots (per-worker staging)."""
        return 0

    def direct_targets(self, dsts: list[torch.Tensor]) -> list[np.ndarray] | None:
        """When `read_into(..., *dsts)` reads a blob straight into the bytes of dsts (one slot's
        parts), those bytes as uint8 arrays, taken once for `read_direct`; else None."""
        return None

    def read_direct(self, layer: int, expert: int, targets: list[np.ndarray]) -> int:
        """read_into through `direct_targets(dsts)`: the same bytes land, without re-deriving the
        views on every read. Returns the bytes moved."""
        raise NotImplementedError(f"the {self.name} store reads nothing straight into slots")

    def close(self) -> None:
        """Release the store's files and buffers; the base store holds none."""
        pass


class RamStore(ExpertStore):
    """With a quantized `fmt`, holds the weights that format's disk store serves (quantised and
    dequantised once at load): the emulation of a quantized slow tier. `dtype` None: the experts
    as the checkpoint or a float `fmt` stores them (fp32 for a quantized `fmt`), so that 16-bit slots
    take plain copies; a copy into slots of another dtype converts (rounds once to a 16-bit slot
    dtype, as the disk store's fetch does)."""
    name = read_mode = "ram"
    inline = True

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype=torch.float32, fmt: ExpertFormat | None = None):
        if dtype is None:
            dtype = (layer_experts(ckpt, args, 0).w13.dtype if fmt is None
                     else FLOAT_DTYPES.get(fmt.dtype, torch.float32))
        super().__init__(ExpertShape.of(args), dtype)
        self.format = fmt
        self._ckpt, self._args = ckpt, args  # for the float parts and the encoded blobs, each made on first use
        self._blobs: torch.Tensor | None = None

    @functools.cached_property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """(w13 [L, E, 2F, H], w2 [L, E, H, F], and with biases b13 [L, E, 2F], b2 [L, E, H]) in the
        compute dtype, each expert as the format stores it. Made on first use: quantized slots never
        need them (they copy the encoded blobs), and for a large model they are the largest thing held."""
        layers, fmt = list(all_layer_experts(self._ckpt, self._args)), self.format

        def stack(part):
            if fmt is None:
                return self._hold(torch.stack([part(x).to(self.dtype) for x in layers]))
            return self._hold(torch.stack([torch.stack([roundtrip(w, fmt) for w in part(x)]).to(self.dtype)
                                           for x in layers]))
        out = (stack(lambda x: x.w13), stack(lambda x: x.w2))
        return out + (stack(lambda x: x.b13), stack(lambda x: x.b2)) if self.shape.bias else out

    @staticmethod
    def _hold(t: torch.Tensor) -> torch.Tensor:
        """How the store keeps a stacked part (PinnedStore: page-locked)."""
        return t

    w13 = property(lambda self: self.parts[0])
    w2 = property(lambda self: self.parts[1])
    b13 = property(lambda self: self.parts[2] if self.shape.bias else None)
    b2 = property(lambda self: self.parts[3] if self.shape.bias else None)

    @property
    def expert_bytes(self) -> int:
        """Bytes of a fetch: in the emulated format's encoding when there is one."""
        return super().expert_bytes if self.format is None else encoded_bytes(self.shape.parts, self.format)

    @property
    def stored_format(self) -> ExpertFormat:
        """The emulated format, or the dtype the experts are held in."""
        return self.format or ExpertFormat.of_dtype(self.dtype)

    def _sources(self, layer: int, expert: int) -> list[torch.Tensor]:
        return [p[layer, expert] for p in self.parts]

    def read_into(self, layer, expert, w13, w2, b13=None, b2=None):
        """Copy expert (layer, expert) from host memory into w13 [2F, H], w2 [H, F] (and b13 [2F],
        b2 [H]); returns the bytes a fetch counts (`expert_bytes`)."""
        for dst, src in zip((w13, w2, b13, b2), self._sources(layer, expert)):
            dst.copy_(src)
        return self.expert_bytes

    def read_encoded(self, layer, expert, dst):
        """Copy the int8/int4/MXFP4 blob of (layer, expert) into a quantized slot dst uint8 [encoded bytes]:
        the bytes the disk store of this format holds, encoded from the checkpoint on first use (MXFP4 from the
        dequantised weights of an MXFP4 checkpoint: their values, if not always their scales)."""
        if self.format is None or not self.format.quantized:
            return super().read_encoded(layer, expert, dst)
        if self._blobs is None:
            n = encoded_bytes(self.shape.parts, self.format)
            self._blobs = torch.stack([
                torch.stack([torch.frombuffer(bytearray(encode([p[e] for p in x if p is not None],
                                                               self.shape.parts, self.format, n)), dtype=torch.uint8)
                             for e in range(self.shape.num_experts)])
                for x in all_layer_experts(self._ckpt, self._args)])  # [L, E, n]
        dst.copy_(self._blobs[layer, expert])
        return self.expert_bytes


class PinnedStore(RamStore):
    """Page-locked host copies: the transfer engine copies from them with non_blocking=True on its copy
    stream (`host_parts`), without a staging buffer."""
    name = read_mode = "pinned"
    pinned_host = True

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype=torch.float16):
        if not torch.cuda.is_available():
            raise UnknownName("store 'pinned' needs a CUDA device; use --store ram or --store disk on this machine")
        super().__init__(ckpt, args, dtype)
        self.parts  # noqa: B018 -- page-locked at load, not at the first fetch

    @staticmethod
    def _hold(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def host_parts(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The page-locked parts of (layer, expert) (w13 [2F, H], w2 [H, F], biases), to copy from as they are."""
        return self._sources(layer, expert)


def staging_bytes(store: str, shape: ExpertShape, fmt: ExpertFormat, workers: int) -> int:
    """The staging buffers a store of kind `store` holding `fmt` reads through with `workers` workers (its
    `buffer_bytes`), computed before it is opened."""
    return (workers + 1) * _blob_bytes(shape, fmt) if store == "disk" else 0


def _blob_bytes(shape: ExpertShape, fmt: ExpertFormat) -> int:
    return (encoded_bytes(shape.parts, fmt) + ALIGN - 1) // ALIGN * ALIGN


def default_store_dir(ckpt: Checkpoint) -> Path:
    """~/.cache/expertcache/<model>-<digest of its weight files>, so a changed checkpoint reconverts."""
    h = hashlib.sha1()
    for f in sorted(set(ckpt.files.values())):
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    root = Path(os.environ.get("EXPERTCACHE_HOME", Path.home() / ".cache" / "expertcache"))
    return root / "stores" / f"{ckpt.path.resolve().name}-{h.hexdigest()[:12]}"


def format_store_dir(ckpt: Checkpoint, fmt: ExpertFormat | None) -> Path:
    """The default folder of a store in `fmt`: `default_store_dir`, suffixed by the format's tag
    unless it is None (the checkpoint's own dtype)."""
    base = default_store_dir(ckpt)
    return base if fmt is None else base.with_name(f"{base.name}-{fmt.tag}")


@contextmanager
def conversion_lock(store_dir: Path):
    """Held while a store folder is converted: two processes that start on a fresh machine at once (a server and
    a generate) would otherwise write the same file together, and the second find it renamed away."""
    store_dir.mkdir(parents=True, exist_ok=True)
    with open(store_dir / ".convert.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def convert_to_disk(ckpt: Checkpoint, args: ModelArgs, out_dir: Path, dtype: torch.dtype | None = None,
                    fmt: ExpertFormat | None = None, progress: bool | None = None) -> Path:
    """Write experts.bin (aligned blobs in (layer, expert) order) and experts.json (shapes, the
    format and a CRC32C per encoded blob); returns out_dir. The experts are stored in `fmt`, else
    as `dtype`, else in the checkpoint's dtype; a checkpoint already in `fmt` (GPT-OSS's MXFP4) is
    written as it is, not requantised. `progress`: a bar of layers on stderr (None: where stderr is a
    terminal, as a model's first run converts it)."""
    shape = ExpertShape.of(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "experts.json").unlink(missing_ok=True)  # no header may describe a half-written file
    tmp = out_dir / "experts.bin.partial"
    checksums = []
    fmt = fmt or (ExpertFormat.of_dtype(dtype) if dtype is not None else None)
    try:
        bar_args = dict(total=args.num_moe_layers, unit="layer", desc=f"convert to {out_dir.name}")
        with progress_bar(progress, **bar_args) as bar, open(tmp, "wb") as f:
            for layer in range(args.num_moe_layers):
                for e in range(args.num_experts):  # one expert at a time: a conversion holds one, not a layer
                    # w13, w2 (and b13, b2): the blob's order; as stored when the checkpoint is in `fmt` already
                    parts = expert_parts(ckpt, args, layer, e, mxfp4=fmt is not None and fmt.mx)
                    fmt = fmt or ExpertFormat.of_dtype(parts[0].dtype)
                    data = encode(parts, shape.parts, fmt, _blob_bytes(shape, fmt))
                    checksums.append(crc32c.crc32c(data))  # of the stored bytes: the same check for every format
                    f.write(data)
                _written(f)
                bar.update()
    except BaseException:  # a full disk, an interrupt: no partial file is left to fill the disk
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out_dir / "experts.bin")
    meta = {"format_version": DISK_FORMAT_VERSION, **fmt.meta(),
            "num_layers": shape.num_layers, "num_experts": shape.num_experts, "w13": list(shape.w13),
            "w2": list(shape.w2), "bias": shape.bias, "blob_bytes": _blob_bytes(shape, fmt), "align": ALIGN,
            "checksum": "crc32c", "checksums": checksums}
    (out_dir / "experts.json.partial").write_text(json.dumps(meta))
    os.replace(out_dir / "experts.json.partial", out_dir / "experts.json")
    return out_dir


def _written(f) -> None:
    """Flush what a conversion wrote so far to the disk and drop it from the page cache: the store's file would
    otherwise stay cached, charged to the process (and its memory cgroup) as it grows."""
    f.flush()
    os.fsync(f.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def store_format(store_dir: Path) -> int | None:
    """The format version recorded in a store's experts.json; None if there is no readable one."""
    try:
        return json.loads((store_dir / "experts.json").read_text()).get("format_version")
    except (OSError, ValueError, AttributeError):
        return None


def open_blob_file(path: Path, read_mode: str) -> tuple[int, str]:
    """Open the store file for reads that bypass the page cache; returns (fd, the mode used):
    "o_direct"; or, for `buffered` or when `auto` finds O_DIRECT refused, "buffered-nocache"
    (macOS F_NOCACHE) or "buffered-dontneed" (each read dropped from the page cache after it)."""
    if read_mode not in READ_MODES:
        raise UnknownName(f"unknown read mode {read_mode!r}; choose one of {', '.join(READ_MODES)}")
    direct = getattr(os, "O_DIRECT", None)
    if read_mode != "buffered":
        if direct is None:
            if read_mode == "direct":
                raise ReadModeUnsupported(f"this platform ({sys.platform}) has no O_DIRECT; use read mode "
                                          "'auto' or 'buffered' (buffered reads that bypass the page cache)")
        else:
            try:
                return os.open(path, os.O_RDONLY | direct), "o_direct"
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                if read_mode == "direct":
                    raise ReadModeUnsupported(
                        f"{path}: the filesystem refuses O_DIRECT ({e.strerror}); move the store to another "
                        "filesystem with --store-dir, or use read mode 'auto' or 'buffered'") from None
    fd = os.open(path, os.O_RDONLY)
    if F_NOCACHE is not None:
        fcntl.fcntl(fd, F_NOCACHE, 1)
        return fd, "buffered-nocache"
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: it would cache the neighbouring blobs
        return fd, "buffered-dontneed"
    return fd, "buffered"


class DiskStore(ExpertStore):
    """Experts read from experts.bin into one aligned buffer per worker thread, each blob checked
    against its CRC32C (`verify`) before it reaches a slot."""
    name = "disk"

    def __init__(self, store_dir: Path, args: ModelArgs, read_mode: str = "auto", verify: bool = True):
        try:
            meta = json.loads((store_dir / "experts.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{store_dir}: no valid experts.json ({e}); run `expertcache convert`") from None
        if meta.get("format_version") != DISK_FORMAT_VERSION:
            raise CheckpointError(f"{store_dir}: disk store format {meta.get('format_version')}, expected "
                                  f"{DISK_FORMAT_VERSION}; rerun `expertcache convert`")
        shape = ExpertShape.of(args)
        if (meta["num_layers"], meta["num_experts"], tuple(meta["w13"]), tuple(meta["w2"]), meta.get("bias", False)) \
                != (shape.num_layers, shape.num_experts, shape.w13, shape.w2, shape.bias) or \
                len(meta["checksums"]) != shape.num_layers * shape.num_experts:
            raise CheckpointError(f"{store_dir}: disk store does not match the model's shape; "
                                  "rerun `expertcache convert`")
        try:
            self.format = ExpertFormat.from_meta(meta)
            if meta.get("blob_bytes") != _blob_bytes(shape, self.format):
                raise ValueError(f"blob_bytes {meta.get('blob_bytes')} is not the format's "
                                 f"{_blob_bytes(shape, self.format)}")
        except ValueError as e:
            raise CheckpointError(f"{store_dir}: experts.json is corrupted ({e}); rerun `expertcache convert`") \
                from None
        quantized = self.format.quantized
        super().__init__(shape, torch.uint8 if quantized else getattr(torch, meta["dtype"]))
        self.blob = meta["blob_bytes"]
        self.checksums = np.array(meta["checksums"], dtype=np.uint32)  # [L * E]
        self.verify = verify
        self.path = store_dir / "experts.bin"
        expected = self.blob * shape.num_layers * shape.num_experts
        if not self.path.exists() or self.path.stat().st_size != expected:
            raise CheckpointError(f"{self.path}: missing or truncated (expected {expected} bytes); "
                                  "rerun `expertcache convert`")
        self.fd, self.read_mode = open_blob_file(self.path, read_mode)
        self._local = threading.local()
        self._plan = decode_plan(shape.parts, self.format)  # how the compiled pass reads a blob
        self.encoded_bytes = encoded_bytes(shape.parts, self.format)
        raw = None if quantized else FLOAT_DTYPES[self.format.dtype]
        self._raw = raw  # float blobs: the parts' values back to back, no padding between them
        self._segments = layout(shape.parts, self.format)
        # a float blob that is whole pages per part can be read straight into slot rows of its dtype
        self._direct_parts = raw is not None and self.encoded_bytes == self.blob and \
            all(math.prod(p) * raw.itemsize % ALIGN == 0 for p in shape.parts)

    @property
    def stored_format(self) -> ExpertFormat:
        """The format experts.json records."""
        return self.format

    @property
    def expert_bytes(self) -> int:
        """Bytes of one blob, padded to the 4 KiB alignment: what every read moves."""
        return self.blob

    def _buffer(self) -> tuple[mmap.mmap, np.ndarray]:
        # O_DIRECT needs an aligned buffer: an anonymous mmap is page-aligned. One per thread.
        if not hasattr(self._local, "buf"):
            buf = mmap.mmap(-1, self.blob)
            self._local.buf = (buf, np.frombuffer(buf, dtype=np.uint8))
        return self._local.buf

    def buffer_bytes(self, workers):
        """One blob-sized, page-aligned read buffer per worker, and one for the calling thread
        (which reads a token's only fetch itself, `CacheConfig.caller_reads`)."""
        return (workers + 1) * self.blob

    def read_into(self, layer, expert, w13, w2, b13=None, b2=None):
        """Read and check the blob of (layer, expert) into w13 [2F, H], w2 [H, F] (and b13 [2F], b2 [H]).
        Contiguous CPU tensors (the CPU slots): of the blob's own float dtype, its bytes as they are
        (read straight into them when each part is whole pages at page-aligned addresses); fp32, one
        compiled pass that releases the GIL; fp16 or bf16, that pass into fp32 scratch, then rounded
        once to the slot's dtype (round to nearest even, as torch converts: what a ram store
        emulating the format holds in that dtype). Torch ops otherwise (CUDA). Returns the blob's bytes."""
        dsts = (w13, w2, b13, b2)[:len(self.shape.parts)]
        targets = self.direct_targets(dsts)
        if targets is not None:
            return self.read_direct(layer, expert, targets)
        self.land(self._read(layer, expert), dsts)
        return self.blob

    def _cpu_slots(self, dsts) -> bool:
        """Whether dsts are contiguous CPU tensors of the parts' shapes (the compiled pass checks no bounds)."""
        return all(d is not None and d.device.type == "cpu" and d.is_contiguous() and d.shape == p
                   for d, p in zip(dsts, self.shape.parts))

    def land(self, array: np.ndarray, dsts) -> None:
        """A read and checked blob (uint8 [blob]: a thread's buffer, or a staging buffer) into the slot
        tensors dsts, as read_into describes."""
        cpu = self._cpu_slots(dsts)
        same = cpu and all(d.dtype == self._raw for d in dsts)
        if same:
            for seg, d in zip(self._segments, dsts):
                d.view(-1).view(torch.uint8).numpy()[:] = array[seg.offset:seg.offset + seg.nbytes]
        elif cpu and all(d.dtype == torch.float32 for d in dsts):
            flat = [d.view(-1).numpy() for d in dsts]
            decode_blob(array, self._plan, *flat, *[NO_PART] * (4 - len(flat)))
        elif cpu:
            scratch = self._scratch()
            decode_blob(array, self._plan, *[s.view(-1).numpy() for s in scratch])
            for d, s in zip(dsts, scratch):
                d.copy_(s)
        else:
            decode_into(torch.from_numpy(array), self.shape.parts, self.format, dsts)

    def direct_targets(self, dsts):
        """The bytes of dsts as uint8 arrays when the blob's float parts are whole pages of their
        dtype and dsts are contiguous CPU tensors of that dtype and shape at page-aligned addresses."""
        if not self._direct_parts or len(dsts) != len(self.shape.parts):
            return None
        if self._cpu_slots(dsts) and all(d.dtype == self._raw and d.data_ptr() % ALIGN == 0 for d in dsts):
            return [d.view(-1).view(torch.uint8).numpy() for d in dsts]
        return None

    def read_direct(self, layer, expert, targets):
        """One O_DIRECT preadv of the blob into `targets` (direct_targets), checked."""
        self._read(layer, expert, targets)
        return self.blob

    def _scratch(self) -> list[torch.Tensor]:
        """This thread's fp32 tensors of one expert's four parts (empty for biases the family has not)."""
        if not hasattr(self._local, "scratch"):
            parts = self.shape.parts
            self._local.scratch = [torch.empty(p) for p in parts] + [torch.empty(0)] * (4 - len(parts))
        return self._local.scratch

    def read_encoded(self, layer, expert, dst):
        """Read and check the blob of (layer, expert), then copy its encoded bytes (unpadded) into dst
        uint8 [encoded_bytes]: a quantized slot keeps them as they are. Returns the blob's bytes."""
        self.copy_encoded(self._read(layer, expert), dst)
        return self.blob

    def copy_encoded(self, blob: np.ndarray, dst: torch.Tensor) -> None:
        """A checked blob's encoded bytes (unpadded) into a quantized slot dst uint8 [encoded_bytes]."""
        dst.numpy()[:] = blob[:self.encoded_bytes]

    def _read(self, layer: int, expert: int, into: list | None = None) -> np.ndarray | None:
        """One blob read with O_DIRECT into this thread's buffer, or into the buffers `into` (page-aligned,
        whole pages, the blob's size together); returns the thread's buffer as an array (None with `into`)."""
        buf, array = self._buffer() if into is None else (None, None)
        targets = [buf] if into is None else into
        offset = self.offset(layer, expert)
        try:
            n = os.preadv(self.fd, targets, offset)
            if self.read_mode == "buffered-dontneed":  # the next read of this blob comes from the device again
                os.posix_fadvise(self.fd, offset, self.blob, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            n = -(e.errno or errno.EIO)
        self.check_read(layer, expert, n, targets)
        return array

    def offset(self, layer: int, expert: int) -> int:
        """Where the blob of (layer, expert) starts in the store file."""
        return (layer * self.shape.num_experts + expert) * self.blob

    def check_read(self, layer: int, expert: int, n: int, targets: list) -> None:
        """FetchError unless a read of the blob of (layer, expert) into `targets` returned the whole
        blob (n: bytes read, or -errno) with the checksum that `convert` recorded."""
        if n < 0:
            raise FetchError(f"reading expert {expert} of layer {layer} from the disk store failed "
                             f"([Errno {-n}] {os.strerror(-n)}); check the disk or rerun `expertcache convert`")
        if n != self.blob:
            raise FetchError(f"short read of expert {expert} of layer {layer}: {n} of {self.blob} bytes; "
                             "the store file is truncated, rerun `expertcache convert`")
        if self.verify and self._crc(targets) != self.checksums[layer * self.shape.num_experts + expert]:
            raise FetchError(f"expert {expert} of layer {layer} fails its CRC32C check in {self.path}: "
                             "the store file is corrupt; rerun `expertcache convert`")

    @staticmethod
    def _crc(buffers: list) -> int:
        """The CRC32C of the buffers' bytes back to back."""
        crc = 0
        for b in buffers:
            crc = crc32c.crc32c(b, crc)
        return crc

    def close(self):
        """Close the store file; a second call does nothing."""
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None


STORES = ("ram", "disk", "pinned")


def open_store(name: str, ckpt: Checkpoint, args: ModelArgs, store_dir: Path | None = None,
               dtype: torch.dtype = torch.float32, fmt: ExpertFormat | None = None, read_mode: str = "auto",
               verify: bool = True) -> ExpertStore:
    """The slow tier `name` of a checkpoint's experts; `fmt`: the format they are stored in (None:
    the checkpoint's dtype). A disk store missing from `store_dir` is converted first; the default
    folder (`format_store_dir`, under ~/.cache) is also reconverted when it was written in an older
    format version; a store there in another format is refused."""
    store_dir = Path(store_dir) if store_dir is not None else None  # a str from the Python API, too
    if name == "ram":
        return RamStore(ckpt, args, dtype, fmt)
    if name == "pinned":
        if fmt is not None and fmt.quantized:
            raise UnknownName(f"store 'pinned' holds float experts; drop the {fmt.dtype} store dtype "
                              "or use --store disk")
        return PinnedStore(ckpt, args, dtype)
    if name == "disk":
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
            raise CheckpointError(f"{store_dir} holds experts as {store.format.tag}, not {fmt.tag}; "
                                  f"convert to another folder (`expertcache convert --dtype {fmt.dtype} --out DIR`)")
        return store
    raise UnknownName(f"unknown store {name!r}; choose one of {', '.join(STORES)}")
