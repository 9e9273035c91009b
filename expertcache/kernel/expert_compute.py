"""Decode's expert compute on the CPU, compiled: one token's k experts straight from their
cache slots in one call (gate/up products, the gated activation, down products and the
gate-weighted sum), instead of ~4 PyTorch operations per expert. Computes in fp32 from fp32
slots or from 16-bit ones (`compiled.widen`: exact); sums may be reassociated (SIMD), so results
differ from PyTorch's by rounding only."""
from __future__ import annotations

import numpy as np
from numba import njit

from .compiled import widen
from .decode_blob import COLS, decode_row

# reassoc/contract let LLVM vectorise the dot products; inf and nan keep their meaning
FAST = {"reassoc", "contract"}


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def gated(g, u, limit, alpha):
    """The gated activation of one (gate, up) pair: GPT-OSS's clamped form when limit > 0, else silu(g) * u."""
    if limit > 0:
        g = min(g, limit)
        u = min(max(u, -limit), limit)
        return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-g * alpha)))
    return g / (np.float32(1.0) + np.exp(-g)) * u


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
            act[f] = gate * gated(g, u, limit, alpha)
        for h in range(H):
            y = np.float32(0.0)
            for f in range(F):
                y += widen(w2[s, h, f]) * act[f]
            if biased:
                y += gate * widen(b2[s, h])
            out[h] += y


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def experts_token_encoded(x, slots, gates, blobs, plan, limit, alpha, scratch, act, out):
    """experts_token over quantized slots: blobs uint8 [S, bytes], each slot one expert's encoded blob
    as the disk store keeps it, read through plan int64 [parts, PLAN_COLUMNS] (quant.decode_plan):
    every weight row is dequantised into scratch (float32 [2F + H + max(H, F)]) with the values that
    decode_blob writes into an fp32 slot, then used at once, so the result is experts_token's over
    the dequantised slots, up to the order of its sums. act [F] scratch -> out [H]."""
    H = x.shape[0]
    F = plan[1, COLS]
    biased = plan.shape[0] > 2
    b13 = scratch[:2 * F]
    b2 = scratch[2 * F:2 * F + H]
    row = scratch[2 * F + H:]
    for h in range(H):
        out[h] = 0.0
    for j in range(slots.shape[0]):
        blob, gate = blobs[slots[j]], gates[j]
        if biased:
            decode_row(blob, plan[2], 0, b13)
            decode_row(blob, plan[3], 0, b2)
        for f in range(F):
            decode_row(blob, plan[0], f, row)
            g = np.float32(0.0)
            for h in range(H):
                g += row[h] * x[h]
            decode_row(blob, plan[0], F + f, row)
            u = np.float32(0.0)
            for h in range(H):
                u += row[h] * x[h]
            if biased:
                g += b13[f]
                u += b13[F + f]
            act[f] = gate * gated(g, u, limit, alpha)
        for h in range(H):
            decode_row(blob, plan[1], h, row)
            y = np.float32(0.0)
            for f in range(F):
                y += row[f] * act[f]
            if biased:
                y += gate * b2[h]
            out[h] += y
