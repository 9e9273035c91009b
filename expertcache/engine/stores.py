"""The slow tier: where every expert lives. One interface, three real places.

- `ram`: all experts in host memory in the compute dtype; exact and without latency
  (the store the emulation study uses).
- `disk`: one 4 KiB-aligned blob per (layer, expert) in a file written once by `convert`,
  read with O_DIRECT so every fetch moves real bytes from the device, never the page cache.
- `pinned`: all experts in page-locked host memory, copied to a CUDA device asynchronously.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, FetchError, UnknownName
from ..models.args import ModelArgs
from .checkpoint import Checkpoint
from .weights import all_layer_experts

ALIGN = 4096
DISK_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ExpertShape:
    num_layers: int
    num_experts: int
    w13: tuple[int, int]  # (2F, H)
    w2: tuple[int, int]  # (H, F)

    @classmethod
    def of(cls, a: ModelArgs) -> "ExpertShape":
        return cls(a.num_moe_layers, a.num_experts, (2 * a.expert_dim, a.hidden_size), (a.hidden_size, a.expert_dim))

    @property
    def numel(self) -> int:
        return self.w13[0] * self.w13[1] + self.w2[0] * self.w2[1]


class ExpertStore(ABC):
    """Holds every (layer, expert); `read_into` copies one expert into fast-tier tensors."""

    name: str
    inline = False  # True: a copy costs less than a hand-off to a worker, so transfers run in place

    def __init__(self, shape: ExpertShape, dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype

    @property
    def expert_bytes(self) -> int:
        """Bytes one fetch moves from the slow tier."""
        return self.shape.numel * self.dtype.itemsize

    @abstractmethod
    def read_into(self, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Copy expert (layer, expert) into w13 [2F, H] and w2 [H, F]; returns bytes moved.
        Safe to call from worker threads."""

    def close(self) -> None:
        pass


class RamStore(ExpertStore):
    name = "ram"
    inline = True

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype=torch.float32):
        super().__init__(ExpertShape.of(args), dtype)
        layers = list(all_layer_experts(ckpt, args))
        self.w13 = torch.stack([w13.to(dtype) for w13, _ in layers])  # [L, E, 2F, H]
        self.w2 = torch.stack([w2.to(dtype) for _, w2 in layers])  # [L, E, H, F]

    def read_into(self, layer, expert, w13, w2):
        w13.copy_(self.w13[layer, expert])
        w2.copy_(self.w2[layer, expert])
        return self.expert_bytes


class PinnedStore(RamStore):
    """Page-locked host copies; the transfer engine issues the non_blocking copies in place,
    on its copy stream."""
    name = "pinned"

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype=torch.float16):
        if not torch.cuda.is_available():
            raise UnknownName("store 'pinned' needs a CUDA device; use --store ram or --store disk on this machine")
        super().__init__(ckpt, args, dtype)
        self.w13, self.w2 = self.w13.pin_memory(), self.w2.pin_memory()

    def read_into(self, layer, expert, w13, w2):
        w13.copy_(self.w13[layer, expert], non_blocking=True)
        w2.copy_(self.w2[layer, expert], non_blocking=True)
        return self.expert_bytes


def _blob_bytes(shape: ExpertShape, dtype: torch.dtype) -> int:
    raw = shape.numel * dtype.itemsize
    return (raw + ALIGN - 1) // ALIGN * ALIGN


def default_store_dir(ckpt: Checkpoint) -> Path:
    """~/.cache/expertcache/<model>-<digest of its weight files>, so a changed checkpoint reconverts."""
    h = hashlib.sha1()
    for f in sorted(set(ckpt.files.values())):
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    root = Path(os.environ.get("EXPERTCACHE_HOME", Path.home() / ".cache" / "expertcache"))
    return root / "stores" / f"{ckpt.path.resolve().name}-{h.hexdigest()[:12]}"


