"""`ram` and `pinned`: every expert in host memory (page-locked for `pinned`, copied to a CUDA device
asynchronously); exact and without latency (the store the emulation study uses)."""
from __future__ import annotations

import functools

import torch

from ...models.args import ModelArgs
from ..checkpoint import Checkpoint
from ..quant import FLOAT_DTYPES, ExpertFormat, encode, encoded_bytes, roundtrip
from ..weights import all_layer_experts, check_expert_tensors, expert_dtype
from .base import ExpertShape, ExpertStore, check_store


def held_dtype(ckpt: Checkpoint, args: ModelArgs, dtype: torch.dtype | None, fmt: ExpertFormat | None) -> torch.dtype:
    """The float dtype a ram store holds its experts in: `dtype`, else the checkpoint's (from its headers), else a
    float `fmt`'s, fp32 for a quantized one."""
    if dtype is not None:
        return dtype
    return expert_dtype(ckpt, args) if fmt is None else FLOAT_DTYPES.get(fmt.dtype, torch.float32)


class RamStore(ExpertStore):
    """With a quantized `fmt`, holds the weights that format's disk store serves (quantised and
    dequantised once at load): the emulation of a quantized slow tier. `dtype` None: the experts
    as the checkpoint or a float `fmt` stores them (fp32 for a quantized `fmt`), so that 16-bit slots
    take plain copies; a copy into slots of another dtype converts (rounds once to a 16-bit slot
    dtype, as the disk store's fetch does)."""
    name = read_mode = "ram"
    inline = True

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype=torch.float32, fmt: ExpertFormat | None = None):
        super().__init__(ExpertShape.of(args), held_dtype(ckpt, args, dtype, fmt))
        check_expert_tensors(ckpt, args)  # the experts are read on first use: a missing one is refused now
        self.format = fmt
        self._ckpt, self._args = ckpt, args  # for the float parts and the encoded blobs, each made on first use
        self._blobs: torch.Tensor | None = None

    @functools.cached_property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """(w13 [L, E, 2F, H], w2 [L, E, H, F], and with biases b13 [L, E, 2F], b2 [L, E, H]) in the
        compute dtype, each expert as the format stores it. Made on first use: quantized slots never
        need them (they copy the encoded blobs), and for a large model they are the largest thing held."""
        fmt, L = self.format, self._args.num_moe_layers
        names = ("w13", "w2", "b13", "b2")[:4 if self.shape.bias else 2]
        out = ()
        # written in place, one layer read at a time: stacking per-layer copies held the model twice at its peak,
        # at real size the difference between loading and being killed for memory
        for layer, x in enumerate(all_layer_experts(self._ckpt, self._args)):
            out = out or tuple(self._empty((L, *getattr(x, n).shape)) for n in names)
            for held, n in zip(out, names):
                for dst, w in zip(held[layer], getattr(x, n)):
                    dst.copy_(w if fmt is None else roundtrip(w, fmt))
        return out

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A stacked part's memory (PinnedStore: page-locked)."""
        return torch.empty(shape, dtype=self.dtype)

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
            blobs = torch.empty((self.shape.num_layers, self.shape.num_experts, n), dtype=torch.uint8)
            for held, x in zip(blobs, all_layer_experts(self._ckpt, self._args)):  # in place, as `parts`
                for e in range(self.shape.num_experts):
                    held[e] = torch.frombuffer(bytearray(encode([p[e] for p in x if p is not None], self.shape.parts,
                                                                self.format, n)), dtype=torch.uint8)
            self._blobs = blobs
        dst.copy_(self._blobs[layer, expert])
        return self.expert_bytes


class PinnedStore(RamStore):
    """Page-locked host copies: the transfer engine copies from them with non_blocking=True on its copy
    stream (`host_parts`), without a staging buffer."""
    name = read_mode = "pinned"
    pinned_host = True

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, dtype=torch.float16):
        check_store(self.name)
        super().__init__(ckpt, args, dtype)
        self.parts  # noqa: B018 -- page-locked at load, not at the first fetch

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, pin_memory=True)

    def host_parts(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The page-locked parts of (layer, expert) (w13 [2F, H], w2 [H, F], biases), to copy from as they are."""
        return self._sources(layer, expert)
