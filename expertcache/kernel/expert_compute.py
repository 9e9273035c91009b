"""Expert compute on the CPU, compiled: one decode token's k experts straight from their cache slots
(gate/up products, the gated activation, down products and the gate-weighted sum), and a window's
experts grouped by slot, in any slot format (kernel.matvec: float slots widened in registers,
quantized slots from their codes), split across `parts` threads.

A slot's parts are matrices as matvec takes them: buf13 / buf2 [S, bytes] uint8 (a quantized slot's blob
in both, or a float slot's w13 and w2 bytes) with plan rows row13 / row2, and the biases likewise
(bbuf13 / bbuf2 with rows brow13 / brow2, float; buffers of shape [0, 0] where the family has none).

A decode token runs in two parallel phases: every expert's gate/up rows shared among the threads, then
the down products by output rows (each thread adds up its rows over the k experts). Its experts can also
run some at a time as their reads land (`experts_of_token`, then `experts_token_sum`), over the same row
ranges and summed in the same order: the same output, bit for bit. A window sorts its
(token, expert) assignments by slot, gathers each slot's inputs into consecutive rows and runs the same
two phases on passes of at most PASS assignments (their scratch stays that size whatever the window; a
slot with more assignments than that takes several passes):
each thread takes a range of every used slot's row blocks, one slot after another, so that a slot's
inputs stay in cache while its rows stream by."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .decode_blob import COLS, GROUP, ROWS, decode_row
from .matvec import is_quantized, matmul_rows, matvec_rows, quantize_activations, row_unit, split

FAST = {"reassoc", "contract"}  # reassoc/contract let LLVM vectorise the sums; inf and nan keep their meaning
PASS = 512  # (token, expert) assignments of one pass of a window


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def gated(g, u, limit, alpha):
    """The gated activation of one (gate, up) pair: GPT-OSS's clamped form when limit > 0, else silu(g) * u."""
    if limit > 0:
        g = min(g, limit)
        u = min(max(u, -limit), limit)
        return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-g * alpha)))
    return g / (np.float32(1.0) + np.exp(-g)) * u


