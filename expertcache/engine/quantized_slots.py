"""Expert compute over quantized slots: each slot holds one expert's encoded blob (int8 or int4
codes with their group scales and minimums, quant.py's layout) as the disk store keeps it, so the
fast tier holds 2-4x the experts of fp16 slots in the same bytes. Decode's token runs the compiled
kernel.expert_compute.experts_token_int, which computes from the codes without dequantising them
(per group, scale * (codes . x) + min * sum(x)); windows dequantise each used expert once per run
(kernel.decode_blob) and compute with torch."""
from __future__ import annotations

import numpy as np
import torch

from ..kernel.decode_blob import NO_PART, decode_blob
from ..kernel.expert_compute import experts_token_int, int_work_floats
from .experts import ExpertKind, experts_grouped_by
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
        self.parts = [torch.empty(p) for p in shape.parts]  # one expert dequantised, for windows

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

    def grouped(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Windows: x [T, H] fp32, slots, weights [T, k] -> [T, H], each used slot dequantised once."""
        return experts_grouped_by(x, slots, weights, self.expert, self.kind)
