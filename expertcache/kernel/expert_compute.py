"""Expert compute on the CPU, compiled: one decode token's k experts straight from their
cache slots in one call (gate/up products, the gated activation, down products and the
gate-weighted sum), instead of ~4 PyTorch operations per expert; and a window's experts,
grouped by slot. Computes in fp32 from fp32 slots or from 16-bit ones (`compiled.widen`:
exact); sums may be reassociated (SIMD), so results differ from PyTorch's by rounding only."""
from __future__ import annotations

import numpy as np
from numba import njit

from .compiled import widen
from .decode_blob import (
    COLS,
    ENCODING,
    GROUP,
    INT4,
    MINS,
    ROWS,
    SCALES,
    VALUES,
    decode_blob,
    decode_row,
    halves_to_floats,
)

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
        for h in range(0, H, 2):  # down rows in pairs share each load of act (1.7x when slots sit in cache)
            h2 = min(h + 1, H - 1)  # an odd last row pairs with itself
            y = np.float32(0.0)
            z = np.float32(0.0)
            for f in range(F):
                a = act[f]
                y += widen(w2[s, h, f]) * a
                z += widen(w2[s, h2, f]) * a
            if biased:
                y += gate * widen(b2[s, h])
                z += gate * widen(b2[s, h2])
            out[h] += y
            if h2 > h:
                out[h2] += z


ROW_BLOCK = 4  # rows of one expert's inputs that share each load of a weight row
PASS_ROWS = 256  # rows of one expert run in one pass: the scratch stays this size whatever the window