def convert_to_disk(ckpt: Checkpoint, args: ModelArgs, out_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """Write experts.bin (aligned blobs in (layer, expert) order) and experts.json; returns out_dir."""
    shape = ExpertShape.of(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "experts.bin.partial"
    first = None
    with open(tmp, "wb") as f:
        for w13, w2 in all_layer_experts(ckpt, args):
            dtype = dtype or w13.dtype
            first = first or dtype
            blob = _blob_bytes(shape, dtype)
            for e in range(args.num_experts):
                raw = torch.cat([w13[e].to(dtype).flatten(), w2[e].to(dtype).flatten()]).view(torch.uint8)
                f.write(raw.numpy().tobytes())
                f.write(b"\0" * (blob - raw.numel()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / "experts.bin")
    meta = {"format_version": DISK_FORMAT_VERSION, "dtype": str(dtype).removeprefix("torch."),
            "num_layers": shape.num_layers, "num_experts": shape.num_experts, "w13": list(shape.w13),
            "w2": list(shape.w2), "blob_bytes": _blob_bytes(shape, dtype), "align": ALIGN}
    (out_dir / "experts.json").write_text(json.dumps(meta, indent=1))
    return out_dir


class DiskStore(ExpertStore):
    name = "disk"

    def __init__(self, store_dir: Path, args: ModelArgs):
        try:
            meta = json.loads((store_dir / "experts.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{store_dir}: no valid experts.json ({e}); run `expertcache convert`") from None
        if meta.get("format_version") != DISK_FORMAT_VERSION:
            raise CheckpointError(f"{store_dir}: disk store format {meta.get('format_version')}, expected "
                                  f"{DISK_FORMAT_VERSION}; rerun `expertcache convert`")
        shape = ExpertShape.of(args)
        if (meta["num_layers"], meta["num_experts"], tuple(meta["w13"]), tuple(meta["w2"])) != \
                (shape.num_layers, shape.num_experts, shape.w13, shape.w2):
            raise CheckpointError(f"{store_dir}: disk store does not match the model's shape; "
                                  "rerun `expertcache convert`")
        super().__init__(shape, getattr(torch, meta["dtype"]))
        self.blob = meta["blob_bytes"]
        path = store_dir / "experts.bin"
        expected = self.blob * shape.num_layers * shape.num_experts
        if not path.exists() or path.stat().st_size != expected:
            raise CheckpointError(f"{path}: missing or truncated (expected {expected} bytes); "
                                  "rerun `expertcache convert`")
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        self._local = threading.local()
        n13 = shape.w13[0] * shape.w13[1]
        self._split = (n13, shape.numel - n13)

    def _buffer(self) -> tuple[mmap.mmap, torch.Tensor]:
        # O_DIRECT needs an aligned buffer: an anonymous mmap is page-aligned. One per thread.
        if not hasattr(self._local, "buf"):
            buf = mmap.mmap(-1, self.blob)
            view = torch.frombuffer(buf, dtype=self.dtype, count=self.shape.numel)
            self._local.buf = (buf, view)
        return self._local.buf

    def read_into(self, layer, expert, w13, w2):
        buf, view = self._buffer()
        offset = (layer * self.shape.num_experts + expert) * self.blob
        try:
            n = os.preadv(self.fd, [buf], offset)
        except OSError as e:
            raise FetchError(f"reading expert {expert} of layer {layer} from the disk store failed ({e}); "
                             "check the disk or rerun `expertcache convert`") from None
        if n != self.blob:
            raise FetchError(f"short read of expert {expert} of layer {layer}: {n} of {self.blob} bytes; "
                             "the store file is truncated, rerun `expertcache convert`")
        a, b = view.split(self._split)
        w13.copy_(a.view(self.shape.w13))
        w2.copy_(b.view(self.shape.w2))
        return self.blob

    def close(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None


STORES = ("ram", "disk", "pinned")


def open_store(name: str, ckpt: Checkpoint, args: ModelArgs, store_dir: Path | None = None,
               dtype: torch.dtype = torch.float32) -> ExpertStore:
    if name == "ram":
        return RamStore(ckpt, args, dtype)
    if name == "pinned":
        return PinnedStore(ckpt, args, dtype)
    if name == "disk":
        store_dir = store_dir or default_store_dir(ckpt)
        if not (store_dir / "experts.json").exists():
            convert_to_disk(ckpt, args, store_dir)
        return DiskStore(store_dir, args)
    raise UnknownName(f"unknown store {name!r}; choose one of {', '.join(STORES)}")
