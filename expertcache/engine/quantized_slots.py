"""Expert compute over quantized slots: each slot holds one expert's encoded blob (int8 or int4
codes with their group scales and minimums, quant.py's layout) as the disk store keeps it, so the
fast tier holds 2-4x the experts of fp16 slots in the same bytes. Decode's token runs the compiled
kernel.expert_compute.experts_token_int, which computes from the codes without dequantising them
(per group, scale * (codes . x) + min * sum(x)); a window's compiled call (experts_window_int)
dequantises each used expert once (kernel.decode_blob) and runs its tokens together."""
from __future__ import annotations

import numpy as np
import torch

from ..kernel.decode_blob import NO_PART, decode_blob
from ..kernel.expert_compute import experts_token_int, experts_window_int, int_work_floats
from .experts import ExpertKind, grown_scratch
from .quant import ExpertFormat, decode_plan
from .stores import ExpertShape


class QuantizedSlots:
    """Decode's compiled expert call, and windows' grouped compute, over blobs uint8 [S, bytes] in `fmt`."""

    def __init__(self, blobs: torch.Tensor, shape: ExpertShape, fmt: ExpertFormat, kind: ExpertKind):
        assert fmt.quantized and not fmt.mx and blobs.dtype == torch.uint8 and blobs.device.type == "cpu", \
            (fmt, blobs.dtype)
        self.blobs, self.shape, self.kind = blobs, shape, kind
        self.plan = decode_plan(shape.parts, fmt)
        F = shape.w2[1]
        self.limit, self.alpha = np.float32(kind.limit or 0.0), np.float32(kind.alpha)
        self.work = np.empty(int_work_floats(self.plan), np.float32)
        self.act = np.empty(F, np.float32)
        self.parts = [torch.empty(p) for p in shape.parts]  # one expert dequantised (`expert`)
        self.scratch: tuple[np.ndarray, ...] | None = None  # windows', grown to the most assignments run so far

    def __call__(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray) -> torch.Tensor:
        """Decode: x [1, H] fp32, slots [k] int64, gates [k] float32 -> [1, H]."""
        out = torch.empty_like(x)
        experts_token_int(x.numpy()[0], slots, gates, self.blobs.numpy(), self.plan, self.limit, self.alpha, self.work,
                          self.act, out.numpy()[0])
        return out

    def expert(self, slot: int) -> tuple:
        """Slot `slot`'s expert dequantised to fp32 (w13, w2, b13, b2; None for absent biases),
        exactly as a fetch into fp32 slots writes it. Valid until the next call."""
        flat = [p.view(-1).numpy() for p in self.parts]
        decode_blob(self.blobs[slot].numpy(), self.plan, *flat, *[NO_PART] * (4 - len(flat)))
        return tuple(self.parts) + (None,) * (4 - len(self.parts))

    def window(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray) -> torch.Tensor:
        """A window's experts in one compiled call: x [T, H] fp32, slots [T, k] int64, gates [T, k] float32
        -> [T, H], each used slot dequantised once."""
        H, F = self.shape.parts[1]  # w2 [H, F]
        self.scratch = grown_scratch(self.scratch, slots.size, self.blobs.shape[0], H, F)
        out = torch.empty_like(x)
        experts_window_int(x.contiguous().numpy(), np.ascontiguousarray(slots), np.ascontiguousarray(gates),
                           self.blobs.numpy(), self.plan, self.limit, self.alpha, *self.scratch, out.numpy())
        return out