def _codes(n: int, cols: int, group: int) -> tuple[np.ndarray, ...]:
    """Scratch for n vectors of `cols` activations quantized in groups of `group` (quantize_activations):
    codes, scales, sums, code sums; a single column where the matrix is float (group 1) and none is used."""
    width, groups = (-(-cols // group) * group, -(-cols // group)) if group > 1 else (1, 1)
    return (np.empty((n, width), np.int8), np.empty((n, groups), np.float32), np.empty((n, groups), np.float32),
            np.empty((n, groups), np.int32))


def token_work(k: int, H: int, F: int, G13: int, G2: int, parts: int) -> tuple[np.ndarray, ...]:
    """experts_token's scratch for k experts of hidden size H and width F, activation groups G13 (the gate/up
    matrices') and G2 (the down matrices'; 1 for float matrices: `activation_group`) and `parts` threads."""
    xq, xd, xs, xqs = _codes(1, H, G13)
    return (xq[0], xd[0], xs[0], xqs[0], np.empty((k, 2 * F), np.float32), np.empty((k, F), np.float32),
            *_codes(k, F, G2), np.empty((k, H), np.float32), np.empty(2 * F, np.float32),
            np.empty((parts, H), np.float32), np.empty(H, np.float32))


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _gate_up_units(x, slots, buf13, row13, xq, xd, xs, xqs, h, first, end, n13):
    """Units [first, end) of a token's gate/up products: unit u is expert u // n13's row unit u % n13."""
    unit, rows = row_unit(row13), row13[ROWS]
    for u in range(first, end):
        j, blk = u // n13, u % n13
        matvec_rows(buf13[slots[j]], row13, x, xq, xd, xs, xqs, h[j], blk * unit, min(rows, (blk + 1) * unit))


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _down_one(j, slots, buf2, row2, act, aq, ad, asum, aqs, y, first, end):
    """Output row units [first, end) of expert j's down products into y[j]."""
    unit, H = row_unit(row2), row2[ROWS]
    r0, r1 = first * unit, min(H, end * unit)
    if r0 < r1:
        matvec_rows(buf2[slots[j]], row2, act[j], aq[j], ad[j], asum[j], aqs[j], y[j], r0, r1)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _sum_rows(bsum, y, k, out, r0, r1):
    """out[r] = bsum[r] + y[0, r] + ... + y[k - 1, r] for rows [r0, r1), in that order: a token's experts run
    together or one by one give the same sums."""
    for r in range(r0, r1):
        s = bsum[r]
        for j in range(k):
            s += y[j, r]
        out[r] = s


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _down_units(slots, buf2, row2, act, aq, ad, asum, aqs, y, bsum, out, first, end):
    """Output row units [first, end) of a token's down products, summed over its k experts into out."""
    unit, H = row_unit(row2), row2[ROWS]
    r0, r1 = first * unit, min(H, end * unit)
    if r0 >= r1:
        return
    for j in range(slots.shape[0]):
        _down_one(j, slots, buf2, row2, act, aq, ad, asum, aqs, y, first, end)
    _sum_rows(bsum, y, slots.shape[0], out, r0, r1)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _quantize(x, g, xq, xd, xs, xqs):
    """quantize_activations, as a call of its own: a parallel function's body keeps only its prange loops and
    calls (numba's parallel passes, applied to inlined loops, miscompiled some shapes)."""
    quantize_activations(x, g, xq, xd, xs, xqs)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _activation(j, slots, gates, bbuf13, brow13, row2, limit, alpha, h, act, aq, ad, asum, aqs, b13):
    """Expert j's gated activations act[j] [F] times its gate (and their quantized form for a quantized down
    matrix), from its gate/up products h[j] [2F] and gate/up biases (b13 [2F] as scratch)."""
    F, gate = row2[COLS], gates[j]
    if bbuf13.shape[0] > 0:
        decode_row(bbuf13[slots[j]], brow13, 0, b13)
        for f in range(F):
            act[j, f] = gate * gated(h[j, f] + b13[f], h[j, F + f] + b13[F + f], limit, alpha)
    else:
        for f in range(F):
            act[j, f] = gate * gated(h[j, f], h[j, F + f], limit, alpha)
    if is_quantized(row2):
        quantize_activations(act[j], row2[GROUP], aq[j], ad[j], asum[j], aqs[j])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _down_bias_sum(slots, gates, bbuf2, brow2, b2, bsum):
    """bsum [H] = the gate-weighted sum of a token's experts' down biases (0 where the family has none; b2 [H] as
    scratch)."""
    for r in range(bsum.shape[0]):
        bsum[r] = 0.0
    if bbuf2.shape[0] > 0:
        for j in range(slots.shape[0]):
            decode_row(bbuf2[slots[j]], brow2, 0, b2)
            for r in range(bsum.shape[0]):
                bsum[r] += gates[j] * b2[r]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _token_activations(slots, gates, bbuf13, brow13, bbuf2, brow2, row2, limit, alpha, h, act, aq, ad, asum, aqs,
                       b13, b2, bsum):
    """A token's gated activations act [k, F] times its gates (`_activation` of each expert) and the
    gate-weighted sum of its down biases bsum [H]."""
    _down_bias_sum(slots, gates, bbuf2, brow2, b2, bsum)
    for j in range(slots.shape[0]):
        _activation(j, slots, gates, bbuf13, brow13, row2, limit, alpha, h, act, aq, ad, asum, aqs, b13)


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def experts_token(x, slots, gates, buf13, row13, buf2, row2, bbuf13, brow13, bbuf2, brow2, limit, alpha, work, out,
                  parts):
    """x [H] float32, slots [k] int64, gates [k] float32, the slots' matrices (see the module) ->
    out [H] = sum_j gates[j] * expert_{slots[j]}(x), over `parts` threads; work: token_work's scratch."""
    xq, xd, xs, xqs, h, act, aq, ad, asum, aqs, y, b13, bias2, b2 = work
    k, H = slots.shape[0], x.shape[0]
    if is_quantized(row13):
        _quantize(x, row13[GROUP], xq, xd, xs, xqs)
    n13 = (row13[ROWS] + row_unit(row13) - 1) // row_unit(row13)
    if parts == 1:
        _gate_up_units(x, slots, buf13, row13, xq, xd, xs, xqs, h, 0, k * n13, n13)
    else:
        for p in prange(parts):
            first, end = split(k * n13, p, parts)
            _gate_up_units(x, slots, buf13, row13, xq, xd, xs, xqs, h, first, end, n13)
    bsum = bias2[0]
    _token_activations(slots, gates, bbuf13, brow13, bbuf2, brow2, row2, limit, alpha, h, act, aq, ad, asum, aqs,
                       b13, b2, bsum)
    n2 = (H + row_unit(row2) - 1) // row_unit(row2)
    if parts == 1:
        _down_units(slots, buf2, row2, act, aq, ad, asum, aqs, y, bsum, out, 0, n2)
    else:
        for p in prange(parts):
            first, end = split(n2, p, parts)
            _down_units(slots, buf2, row2, act, aq, ad, asum, aqs, y, bsum, out, first, end)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _gate_up_which(x, which, slots, buf13, row13, xq, xd, xs, xqs, h, first, end, n13):
    """Units [first, end) of the gate/up products of the token's experts `which`: unit u is expert
    which[u // n13]'s row unit u % n13 (as `_gate_up_units`' rows)."""
    unit, rows = row_unit(row13), row13[ROWS]
    for u in range(first, end):
        j, blk = which[u // n13], u % n13
        matvec_rows(buf13[slots[j]], row13, x, xq, xd, xs, xqs, h[j], blk * unit, min(rows, (blk + 1) * unit))


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def experts_of_token(x, which, first, slots, gates, buf13, row13, buf2, row2, bbuf13, brow13, limit, alpha, work,
                     parts):
    """The token's experts `which` [m] (indices into slots) alone, experts_token's other arguments as it takes
    them: their gate/up products, activations and down products into the scratch's y[j], not yet summed, so
    that experts resident while the token's other reads land run meanwhile (`experts_token_sum` ends the
    token, with experts_token's sums). `first`: the token's first such call, which quantizes x for quantized
    gate/up matrices."""
    xq, xd, xs, xqs, h, act, aq, ad, asum, aqs, y, b13, bias2, b2 = work
    if first and is_quantized(row13):
        _quantize(x, row13[GROUP], xq, xd, xs, xqs)
    m, n13 = which.shape[0], (row13[ROWS] + row_unit(row13) - 1) // row_unit(row13)
    if parts == 1:
        _gate_up_which(x, which, slots, buf13, row13, xq, xd, xs, xqs, h, 0, m * n13, n13)
    else:
        for p in prange(parts):
            u0, u1 = split(m * n13, p, parts)
            _gate_up_which(x, which, slots, buf13, row13, xq, xd, xs, xqs, h, u0, u1, n13)
    for i in range(m):
        _activation(which[i], slots, gates, bbuf13, brow13, row2, limit, alpha, h, act, aq, ad, asum, aqs, b13)
    n2 = (x.shape[0] + row_unit(row2) - 1) // row_unit(row2)  # the down products by experts_token's row ranges
    if parts == 1:
        for i in range(m):
            _down_one(which[i], slots, buf2, row2, act, aq, ad, asum, aqs, y, 0, n2)
    else:
        for p in prange(parts):
            r0, r1 = split(n2, p, parts)
            for i in range(m):
                _down_one(which[i], slots, buf2, row2, act, aq, ad, asum, aqs, y, r0, r1)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def experts_token_sum(slots, gates, bbuf2, brow2, work, out):
    """out [H] = the gate-weighted down biases plus y[0] + ... + y[k - 1], once `experts_of_token` has run every
    expert of the token: the same sums as experts_token's."""
    y, bias2, b2 = work[10], work[12], work[13]
    _down_bias_sum(slots, gates, bbuf2, brow2, b2, bias2[0])
    _sum_rows(bias2[0], y, slots.shape[0], out, 0, out.shape[0])


def window_work(T: int, k: int, S: int, H: int, F: int, G13: int, G2: int, parts: int) -> tuple[np.ndarray, ...]:
    """experts_window's scratch for windows of up to T tokens over S slots (as token_work's arguments)."""
    A = min(PASS, T * k)  # one pass's assignments
    return (np.empty(S + 1, np.int64), np.empty(T * k, np.int64), np.empty(S, np.int64), np.empty(S + 1, np.int64),
            np.empty(S, np.int64), np.empty(A, np.int64), *_codes(T, H, G13), np.empty((1 if G13 > 1 else A, H), np.float32),
            *_codes(A, H, G13), np.empty((A, 2 * F), np.float32), np.empty((A, F), np.float32), *_codes(A, F, G2),
            np.empty((A, H), np.float32), np.empty((parts, max(2 * F, H)), np.float32))


@njit(cache=True, _nrt=False, nogil=True)
def _sort_by_slot(slots, gates, S, count, order):
    """Counting sort of the assignments t * k + j with a nonzero gate by slot (padding has gate 0): afterwards
    slot s's are order[count[s - 1]:count[s]] (from 0 for s = 0), in token order; returns how many there are."""
    T, k = slots.shape
    for s in range(S + 1):
        count[s] = 0
    for t in range(T):
        for j in range(k):
            if gates[t, j] != 0:
                count[slots[t, j] + 1] += 1
    for s in range(S):
        count[s + 1] += count[s]
    for t in range(T):
        for j in range(k):
            if gates[t, j] != 0:
                order[count[slots[t, j]]] = t * k + j
                count[slots[t, j]] += 1
    return count[S - 1] if S > 0 else 0


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _window_rows(used, starts, ends, u0, u1, base, buf, row, x, xq, xd, xs, xqs, out, first, end):
    """Row units [first, end) of one phase of a pass, for each used slot u in [u0, u1) in turn: its
    assignments' rows max(starts[u], base) - base .. ends[u] - base of x (or its quantized xq, ...) times the
    slot's matrix into the same rows of out."""
    unit, rows = row_unit(row), row[ROWS]
    r0, r1 = first * unit, min(rows, end * unit)
    if r0 >= r1:
        return
    for u in range(u0, u1):
        a0, a1 = max(starts[u], base) - base, ends[u] - base
        matmul_rows(buf[used[u]], row, x[a0:a1], xq[a0:a1], xd[a0:a1], xs[a0:a1], xqs[a0:a1], out[a0:a1], r0, r1)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _gather(x, order, k, base, q, tq, td, ts, tqs, gx, gq, gd, gs, gqs, a0, a1):
    """Rows [a0, a1) of a pass's inputs in slot order: assignment base + a's token's x row, or its quantized form."""
    for a in range(a0, a1):
        t = order[base + a] // k
        if q:
            for c in range(tq.shape[1]):
                gq[a, c] = tq[t, c]
            for c in range(td.shape[1]):
                gd[a, c], gs[a, c], gqs[a, c] = td[t, c], ts[t, c], tqs[t, c]
        else:
            for c in range(x.shape[1]):
                gx[a, c] = x[t, c]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _activations(order, k, gates, base, slot_of, bbuf13, brow13, limit, alpha, F, q2, g2, h, act, aq, ad, asum, aqs,
                 b13, a0, a1):
    """Rows [a0, a1) of a pass's gated activations times each assignment's gate (and their quantized form for
    quantized down matrices); slot_of[a]: the slot of pass row a; b13 [2F] scratch."""
    biased = bbuf13.shape[0] > 0
    last = -1
    for a in range(a0, a1):
        e = order[base + a]
        gate = gates[e // k, e % k]
        if biased:
            if slot_of[a] != last:
                last = slot_of[a]
                decode_row(bbuf13[last], brow13, 0, b13)
            for f in range(F):
                act[a, f] = gate * gated(h[a, f] + b13[f], h[a, F + f] + b13[F + f], limit, alpha)
        else:
            for f in range(F):
                act[a, f] = gate * gated(h[a, f], h[a, F + f], limit, alpha)
        if q2:
            quantize_activations(act[a], g2, aq[a], ad[a], asum[a], aqs[a])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _scatter(order, k, gates, base, n, slot_of, bbuf2, brow2, y, out, b2, c0, c1):
    """Columns [c0, c1) of each of a pass's n outputs added into its token's row of out (with gate * b2 of its
    slot when the family has biases; b2 [H] scratch)."""
    biased = bbuf2.shape[0] > 0
    last = -1
    for a in range(n):
        e = order[base + a]
        t = e // k
        if biased:
            if slot_of[a] != last:
                last = slot_of[a]
                decode_row(bbuf2[last], brow2, 0, b2)
            gate = gates[t, e % k]
            for c in range(c0, c1):
                out[t, c] += y[a, c] + gate * b2[c]
        else:
            for c in range(c0, c1):
                out[t, c] += y[a, c]


@njit(cache=True, _nrt=False, nogil=True)
def _used_slots(slots, gates, S, count, order, used, starts, out):
    """A window's plan: its assignments sorted by slot (_sort_by_slot), used [U] the slots they use in order,
    starts [U + 1] where each one's assignments begin (and end); out zeroed. Returns U."""
    A = _sort_by_slot(slots, gates, S, count, order)
    U = 0
    begin = 0
    for s in range(S):
        if count[s] > begin:
            used[U], starts[U] = s, begin
            U += 1
        begin = count[s]
    starts[U] = A
    for t in range(out.shape[0]):
        for c in range(out.shape[1]):
            out[t, c] = 0.0
    return U


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _quantize_rows(x, g, tq, td, ts, tqs, t0, t1):
    """Rows [t0, t1) of x [T, H] quantized (quantize_activations) into the rows of tq, td, ts, tqs."""
    for t in range(t0, t1):
        quantize_activations(x[t], g, tq[t], td[t], ts[t], tqs[t])


@njit(cache=True, _nrt=False, nogil=True)
def _next_pass(used, starts, U, u0, base, cap, slot_of, ends):
    """The pass that starts at assignment `base` (in used slot u0's range): the used slots it reaches,
    [u0, u1), each ending at the slot's end or at base + cap, whichever comes first (a pass ends at a slot's
    end where one lies within cap, so that a slot's rows split across passes only when it has more than cap
    assignments); ends[u] the end of slot u's part in this pass; slot_of[a] = the slot of pass row a.
    Returns u1."""
    limit = base + cap
    u1 = u0 + 1
    while u1 < U and starts[u1 + 1] <= limit:
        u1 += 1
    for u in range(u0, u1):
        ends[u] = min(starts[u + 1], limit)
        for a in range(max(starts[u], base) - base, ends[u] - base):
            slot_of[a] = used[u]
    return u1


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def experts_window(x, slots, gates, buf13, row13, buf2, row2, bbuf13, brow13, bbuf2, brow2, limit, alpha, work, out,
                   parts):
    """A window's experts: x [T, H] float32, slots [T, k] int64, gates [T, k] float32 (gate 0: padding,
    skipped), the slots' matrices (see the module) -> out [T, H] = per token, the sum over j of
    gates[t, j] * expert_{slots[t, j]}(x[t]), over `parts` threads; work: window_work's scratch."""
    (count, order, used, starts, ends, slot_of, tq, td, ts, tqs, gx, gq, gd, gs, gqs, h, act, aq, ad, asum, aqs, y,
     scratch) = work
    T, k = slots.shape
    H, F = x.shape[1], row2[COLS]
    q13, q2 = is_quantized(row13), is_quantized(row2)
    U = _used_slots(slots, gates, buf13.shape[0], count, order, used, starts, out)
    if q13:  # each token's input quantized once, whichever experts it runs
        if parts == 1:
            _quantize_rows(x, row13[GROUP], tq, td, ts, tqs, 0, T)
        else:
            for p in prange(parts):
                t0, t1 = split(T, p, parts)
                _quantize_rows(x, row13[GROUP], tq, td, ts, tqs, t0, t1)
    n13 = (row13[ROWS] + row_unit(row13) - 1) // row_unit(row13)
    n2 = (H + row_unit(row2) - 1) // row_unit(row2)
    cap = h.shape[0]
    u0, base = 0, 0
    while u0 < U:  # passes of at most `cap` assignments (see _next_pass)
        u1 = _next_pass(used, starts, U, u0, base, cap, slot_of, ends)
        n = ends[u1 - 1] - base
        if parts == 1:
            _gather(x, order, k, base, q13, tq, td, ts, tqs, gx, gq, gd, gs, gqs, 0, n)
            _window_rows(used, starts, ends, u0, u1, base, buf13, row13, gx, gq, gd, gs, gqs, h, 0, n13)
            _activations(order, k, gates, base, slot_of, bbuf13, brow13, limit, alpha, F, q2, row2[GROUP], h, act, aq,
                         ad, asum, aqs, scratch[0], 0, n)
            _window_rows(used, starts, ends, u0, u1, base, buf2, row2, act, aq, ad, asum, aqs, y, 0, n2)
            _scatter(order, k, gates, base, n, slot_of, bbuf2, brow2, y, out, scratch[0], 0, H)
        else:
            for p in prange(parts):
                a0, a1 = split(n, p, parts)
                _gather(x, order, k, base, q13, tq, td, ts, tqs, gx, gq, gd, gs, gqs, a0, a1)
            for p in prange(parts):
                f0, f1 = split(n13, p, parts)
                _window_rows(used, starts, ends, u0, u1, base, buf13, row13, gx, gq, gd, gs, gqs, h, f0, f1)
            for p in prange(parts):
                a0, a1 = split(n, p, parts)
                _activations(order, k, gates, base, slot_of, bbuf13, brow13, limit, alpha, F, q2, row2[GROUP], h, act,
                             aq, ad, asum, aqs, scratch[p], a0, a1)
            for p in prange(parts):
                f0, f1 = split(n2, p, parts)
                _window_rows(used, starts, ends, u0, u1, base, buf2, row2, act, aq, ad, asum, aqs, y, f0, f1)
            for p in prange(parts):
                c0, c1 = split(H, p, parts)
                _scatter(order, k, gates, base, n, slot_of, bbuf2, brow2, y, out, scratch[p], c0, c1)
        base += n
        u0 = u1 if ends[u1 - 1] == starts[u1] else u1 - 1  # a slot cut by the pass's end goes on in the next


def activation_group(row: np.ndarray) -> int:
    """The group a quantized matrix's activations are quantized in (its own), or 1 for a float matrix: the
    G13 / G2 that token_work and window_work take."""
    return int(row[GROUP]) if int(row[0]) >= 3 else 1
