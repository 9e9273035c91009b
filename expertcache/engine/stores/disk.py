"""`disk`: one 4 KiB-aligned blob per (layer, expert) in a file written once by `convert` (as is, or in a
quantized format of quant.py, dequantised on the worker thread), read with O_DIRECT so every fetch moves real
bytes from the device, never the page cache (where O_DIRECT is refused: buffered reads that drop each blob from
the page cache, a reported read mode), and checked against the blob's CRC32C recorded at convert time."""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shlex
import sys
import threading
from pathlib import Path

import crc32c
import numpy as np
import torch

from ...errors import CheckpointError, FetchError, ReadModeUnsupported, UnknownName
from ...kernel.decode_blob import NO_PART, decode_blob
from ...models.args import ModelArgs
from ..quant import FLOAT_DTYPES, ExpertFormat, decode_into, decode_plan, encoded_bytes, layout
from .base import ALIGN, DISK_FORMAT_VERSION, ExpertShape, ExpertStore, blob_bytes, reads_into_slots

F_NOCACHE = getattr(fcntl, "F_NOCACHE", 48 if sys.platform == "darwin" else None)  # macOS: no page cache
READ_MODES = ("auto", "direct", "buffered")  # auto: O_DIRECT where the platform and filesystem allow it


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


def reconvert(store_dir: Path) -> str:
    """The fix of a damaged store: its folder converted again. Without --out, convert wrote the default folder,
    which left a store of the user's (--store-dir) as it was; without --force, a store whose header is whole is
    taken as current, its damaged blobs with it. The folder absolute: a server's log or a client reads it elsewhere
    than where the store was named relative to (`--store-dir sv`)."""
    return (f"rerun `expertcache convert --force --out {shlex.quote(str(Path(store_dir).absolute()))}` with the "
            "--model and --dtype it was made from")


class DiskStore(ExpertStore):
    """Experts read from experts.bin into one aligned buffer per worker thread, each blob checked
    against its CRC32C (`verify`) before it reaches a slot."""
    name = "disk"

    def __init__(self, store_dir: Path, args: ModelArgs, read_mode: str = "auto", verify: bool = True):
        try:
            meta = json.loads((store_dir / "experts.json").read_text())
        except (FileNotFoundError, ValueError) as e:  # not JSON or not UTF-8 (a corrupt file too)
            raise CheckpointError(f"{store_dir}: no valid experts.json ({e}); {reconvert(store_dir)}") from None
        if not isinstance(meta, dict):  # valid JSON of another shape: a corrupt or foreign file, not a traceback
            raise CheckpointError(f"{store_dir}: experts.json is corrupted (a JSON {type(meta).__name__}, not an "
                                  f"object); {reconvert(store_dir)}")
        if meta.get("format_version") != DISK_FORMAT_VERSION:
            raise CheckpointError(f"{store_dir}: disk store format {meta.get('format_version')}, expected "
                                  f"{DISK_FORMAT_VERSION}; {reconvert(store_dir)}")
        shape = ExpertShape.of(args)
        try:
            if (meta["num_layers"], meta["num_experts"], tuple(meta["w13"]), tuple(meta["w2"]),
                    meta.get("bias", False)) != (shape.num_layers, shape.num_experts, shape.w13, shape.w2, shape.bias) \
                    or len(meta["checksums"]) != shape.num_layers * shape.num_experts:
                raise CheckpointError(f"{store_dir}: disk store does not match the model's shape; "
                                      f"{reconvert(store_dir)}")
            self.format = ExpertFormat.from_meta(meta)
            if meta.get("blob_bytes") != blob_bytes(shape, self.format):
                raise ValueError(f"blob_bytes {meta.get('blob_bytes')} is not the format's "
                                 f"{blob_bytes(shape, self.format)}")
            checksums = np.array(meta["checksums"], dtype=np.uint32)  # [L * E]
            stamp = meta.get("checkpoint")
            if not isinstance(stamp, (dict, type(None))):
                raise TypeError(f"checkpoint is a {type(stamp).__name__}, not an object")
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # a field missing or of another type
            detail = f"no field {e}" if isinstance(e, KeyError) else str(e)
            raise CheckpointError(f"{store_dir}: experts.json is corrupted ({detail}); {reconvert(store_dir)}") \
                from None
        quantized = self.format.quantized
        super().__init__(shape, torch.uint8 if quantized else getattr(torch, meta["dtype"]))
        self.blob = blob_bytes(shape, self.format)  # the int the header was checked against, not its 61440.0
        self.checksums = checksums
        self.checkpoint = stamp  # the weight files converted (convert.checkpoint_stamp; None: an older store)
        self.verify = verify
        self.path = store_dir / "experts.bin"
        self.file_bytes = self.blob * shape.num_layers * shape.num_experts
        if not self.path.exists() or self.path.stat().st_size != self.file_bytes:
            raise CheckpointError(f"{self.path}: missing or truncated (expected {self.file_bytes} bytes); "
                                  f"{reconvert(store_dir)}")
        self.fd, self.read_mode = open_blob_file(self.path, read_mode)
        self._local = threading.local()
        self._plan = decode_plan(shape.parts, self.format)  # how the compiled pass reads a blob
        self.encoded_bytes = encoded_bytes(shape.parts, self.format)
        raw = None if quantized else FLOAT_DTYPES[self.format.dtype]
        self._raw = raw  # float blobs: the parts' values back to back, no padding between them
        self._segments = layout(shape.parts, self.format)
        # a float blob that is whole pages per part can be read straight into slot rows of its dtype
        self.direct_parts = reads_into_slots(shape, self.format, self.format)

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
        if not self.direct_parts or len(dsts) != len(self.shape.parts):
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
                             f"([Errno {-n}] {os.strerror(-n)}); check the disk or {reconvert(self.path.parent)}")
        if n != self.blob:
            raise FetchError(f"short read of expert {expert} of layer {layer}: {n} of {self.blob} bytes; "
                             f"the store file is truncated, {reconvert(self.path.parent)}")
        if self.verify and self._crc(targets) != self.checksums[layer * self.shape.num_experts + expert]:
            raise FetchError(f"expert {expert} of layer {layer} fails its CRC32C check in {self.path}: "
                             f"the store file is corrupt; {reconvert(self.path.parent)}")

    @staticmethod
    def _crc(buffers: list) -> int:
        """The CRC32C of the buffers' bytes back to back."""
        crc = 0
        for b in buffers:
            crc = crc32c.crc32c(b, crc)
        return crc

    def problem(self) -> str | None:
        """The file it reads cut short (every read past its end fails), or replaced on the disk by another (a store
        converted again: this one keeps reading the old file until it is opened again)."""
        if getattr(self, "fd", None) is None:
            return None
        held = os.fstat(self.fd)
        if held.st_size != self.file_bytes:
            return (f"{self.path} is {held.st_size} bytes, not {self.file_bytes}: {reconvert(self.path.parent)}, "
                    "then restart")
        try:
            now = os.stat(self.path)
        except OSError:
            return None  # removed: the open file is still read whole
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return f"{self.path} was replaced since it was opened; restart to read the new one"
        return None

    def close(self):
        """Close the store file; a second call does nothing."""
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
