"""One disk-store blob decoded into an expert's fp32 slot rows, compiled and without the GIL, on
the worker thread that read it: fp16 and bf16 widened bit by bit, fp32 copied, int8/int4 codes
dequantised group by group (engine/quant.py's packed row-block layout). One call per blob, no temporaries.
Exact: the same values as quant.decode_into (fp16/bf16 -> fp32 is exact; an integer weight is
`min + q * scale` or `(q - half) * scale`, each operation rounded once in fp32, as torch does).

A blob is described by a plan (`quant.decode_plan`): int64 [parts, PLAN_COLUMNS], one row per
part in the order of ExpertShape.parts (w13, w2, then b13 and b2), the columns named below.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# plan columns: the part's encoding, byte offsets of its values (raw or codes), scales and minimums
# (-1: none, the symmetric scheme), rows and columns of the part (a bias: 1 row), group size
ENCODING, VALUES, SCALES, MINS, ROWS, COLS, GROUP = range(7)
PLAN_COLUMNS = 7
RAW_F32, RAW_F16, RAW_BF16, INT8, INT4, MXFP4 = range(6)  # ENCODING values

NO_PART = np.empty(0, np.float32)  # the destination of a part the family does not have
POW2 = np.array([2.0 ** (e - 25) for e in range(32)], np.float32)  # an fp16 exponent's scale, exact
# MXFP4: the 16 FP4 (E2M1) values (quant.FP4_VALUES) and the E8M0 scales, 2^(byte - 127) (255: inf, as torch.ldexp)
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0 = np.array([2.0 ** (e - 127) for e in range(255)] + [np.inf], np.float32)


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy", inline="always")
def halves_to_floats(src, out_f, out_u, n):
    """out[:n] = the fp16 values whose bits are src[:n] (uint16), exactly, in two passes that
    vectorise: every element as a subnormal (man * 2^-24, exact in fp32), then the bits of the
    normal values (exponent rebiased by 127 - 15), infinities and nans over them."""
    for i in range(n):
        out_f[i] = np.float32(src[i] & np.uint16(0x3FF)) * np.float32(2.0 ** -24)
    for i in range(n):
        h = np.uint32(src[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        exp = h & np.uint32(0x7C00)
        bits = ((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(112 << 23)
        bits = bits + np.uint32(112 << 23) if exp == np.uint32(0x7C00) else bits
        out_u[i] = sign | (out_u[i] if exp == 0 else bits)


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy", inline="always")
def _half_at(halves, i):
    """The fp16 halves[i] (uint16 bits) as fp32, exactly: (1024 + mantissa) * 2^(exp - 25), or
    mantissa * 2^-24 when subnormal; both factors and their product are exact in fp32."""
    h = np.int64(halves[i])
    exp, man = (h >> 10) & 0x1F, np.float32(h & 0x3FF)
    if exp == 0x1F:
        v = np.float32(np.inf) if man == 0 else np.float32(np.nan)
    elif exp == 0:
        v = man * POW2[1]
    else:
        v = (np.float32(1024.0) + man) * POW2[exp]
    return -v if h & 0x8000 else v


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy")
def _decode_part(buf, row, dst):
    """One part of the blob (plan row `row`) into dst (float32, [rows * cols] flat)."""
    kind, n = row[ENCODING], row[ROWS] * row[COLS]
    start = row[VALUES]
    out_u = dst.view(np.uint32)
    if kind == RAW_F32:
        src = buf[start:start + 4 * n].view(np.uint32)
        for i in range(n):
            out_u[i] = src[i]
    elif kind == RAW_BF16:
        src16 = buf[start:start + 2 * n].view(np.uint16)
        for i in range(n):
            out_u[i] = np.uint32(src16[i]) << np.uint32(16)
    elif kind == RAW_F16:
        halves_to_floats(buf[start:start + 2 * n].view(np.uint16), dst, out_u, n)
    else:  # quantized: the packed row blocks
        _packed_part(buf, row, dst)


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy", inline="always")
def _packed_codes(buf, row, dst):
    """The codes of a packed int8/int4/MXFP4 matrix (plan row `row`; engine/quant.py's row-block layout) as
    floats into dst (float32, [rows * cols] flat): the code itself (integers), or its FP4 value."""
    R, C, g = row[ROWS], row[COLS], row[GROUP]
    groups = (C + g - 1) // g
    four = row[ENCODING] != INT8
    mx = row[ENCODING] == MXFP4
    per = 8 if four else 4  # columns of one 64-byte vector
    vecs = groups * g // per  # vectors of one block
    for blk in range((R + 15) // 16):
        for v in range(vecs):
            at = row[VALUES] + (blk * vecs + v) * 64
            c0 = v * per
            for lane in range(min(16, R - blk * 16)):
                out = dst[(blk * 16 + lane) * C:(blk * 16 + lane + 1) * C]
                for j in range(4):
                    b = buf[at + lane * 4 + j]
                    if four:
                        lo, hi = b & np.uint8(0xF), b >> np.uint8(4)
                        if c0 + j < C:
                            out[c0 + j] = FP4[lo] if mx else np.float32(lo)
                        if c0 + 4 + j < C:
                            out[c0 + 4 + j] = FP4[hi] if mx else np.float32(hi)
                    elif c0 + j < C:
                        out[c0 + j] = np.float32(b)


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy", inline="always")
def _packed_part(buf, row, dst):
    """A packed int8/int4/MXFP4 matrix (plan row `row`) into dst (float32, [rows * cols] flat): codes
    (_packed_codes), then each group scaled in place, `min + q * scale` or `(q - half) * scale` for integers
    (each operation rounded once in fp32, as torch does) and `value * 2^(e - 127)` for MXFP4."""
    _packed_codes(buf, row, dst)
    R, C, g = row[ROWS], row[COLS], row[GROUP]
    groups = (C + g - 1) // g
    mx = row[ENCODING] == MXFP4
    asym = row[MINS] >= 0
    half = np.float32(7.0 if row[ENCODING] == INT4 else 127.0)  # (2^bits - 1) // 2: the symmetric codes' zero
    lanes = ((R + 15) // 16) * groups * 16
    scales = buf[row[SCALES]:row[SCALES] + (lanes if mx else 2 * lanes)]
    halves = scales.view(np.uint16) if not mx else scales[:0].view(np.uint16)
    mins = buf[row[MINS]:row[MINS] + 2 * lanes].view(np.uint16) if asym else halves
    for r in range(R):
        out = dst[r * C:(r + 1) * C]
        for gi in range(groups):
            i = ((r // 16) * groups + gi) * 16 + r % 16  # the group's value for this row
            c0, c1 = gi * g, min(gi * g + g, C)
            if mx:
                sc = E8M0[scales[i]]
                for c in range(c0, c1):
                    out[c] = out[c] * sc
                continue
            sc = _half_at(halves, i)
            if asym:
                mn = _half_at(mins, i)
                for c in range(c0, c1):
                    out[c] = mn + out[c] * sc
            else:
                for c in range(c0, c1):
                    out[c] = (out[c] - half) * sc


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy", inline="always")
def decode_row(buf, row, r, out):
    """Row r of a float part of a blob (plan row `row`; a bias is one row) into out [cols] float32, the
    same values decode_blob writes there (the quantized-slot kernels read a slot's biases through it)."""
    kind, cols = row[ENCODING], row[COLS]
    if kind == RAW_F32:
        src = buf[row[VALUES] + 4 * r * cols:row[VALUES] + 4 * (r + 1) * cols].view(np.float32)
        for c in range(cols):
            out[c] = src[c]
    elif kind == RAW_BF16:
        src16 = buf[row[VALUES] + 2 * r * cols:row[VALUES] + 2 * (r + 1) * cols].view(np.uint16)
        out_u = out.view(np.uint32)
        for c in range(cols):
            out_u[c] = np.uint32(src16[c]) << np.uint32(16)
    elif kind == RAW_F16:
        halves_to_floats(buf[row[VALUES] + 2 * r * cols:row[VALUES] + 2 * (r + 1) * cols].view(np.uint16), out,
                          out.view(np.uint32), cols)


@njit(cache=True, _nrt=False, nogil=True, error_model="numpy")
def decode_blob(buf, plan, w13, w2, b13, b2):
    """buf uint8 [blob], plan int64 [parts, PLAN_COLUMNS] -> w13, w2 (and b13, b2 when the plan has
    four parts): flat float32 views of one slot's rows."""
    _decode_part(buf, plan[0], w13)
    _decode_part(buf, plan[1], w2)
    if plan.shape[0] > 2:
        _decode_part(buf, plan[2], b13)
        _decode_part(buf, plan[3], b2)
