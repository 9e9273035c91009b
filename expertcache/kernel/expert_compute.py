"""Decode's expert compute on the CPU, compiled: one token's k experts straight from their
cache slots in one call (gate/up products, the gated activation, down products and the
gate-weighted sum), instead of ~4 PyTorch operations per expert. Computes in fp32 from fp32
slots or from 16-bit ones (`compiled.widen`: exact); sums may be reassociated (SIMD), so results
differ from PyTorch's by rounding only."""
from __future__ import annotations

import numpy as np
from numba import njit

from .compiled import widen

# reassoc/contract let LLVM vectorise the dot products; inf and nan keep their meaning
FAST = {"reassoc", "contract"}


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def experts_token(x, slots, gates, w13, w2, b13, b2, limit, alpha, act, out):
    """x [H], slots [k] (int64), gates [k] float32, w13 [S, 2F, H], w2 [S, H, F], biases b13
    [S, 2F] and b2 [S, H] (shape [0, 0] when the family has none); weights and biases float32, or
    uint16 / int16 holding fp16 / bf16 bits (`widen`); limit (> 0: GPT-OSS's
    clamped SwiGLU with `alpha`; otherwise silu(gate) * up), act [F] scratch -> out [H] =
    sum_j gates[j] * expert_{slots[j]}(x)."""
    F = w2.shape[2]
    H = x.shape[0]
    biased = b13.shape[0] > 0
    for h in range(H):
        out[h] = 0.0
    for j in range(slots.shape[0]):
        s, gate = slots[j], gates[j]
        for f in range(F):
            g = np.float32(0.0)
            u = np.float32(0.0)
            for h in range(H):
                g += widen(w13[s, f, h]) * x[h]
                u += widen(w13[s, F + f, h]) * x[h]
            if biased:
                g += widen(b13[s, f])
                u += widen(b13[s, F + f])
            if limit > 0:
                g = min(g, limit)
                u = min(max(u, -limit), limit)
                act[f] = gate * ((u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-g * alpha))))
            else:
                act[f] = gate * (g / (np.float32(1.0) + np.exp(-g)) * u)
        for h in range(H):
            y = np.float32(0.0)
            for f in range(F):
                y += widen(w2[s, h, f]) * act[f]
            if biased:
                y += gate * widen(b2[s, h])
            out[h] += y
