"""What every slow tier is: the shape of one expert, the store interface, the blob's size on disk."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import BadInput, UnknownName
from ...models.args import ModelArgs
from ..quant import FLOAT_DTYPES, ExpertFormat, encoded_bytes

STORES = ("ram", "disk", "pinned")


def check_store(name: object) -> None:
    """UnknownName unless `name` is a store this machine can hold: `pinned` needs a CUDA device."""
    if name not in STORES:
        raise UnknownName(f"unknown store {name!r}; choose one of {', '.join(STORES)}")
    if name == "pinned" and not torch.cuda.is_available():
        raise UnknownName("store 'pinned' needs a CUDA device; use --store ram or --store disk on this machine")

ALIGN = 4096
DISK_FORMAT_VERSION = 3  # 2: a CRC32C per blob in experts.json; 3: quantized matrices in row blocks of 16 (quant.py)


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

    def problem(self) -> str | None:
        """What has happened to the store's files since it opened them, that its reads will meet (a server's health
        check); None when nothing has. A store held in memory has none."""
        return None

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




def staging_bytes(store: str, shape: ExpertShape, fmt: ExpertFormat, workers: int,
                  slots: ExpertFormat | None = None) -> int:
    """The staging buffers a store of kind `store` holding `fmt` reads through with `workers` workers (its
    `buffer_bytes`), computed before it is opened; none where every read lands in CPU slots of format `slots`."""
    if store != "disk" or (slots is not None and reads_into_slots(shape, fmt, slots)):
        return 0
    return (workers + 1) * blob_bytes(shape, fmt)


def reads_into_slots(shape: ExpertShape, fmt: ExpertFormat, slots: ExpertFormat) -> bool:
    """Whether a disk store of `fmt` reads each blob straight into CPU slots of format `slots`, with no staging
    buffer (DiskStore.direct_targets): slots of the blob's own float dtype whose parts are whole pages."""
    if slots != fmt or fmt.quantized:
        return False
    itemsize = FLOAT_DTYPES[fmt.dtype].itemsize
    return encoded_bytes(shape.parts, fmt) == blob_bytes(shape, fmt) and \
        all(math.prod(p) * itemsize % ALIGN == 0 for p in shape.parts)


def blob_bytes(shape: ExpertShape, fmt: ExpertFormat) -> int:
    """Bytes of one expert's blob in a disk store: its encoded parts, padded to whole 4 KiB pages."""
    return (encoded_bytes(shape.parts, fmt) + ALIGN - 1) // ALIGN * ALIGN