def window_scratch(assignments: int, S: int, H: int, F: int) -> tuple[np.ndarray, ...]:
    """The scratch experts_window needs for up to `assignments` (token, expert) pairs over S slots of
    [2F, H] and [H, F]: the counting sort (count [S + 1], order), one expert's weights and biases in
    float32, and one pass's rows of its inputs, products and activations."""
    return (np.empty(S + 1, np.int64), np.empty(assignments, np.int64), np.empty((2 * F, H), np.float32),
            np.empty((H, F), np.float32), np.empty(2 * F, np.float32), np.empty(H, np.float32),
            np.empty((PASS_ROWS, H), np.float32), np.empty((PASS_ROWS, max(2 * F, H)), np.float32),
            np.empty((PASS_ROWS, F), np.float32))


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def _block_dots(a, r, w, out, n, m):
    """out[r + i, c] = a[r + i, :m] . w[c, :m] for the ROW_BLOCK rows from r and c < n: each weight
    load serves four rows, and the four sums vectorise along m."""
    x0, x1, x2, x3 = a[r], a[r + 1], a[r + 2], a[r + 3]
    for c in range(n):
        wc = w[c]
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for h in range(m):
            v = wc[h]
            s0 += v * x0[h]
            s1 += v * x1[h]
            s2 += v * x2[h]
            s3 += v * x3[h]
        out[r, c], out[r + 1, c], out[r + 2, c], out[r + 3, c] = s0, s1, s2, s3


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def _sort_by_slot(slots, S, count, order):
    """Counting sort of the assignments t * k + j by slot: afterwards slot s's are order[count[s - 1]:count[s]]
    (from 0 for s = 0), in token order."""
    T, k = slots.shape
    for s in range(S + 1):
        count[s] = 0
    for t in range(T):
        for j in range(k):
            count[slots[t, j] + 1] += 1
    for s in range(S):
        count[s + 1] += count[s]
    for t in range(T):
        for j in range(k):
            order[count[slots[t, j]]] = t * k + j
            count[slots[t, j]] += 1


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def _run_slot(x, gates, order, start, end, wf13, wf2, b13, b2, biased, limit, alpha, xs, hs, acts, out):
    """out[t] += gate * expert(x[t]) for the assignments order[start:end] of one expert, whose weights are
    wf13 [2F, H] and wf2 [H, F] (and biases b13 [2F], b2 [H]) in float32: passes of up to PASS_ROWS rows in
    blocks of four (the last block repeats its last row)."""
    k = gates.shape[1]
    F, H = wf2.shape[1], x.shape[1]
    for first in range(start, end, PASS_ROWS):
        n = min(PASS_ROWS, end - first)
        blocks = (n + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK
        for i in range(blocks):
            t = order[first + min(i, n - 1)] // k
            for h in range(H):
                xs[i, h] = x[t, h]
        for i in range(0, blocks, ROW_BLOCK):
            _block_dots(xs, i, wf13, hs, 2 * F, H)
        for i in range(blocks):
            a = order[first + min(i, n - 1)]
            gate = gates[a // k, a % k]
            for f in range(F):
                g, u = hs[i, f], hs[i, F + f]
                if biased:
                    g += b13[f]
                    u += b13[F + f]
                acts[i, f] = gate * gated(g, u, limit, alpha)
        for i in range(0, blocks, ROW_BLOCK):
            _block_dots(acts, i, wf2, hs, H, F)
        for i in range(n):
            a = order[first + i]
            t = a // k
            if biased:
                gate = gates[t, a % k]
                for h in range(H):
                    out[t, h] += hs[i, h] + gate * b2[h]
            else:
                for h in range(H):
                    out[t, h] += hs[i, h]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def experts_window(x, slots, gates, w13, w2, b13, b2, limit, alpha, count, order, wf13, wf2, bf13, bf2, xs, hs, acts,
                   out):
    """A window's experts: x [T, H], slots [T, k] (int64), gates [T, k] float32; weights and biases
    as experts_token takes them; scratch from window_scratch -> out [T, H] = per token, the sum over
    j of gates[t, j] * expert_{slots[t, j]}(x[t]). The assignments are sorted by slot and each used
    slot's weights widened to float32 once, then its rows run together (`_run_slot`): one call, where
    PyTorch takes ~10 operations per expert."""
    S, F, H = w13.shape[0], w2.shape[2], x.shape[1]
    biased = b13.shape[0] > 0
    _sort_by_slot(slots, S, count, order)
    out[:] = 0.0
    start = 0
    for s in range(S):  # count[s] is now where slot s's assignments end
        if count[s] == start:
            continue
        for c in range(2 * F):
            for h in range(H):
                wf13[c, h] = widen(w13[s, c, h])
        for h in range(H):
            for f in range(F):
                wf2[h, f] = widen(w2[s, h, f])
        if biased:
            for c in range(2 * F):
                bf13[c] = widen(b13[s, c])
            for h in range(H):
                bf2[h] = widen(b2[s, h])
        _run_slot(x, gates, order, start, count[s], wf13, wf2, bf13, bf2, biased, limit, alpha, xs, hs, acts, out)
        start = count[s]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def experts_window_int(x, slots, gates, blobs, plan, limit, alpha, count, order, wf13, wf2, bf13, bf2, xs, hs, acts,
                       out):
    """experts_window over int8/int4 slots (blobs uint8 [S, bytes], read through `plan` as
    experts_token_int reads them): each used slot's blob decoded once into float32 weights
    (decode_blob: the values a fetch into fp32 slots writes), then its rows run together."""
    S, H = blobs.shape[0], x.shape[1]
    biased = plan.shape[0] > 2
    _sort_by_slot(slots, S, count, order)
    out[:] = 0.0
    start = 0
    for s in range(S):
        if count[s] == start:
            continue
        decode_blob(blobs[s], plan, wf13.reshape(-1), wf2.reshape(-1), bf13, bf2)
        _run_slot(x, gates, order, start, count[s], wf13, wf2, bf13, bf2, biased, limit, alpha, xs, hs, acts, out)
        start = count[s]


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def _groups(row):
    """Groups per row of an int8/int4 part (plan row `row`)."""
    return (row[COLS] + row[GROUP] - 1) // row[GROUP]


def int_work_floats(plan) -> int:
    """The float32 scratch experts_token_int needs for `plan`: biases, both vectors in lanes with
    their group sums, and both matrices' scales and minimums as floats."""
    (g0, g1), (H, F) = plan[:2, GROUP], plan[1, ROWS:COLS + 1]
    n0, n1 = plan[0, ROWS] * _groups(plan[0]), H * _groups(plan[1])
    return int(2 * F + H + 2 * (H + g0) + 2 * (F + g1) + 2 * n0 + 2 * n1)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def _lanes(v, n, g, four, lanes, sums):
    """v [n] laid out for _int_dot_pair: lanes = v padded with zeros to whole groups (int4: the
    even-indexed elements, then the odd ones, to meet a byte's low and high codes); sums[gi] =
    the sum of group gi."""
    m = (n + g - 1) // g * g
    if four:
        h = m // 2
        for j in range(h):
            lanes[j] = v[2 * j] if 2 * j < n else np.float32(0.0)
            lanes[h + j] = v[2 * j + 1] if 2 * j + 1 < n else np.float32(0.0)
    else:
        for c in range(m):
            lanes[c] = v[c] if c < n else np.float32(0.0)
    for gi in range(m // g):
        s = np.float32(0.0)
        for c in range(gi * g, min(gi * g + g, n)):
            s += v[c]
        sums[gi] = s


@njit(cache=True, _nrt=False, nogil=True, inline="always")
def _scales_as_floats(blob, row, scales, mins):
    """An int8/int4 part's fp16 scales (and minimums, when asymmetric) as float32, every row's."""
    n = row[ROWS] * _groups(row)
    halves_to_floats(blob[row[SCALES]:row[SCALES] + 2 * n].view(np.uint16), scales, scales.view(np.uint32), n)
    if row[MINS] >= 0:
        halves_to_floats(blob[row[MINS]:row[MINS] + 2 * n].view(np.uint16), mins, mins.view(np.uint32), n)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def _int_dot_pair(blob, row, r1, r2, lanes, sums, scales, mins):
    """Rows r1 and r2 of an int8/int4 part (plan row `row`) times a vector given as _lanes: per
    group, scale * (codes . v) + min * sum(v), or scale * (codes . v - zero * sum(v)) when
    symmetric. The codes are never dequantised: one conversion and one multiply-add per weight.
    Two rows at a time share each load of the vector (a gate row with its up row, or two down rows):
    ~25% faster than one at a time here."""
    g, groups = row[GROUP], _groups(row)
    four = row[ENCODING] == INT4
    code_cols = groups * g // 2 if four else groups * g
    at1, at2 = row[VALUES] + r1 * code_cols, row[VALUES] + r2 * code_cols
    c1, c2 = blob[at1:at1 + code_cols], blob[at2:at2 + code_cols]
    s1, m1 = scales[r1 * groups:(r1 + 1) * groups], mins[r1 * groups:(r1 + 1) * groups]
    s2, m2 = scales[r2 * groups:(r2 + 1) * groups], mins[r2 * groups:(r2 + 1) * groups]
    asym = row[MINS] >= 0
    zero = np.float32(7.0 if four else 127.0)
    y1 = np.float32(0.0)
    y2 = np.float32(0.0)
    # slices per group keep every index provably in range, which lets LLVM vectorise the loops; the
    # default group of 32 codes gets loops of a constant trip count, one vector each (int4 75 -> 63 us)
    n = g // 2 if four else g
    h = groups * g // 2
    for gi in range(groups):
        d1 = np.float32(0.0)
        d2 = np.float32(0.0)
        if four and n == 16:  # as below, with the trip count known
            a1, a2 = c1[gi * 16:(gi + 1) * 16], c2[gi * 16:(gi + 1) * 16]
            lo, hi = lanes[gi * 16:(gi + 1) * 16], lanes[h + gi * 16:h + (gi + 1) * 16]
            for j in range(16):
                v, w = lo[j], hi[j]
                d1 += np.float32(a1[j] & np.uint8(0xF)) * v + np.float32(a1[j] >> np.uint8(4)) * w
                d2 += np.float32(a2[j] & np.uint8(0xF)) * v + np.float32(a2[j] >> np.uint8(4)) * w
        elif four:  # a byte's low code meets the even lanes, its high code the odd ones
            a1, a2 = c1[gi * n:(gi + 1) * n], c2[gi * n:(gi + 1) * n]
            lo, hi = lanes[gi * n:(gi + 1) * n], lanes[h + gi * n:h + (gi + 1) * n]
            for j in range(a1.shape[0]):
                v, w = lo[j], hi[j]
                d1 += np.float32(a1[j] & np.uint8(0xF)) * v + np.float32(a1[j] >> np.uint8(4)) * w
                d2 += np.float32(a2[j] & np.uint8(0xF)) * v + np.float32(a2[j] >> np.uint8(4)) * w
        elif n == 32:
            a1, a2, v = c1[gi * 32:(gi + 1) * 32], c2[gi * 32:(gi + 1) * 32], lanes[gi * 32:(gi + 1) * 32]
            for j in range(32):
                d1 += np.float32(a1[j]) * v[j]
                d2 += np.float32(a2[j]) * v[j]
        else:
            a1, a2, v = c1[gi * n:(gi + 1) * n], c2[gi * n:(gi + 1) * n], lanes[gi * n:(gi + 1) * n]
            for j in range(a1.shape[0]):
                d1 += np.float32(a1[j]) * v[j]
                d2 += np.float32(a2[j]) * v[j]
        if asym:
            y1 += s1[gi] * d1 + m1[gi] * sums[gi]
            y2 += s2[gi] * d2 + m2[gi] * sums[gi]
        else:
            y1 += s1[gi] * (d1 - zero * sums[gi])
            y2 += s2[gi] * (d2 - zero * sums[gi])
    return y1, y2


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def experts_token_int(x, slots, gates, blobs, plan, limit, alpha, work, act, out):
    """experts_token over int8/int4 slots: blobs uint8 [S, bytes], each slot one expert's encoded blob
    as the disk store keeps it, read through plan int64 [parts, PLAN_COLUMNS] (quant.decode_plan),
    computing from the codes: each product is a sum over groups of scale
    * (codes . v) + min * sum(v), so no weight is dequantised. Equal to experts_token over the
    dequantised slots up to the order of its sums. work float32 [int_work_floats(plan)], act [F]
    scratch -> out [H]."""
    H = x.shape[0]
    F = plan[1, COLS]
    biased = plan.shape[0] > 2
    four = plan[0, ENCODING] == INT4
    g0, g1 = plan[0, GROUP], plan[1, GROUP]
    n0, n1 = plan[0, ROWS] * _groups(plan[0]), H * _groups(plan[1])
    b13, work = work[:2 * F], work[2 * F:]
    b2, work = work[:H], work[H:]
    x_lanes, work = work[:H + g0], work[H + g0:]
    x_sums, work = work[:H + g0], work[H + g0:]
    a_lanes, work = work[:F + g1], work[F + g1:]
    a_sums, work = work[:F + g1], work[F + g1:]
    sc0, work = work[:n0], work[n0:]
    mn0, work = work[:n0], work[n0:]
    sc1, mn1 = work[:n1], work[n1:2 * n1]
    _lanes(x, H, g0, four, x_lanes, x_sums)
    for h in range(H):
        out[h] = 0.0
    for j in range(slots.shape[0]):
        blob, gate = blobs[slots[j]], gates[j]
        _scales_as_floats(blob, plan[0], sc0, mn0)
        _scales_as_floats(blob, plan[1], sc1, mn1)
        if biased:
            decode_row(blob, plan[2], 0, b13)
            decode_row(blob, plan[3], 0, b2)
        for f in range(F):
            g, u = _int_dot_pair(blob, plan[0], f, F + f, x_lanes, x_sums, sc0, mn0)
            if biased:
                g += b13[f]
                u += b13[F + f]
            act[f] = gate * gated(g, u, limit, alpha)
        _lanes(act, F, g1, four, a_lanes, a_sums)
        for h in range(0, H, 2):
            h2 = min(h + 1, H - 1)  # an odd last row pairs with itself
            y, z = _int_dot_pair(blob, plan[1], h, h2, a_lanes, a_sums, sc1, mn1)
            if biased:
                y += gate * b2[h]
                z += gate * b2[h2]
            out[h] += y
            if h2 > h:
                out[h2] += z
