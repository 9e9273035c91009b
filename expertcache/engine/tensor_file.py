"""safetensors files read tensor by tensor with plain reads, each range's pages dropped from the page cache
once it is read: loading a model then charges the process (and the memory cgroup it runs in) the tensors it
keeps and at most one chunk of page cache, not every file it has read. The header alone gives each tensor's
dtype and shape, so a model's memory can be sized before any weight is read. The files expertcache writes
itself (predictors, default vectors) carry a checksum of their tensors in their metadata (`tensors_checksum`):
safetensors has none, and a flipped byte in a float reads as another number."""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import crc32c
import torch

from ..errors import CheckpointError

# safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CHUNK = 64 * 2**20  # bytes read (and then dropped from the page cache) at a time
MAX_HEADER = 100 * 2**20
F_NOCACHE = 48  # macOS: this descriptor's reads bypass the page cache


CHECKSUM = "crc32c"  # the metadata key of tensors_checksum's value


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC32C of the tensors by name: each one's name, dtype, shape and bytes, in the names' order (hex)."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        crc = crc32c.crc32c(f"{name}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        crc = crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def check_checksum(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None, fix: str) -> None:
    """CheckpointError where the file's metadata records a checksum its tensors do not match (a file written
    before checksums were recorded has none, and passes)."""
    want = (meta or {}).get(CHECKSUM)
    if want is not None and tensors_checksum(tensors) != want:
        raise CheckpointError(f"{path}: its tensors do not match the checksum written with them (a corrupt file); "
                              f"{fix}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in its file, and what they hold."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.end - self.start


class TensorFile:
    """One safetensors file: its header parsed on opening (CheckpointError when it is not a valid one), or taken as
    parsed by an earlier opening (`tensors`), its tensors read on demand."""

    def __init__(self, path: Path, tensors: dict[str, TensorInfo] | None = None):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror}); re-download or re-export it") from None
        try:
            self.tensors = tensors if tensors is not None else self._header()
        except OSError as e:  # a folder of the shard's name, a failing disk: the file named, not a bare errno
            os.close(self.fd)
            raise CheckpointError(f"{path}: cannot read ({e.strerror}); re-download or re-export it") from None
        except BaseException:
            os.close(self.fd)
            raise
        if sys.platform == "darwin":
            import fcntl
            fcntl.fcntl(self.fd, F_NOCACHE, 1)
        elif hasattr(os, "posix_fadvise"):  # no read-ahead: a disk's (8 MiB here) would bring in the pages of
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # tensors read earlier, which no drop then reaches

    def _corrupt(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors file ({why}); re-download or re-export it")

    def _header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self.fd).st_size
        raw = os.pread(self.fd, 8, 0)
        if len(raw) < 8:
            raise self._corrupt("shorter than its header")
        n = struct.unpack("<Q", raw)[0]
        if n > min(MAX_HEADER, size - 8):
            raise self._corrupt(f"a header of {n} bytes")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except (ValueError, UnicodeDecodeError) as e:
            raise self._corrupt(f"its header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._corrupt("its header is not a JSON object")
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = DTYPES[meta["dtype"]], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"tensor {name!r} has no valid dtype, shape and offsets") from None
            start, end = 8 + n + int(a), 8 + n + int(b)
            if not (8 + n <= start <= end <= size) or end - start != math.prod(shape) * dtype.itemsize:
                raise self._corrupt(f"tensor {name!r}'s bytes do not fit the file or its shape")
            out[name] = TensorInfo(dtype, shape, start, end)
        spans = sorted((info.start, info.end, name) for name, info in out.items() if info.end > info.start)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):  # safetensors refuses these too: one
            if start < end:  # tensor's bytes read as another's, a silent wrong model
                raise self._corrupt(f"tensors {first!r} and {second!r} share bytes")
        return out

    def keys(self) -> list[str]:
        """The tensors' names."""
        return list(self.tensors)

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name`, or with `index` its [index] along the first dimension (one expert of a fused stack),
        in a fresh CPU tensor; the range's pages are dropped from the page cache as they are read."""
        info = self.tensors[name]
        start, shape = info.start, info.shape
        if index is not None:
            per = info.nbytes // shape[0]
            start, shape = start + index * per, shape[1:]
        out = torch.empty(shape, dtype=info.dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:done + CHUNK]], start + done)
            except OSError as e:  # EIO: the file named, not a bare errno
                raise CheckpointError(f"{self.path}: cannot read tensor {name!r} ({e.strerror}); check the disk, "
                                      "or re-download or re-export it") from None
            if n <= 0:
                raise self._corrupt(f"tensor {name!r} ends early")
            if hasattr(os, "posix_fadvise"):  # dropped once read: kept data is the tensor's, not the cache's
                os.posix_fadvise(self.fd, start + done, n, os.POSIX_FADV_DONTNEED)
            done += n
        return out

    def close(self) -> None:
        """Close the file; a second call does nothing."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
