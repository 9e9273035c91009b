"""Matrix products over every weight format the engine keeps, compiled: rows of one matrix times one
token (decode) or several (a window). A matrix is a byte buffer and a plan row (decode_blob's columns:
encoding, offsets of values / codes, scales and minimums, rows, columns, group size), whether it is a
part of an expert's blob, a float slot's bytes or a dense weight, so one code path serves them all:

- float (fp32, fp16, bf16): each weight widened to fp32 in registers (simd.fdot4, simd.ftile); exact
  products, sums in another order than PyTorch's;
- quantized (int8, int4, MXFP4, engine/quant.py's packed row blocks): the token's activations are
  quantized once per group to int8 (`quantize_activations`, as llama.cpp's Q8 activations), then integer
  dot products per group (simd.qblock1, simd.qblock4), the groups' scales applied after them.

Row ranges let a caller split one product across threads (the `*_parallel` functions of
expert_compute.py and dense_decode.py): float rows go in fours, quantized rows in blocks of 16.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import simd
from .decode_blob import COLS, ENCODING, GROUP, INT8, MINS, MXFP4, RAW_BF16, RAW_F32, ROWS, SCALES, VALUES

FAST = {"reassoc", "contract"}  # as in expert_compute: vectorised sums, inf and nan keep their meaning
BLOCK = simd.ROWS  # rows of a packed block
Q8_MAX = np.float32(127.0)


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def is_quantized(row) -> bool:
    """Whether plan row `row` describes a packed quantized matrix (else a float one)."""
    return row[ENCODING] >= INT8


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def row_unit(row) -> int:
    """The rows a split of this matrix's rows must keep together: a packed block, or fdot4's four."""
    return BLOCK if row[ENCODING] >= INT8 else 4


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def groups_of(row) -> int:
    """Activation groups of a quantized matrix's columns (1 for a float matrix)."""
    return (row[COLS] + row[GROUP] - 1) // row[GROUP] if row[ENCODING] >= INT8 else 1


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def quantize_activations(x, g, xq, xd, xs, xqs):
    """x [n] float32 -> per group of g values: xq int8 codes round(x / d) (zeros after n, up to whole groups),
    xd the scale d = max |x| / 127, xs the float sum, xqs the code sum. A group holding a nan or an infinity
    gets a nan scale, so that the products it enters are not finite either."""
    n = x.shape[0]
    for gi in range((n + g - 1) // g):
        c0, c1 = gi * g, min(gi * g + g, n)
        amax = np.float32(0.0)
        for c in range(c0, c1):
            amax = max(amax, abs(x[c]))
        inv = Q8_MAX / amax if amax > 0 else np.float32(0.0)
        total = np.float32(0.0)
        codes = 0
        for c in range(c0, c1):
            total += x[c]
        if not np.isfinite(total):
            inv = np.float32(0.0)
        for c in range(c0, c1):
            q = np.int32(np.rint(x[c] * inv))
            xq[c] = q
            codes += q
        for c in range(c1, gi * g + g):
            xq[c] = 0
        xd[gi] = amax / Q8_MAX if np.isfinite(total) else np.float32(np.nan)
        xs[gi] = total
        xqs[gi] = codes


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def _vectors_per_group(row) -> int:
    return row[GROUP] // (4 if row[ENCODING] == INT8 else 8)


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def _scale_bytes(row) -> int:
    return 1 if row[ENCODING] == MXFP4 else 2


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def matvec_rows(buf, row, x, xq, xd, xs, xqs, out, r0, r1):
    """out[r] = row r of the matrix (buf uint8, plan row `row`) . x for r in [r0, r1), r0 a multiple of
    row_unit(row) and r1 one or the matrix's rows: a float matrix from x [cols] float32, a quantized one
    from x's quantize_activations with the matrix's group size (xq, xd, xs, xqs)."""
    enc, R, C = row[ENCODING], row[ROWS], row[COLS]
    at = row[VALUES]
    if enc >= INT8:
        groups, gv = groups_of(row), _vectors_per_group(row)
        per_block = groups * gv * simd.VEC
        lanes = groups * BLOCK * _scale_bytes(row)
        for blk in range(r0 // BLOCK, (r1 + BLOCK - 1) // BLOCK):
            simd.qblock1(enc, row[MINS] >= 0, buf, at + blk * per_block, buf, row[SCALES] + blk * lanes, buf,
                         max(row[MINS], 0) + blk * lanes, groups, gv, xq, 0, 0, xd, xs, xqs, 0, 0, out, blk * BLOCK,
                         0, min(BLOCK, R - blk * BLOCK))
        return
    if enc == RAW_F32:
        w32 = buf[at:at + 4 * R * C].view(np.float32)
        for r in range(r0, r1 - 3, 4):
            simd.fdot4(w32, r * C, C, C, x, 0, out, r)
        for r in range(r1 - (r1 - r0) % 4, r1):
            simd.fdot1(w32, r * C, C, C, x, 0, out, r)
        return
    w16 = buf[at:at + 2 * R * C].view(np.uint16)
    if enc == RAW_BF16:
        wb = w16.view(np.int16)
        for r in range(r0, r1 - 3, 4):
            simd.fdot4(wb, r * C, C, C, x, 0, out, r)
        for r in range(r1 - (r1 - r0) % 4, r1):
            simd.fdot1(wb, r * C, C, C, x, 0, out, r)
        return
    for r in range(r0, r1 - 3, 4):
        simd.fdot4(w16, r * C, C, C, x, 0, out, r)
    for r in range(r1 - (r1 - r0) % 4, r1):
        simd.fdot1(w16, r * C, C, C, x, 0, out, r)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def _float_tiles(w, R, C, x, T, out, r0, r1):
    """out[t, r] = w row r . x[t] for t < T, r in [r0, r1), w a flat float matrix [R, C] (fp32, or fp16 /
    bf16 bits): 4 x 4 tiles, then the rows and tokens left over four at a time or alone."""
    rows4 = r0 + (r1 - r0) // 4 * 4
    T4 = T // 4 * 4
    xf, of = x.reshape(-1), out.reshape(-1)
    for r in range(r0, rows4, 4):
        for t in range(0, T4, 4):
            simd.ftile(w, r * C, C, C, xf, t * C, C, of, t * R + r, R)
        for t in range(T4, T):
            simd.fdot4(w, r * C, C, C, xf, t * C, of, t * R + r)
    for r in range(rows4, r1):
        for t in range(T):
            simd.fdot1(w, r * C, C, C, xf, t * C, of, t * R + r)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def matmul_rows(buf, row, x, xq, xd, xs, xqs, out, r0, r1):
    """out[t, r] = row r of the matrix . x[t] for every token t and r in [r0, r1) (as matvec_rows):
    x [T, cols] float32, or for a quantized matrix its tokens' quantize_activations (xq [T, groups * g],
    xd, xs, xqs [T, groups]); out [T, rows]. Quantized blocks take four tokens at a time (simd.qblock4)."""
    enc, R, C = row[ENCODING], row[ROWS], row[COLS]
    at = row[VALUES]
    if enc >= INT8:
        T = xq.shape[0]
        groups, gv = groups_of(row), _vectors_per_group(row)
        per_block = groups * gv * simd.VEC
        lanes = groups * BLOCK * _scale_bytes(row)
        width = xq.shape[1]
        xqf, xdf, xsf, xqsf, of = xq.reshape(-1), xd.reshape(-1), xs.reshape(-1), xqs.reshape(-1), out.reshape(-1)
        asym = row[MINS] >= 0
        T4 = T // 4 * 4
        for blk in range(r0 // BLOCK, (r1 + BLOCK - 1) // BLOCK):
            code_at, scale_at, min_at = at + blk * per_block, row[SCALES] + blk * lanes, max(row[MINS], 0) + blk * lanes
            n = min(BLOCK, R - blk * BLOCK)
            for t in range(0, T4, 4):
                simd.qblock4(enc, asym, buf, code_at, buf, scale_at, buf, min_at, groups, gv, xqf, t * width, width,
                             xdf, xsf, xqsf, t * groups, groups, of, t * R + blk * BLOCK, R, n)
            for t in range(T4, T):
                simd.qblock1(enc, asym, buf, code_at, buf, scale_at, buf, min_at, groups, gv, xqf, t * width, 0,
                             xdf, xsf, xqsf, t * groups, 0, of, t * R + blk * BLOCK, 0, n)
        return
    T = x.shape[0]
    if enc == RAW_F32:
        _float_tiles(buf[at:at + 4 * R * C].view(np.float32), R, C, x, T, out, r0, r1)
    elif enc == RAW_BF16:
        _float_tiles(buf[at:at + 2 * R * C].view(np.int16), R, C, x, T, out, r0, r1)
    else:
        _float_tiles(buf[at:at + 2 * R * C].view(np.uint16), R, C, x, T, out, r0, r1)


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def split(n_units, part, parts):
    """Units [first, end) of part `part` of `parts` equal shares of n_units."""
    return n_units * part // parts, n_units * (part + 1) // parts


def activation_width(cols: int, group: int) -> int:
    """int8 activation codes a quantized matrix of `cols` columns and group `group` reads: whole groups."""
    return -(-cols // group) * group
