"""Decode's dense path on the CPU, compiled: one token's attention block (norm, q/k/v projection,
q/k norms, RoPE, the KV-cache write, grouped-query attention with an optional sliding window and
sinks, the output projection and the residual add) and the MoE input's norm in one call per
layer, where PyTorch runs ~25 operations whose per-call overhead is most of a decode token; its
products read the weights in their own format (kernel.matvec) and split over threads. Activations
in fp32; sums may be reassociated (SIMD), so results differ from PyTorch's by rounding only."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .compiled import widen
from .decode_blob import GROUP, ROWS
from .matvec import is_quantized, matvec_rows, quantize_activations, row_unit, split

FAST = {"reassoc", "contract"}  # as in expert_compute: vectorised sums, inf and nan keep their meaning
EMPTY = np.zeros(0, np.float32)  # an absent bias
NORM_NONE, NORM_FULL, NORM_HEAD = 0, 1, 2  # q/k norms: none, over all heads' channels (OLMoE), per head (Qwen3)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def rms_norm(x, w, eps, out):
    """out [n] = x [n] / rms(x) * w [n]."""
    ss = np.float32(0.0)
    for i in range(x.shape[0]):
        ss += x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[0]) + np.float32(eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * r * w[i]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _gemv_rows(w, x, b, out, first, end):
    """gemv's rows [first, end): out[r] = w[r] @ x (+ b[r] unless b is empty)."""
    biased = b.shape[0] > 0
    for r in range(first, end):
        acc = np.float32(0.0)
        for c in range(w.shape[1]):
            acc += widen(w[r, c]) * x[c]
        out[r] = acc + b[r] if biased else acc


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def gemv(w, x, b, out):
    """out [R] = w [R, C] @ x [C] (+ b [R] unless b is empty); w float32 or 16-bit (`widen`)."""
    _gemv_rows(w, x, b, out, 0, w.shape[0])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def gemv_pair(w, w_next, x, out, out_next):
    """out = w @ x and out_next = w_next @ x in one call: a layer's router and the next layer's on the same input
    (the router-ahead prediction riding on the routing, with no call of its own)."""
    gemv(w, x, EMPTY, out)
    gemv(w_next, x, EMPTY, out_next)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _norm_heads(v, w, eps, heads, dim):
    """RMS-normalise each of `heads` consecutive dim-channel slices of v in place with w [dim]."""
    for h in range(heads):
        rms_norm(v[h * dim:(h + 1) * dim], w, eps, v[h * dim:(h + 1) * dim])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _rope(v, cos, sin, dim):
    """Rotate-half RoPE of one head v [dim] in place over its first rot = len(cos) channels, with
    the signed sin of attention.rope_tables (the rest of the head as it is)."""
    half = cos.shape[0] // 2
    for d in range(half):
        a, b = v[d], v[d + half]
        v[d] = a * cos[d] + b * sin[d]
        v[d + half] = b * cos[d + half] + a * sin[d + half]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _attention_input(h, attn_norm, eps, xa, row, xq, xd, xs, xqs):
    """xa = rms_norm(h, attn_norm), and its int8 form for a quantized q/k/v matrix."""
    rms_norm(h, attn_norm, eps, xa)
    if is_quantized(row):
        quantize_activations(xa, row[GROUP], xq, xd, xs, xqs)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _rows(buf, row, x, xq, xd, xs, xqs, out, first, end):
    """Row units [first, end) of one product (matvec_rows)."""
    unit = row_unit(row)
    matvec_rows(buf, row, x, xq, xd, xs, xqs, out, first * unit, min(row[ROWS], end * unit))


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _qkv_ready(qkv, bqkv, norm_mode, q_norm, k_norm, eps, clip, cos, sin, pos, keys, values, heads, kv_heads):
    """The q/k/v products of one token made ready to attend: bias, q/k norms, clipping, RoPE, and this token's
    key and value written at `pos`."""
    D = keys.shape[2]
    nq, nk = heads * D, kv_heads * D
    if bqkv.shape[0] > 0:
        for i in range(qkv.shape[0]):
            qkv[i] += bqkv[i]
    q, k, v = qkv[:nq], qkv[nq:nq + nk], qkv[nq + nk:]
    if norm_mode == NORM_FULL:
        rms_norm(q, q_norm, eps, q)
        rms_norm(k, k_norm, eps, k)
    elif norm_mode == NORM_HEAD:
        _norm_heads(q, q_norm, eps, heads, D)
        _norm_heads(k, k_norm, eps, kv_heads, D)
    if clip > 0:
        for i in range(qkv.shape[0]):
            qkv[i] = min(max(qkv[i], -clip), clip)
    for hd in range(heads):
        _rope(q[hd * D:(hd + 1) * D], cos, sin, D)
    for hd in range(kv_heads):
        _rope(k[hd * D:(hd + 1) * D], cos, sin, D)
        for d in range(D):
            keys[hd, pos, d] = k[hd * D + d]
            values[hd, pos, d] = v[hd * D + d]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _attend_heads(q, keys, values, pos, window, sinks, heads, scores, o, h0, h1):
    """Heads [h0, h1) of one token's grouped-query attention over positions up to pos (a sliding window of
    `window` when > 0; GPT-OSS's sinks join each head's softmax denominator when given) into o [heads D];
    scores [heads, S] scratch."""
    kv_heads, D = keys.shape[0], keys.shape[2]
    first = max(0, pos - window + 1) if window > 0 else 0
    scale = np.float32(1.0) / np.sqrt(np.float32(D))
    group = heads // kv_heads
    for hd in range(h0, h1):
        kv = hd // group
        qh, sc = q[hd * D:(hd + 1) * D], scores[hd]
        top = sinks[hd] if sinks.shape[0] > 0 else -np.inf
        for j in range(first, pos + 1):
            s = np.float32(0.0)
            for d in range(D):
                s += qh[d] * keys[kv, j, d]
            sc[j] = s * scale
            top = max(top, sc[j])
        total = np.exp(sinks[hd] - top) if sinks.shape[0] > 0 else np.float32(0.0)
        for j in range(first, pos + 1):
            sc[j] = np.exp(sc[j] - top)
            total += sc[j]
        oh = o[hd * D:(hd + 1) * D]
        for d in range(D):
            oh[d] = 0.0
        for j in range(first, pos + 1):
            p = sc[j] / total
            for d in range(D):
                oh[d] += p * values[kv, j, d]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _attention_output(h, y, bo, moe_norm, eps, x_out):
    """h += y (+ bo); x_out = rms_norm(h, moe_norm)."""
    for i in range(h.shape[0]):
        h[i] += y[i] + (bo[i] if bo.shape[0] > 0 else np.float32(0.0))
    rms_norm(h, moe_norm, eps, x_out)


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def attention_token(h, attn_norm, moe_norm, eps, qkv_buf, qkv_row, bqkv, norm_mode, q_norm, k_norm, clip, cos, sin,
                    pos, keys, values, window, sinks, wo_buf, wo_row, bo, heads, kv_heads, scratch, qkv_work, o_work,
                    scores, x_out, parts):
    """One decode token's attention block, in place: h [H] += attention(rms_norm(h)), then x_out [H] =
    rms_norm(h, moe_norm); the products split over `parts` threads by rows, the heads by head. The q/k/v
    matrix [(heads + 2 kv_heads) D, H] (qkv_buf, qkv_row) and the output matrix [H, heads D] (wo_buf,
    wo_row) in any kernel.matvec format, with biases bqkv, bo; q/k norms by norm_mode; |q|, |k|, |v| clipped
    at clip when > 0; cos, sin [rot] the RoPE row of `pos`; keys, values [kv_heads, S, D] (S > pos) receive
    this token's key and value at pos; a sliding window of `window` positions when > 0; sinks [heads]
    (GPT-OSS) join each head's softmax denominator when given. Empty arrays stand for absent biases, norms
    and sinks. scratch [2 H + (2 heads + 2 kv_heads) D], scores [heads, S]; qkv_work, o_work: the products'
    activation scratch (kernel.linear.activation_work)."""
    H = h.shape[0]
    D = keys.shape[2]
    nq, nk = heads * D, kv_heads * D
    xa = scratch[:H]
    qkv = scratch[H:H + nq + 2 * nk]
    o = scratch[H + nq + 2 * nk:H + 2 * nq + 2 * nk]
    y = scratch[H + 2 * nq + 2 * nk:2 * H + 2 * nq + 2 * nk]
    xq, xd, xs, xqs = qkv_work
    oq, od, os, oqs = o_work
    _attention_input(h, attn_norm, eps, xa, qkv_row, xq[0], xd[0], xs[0], xqs[0])
    n = (qkv_row[ROWS] + row_unit(qkv_row) - 1) // row_unit(qkv_row)
    if parts == 1:
        _rows(qkv_buf, qkv_row, xa, xq[0], xd[0], xs[0], xqs[0], qkv, 0, n)
    else:
        for p in prange(parts):
            first, end = split(n, p, parts)
            _rows(qkv_buf, qkv_row, xa, xq[0], xd[0], xs[0], xqs[0], qkv, first, end)
    _qkv_ready(qkv, bqkv, norm_mode, q_norm, k_norm, eps, clip, cos, sin, pos, keys, values, heads, kv_heads)
    if parts == 1:
        _attend_heads(qkv[:nq], keys, values, pos, window, sinks, heads, scores, o, 0, heads)
    else:
        for p in prange(parts):
            h0, h1 = split(heads, p, parts)
            _attend_heads(qkv[:nq], keys, values, pos, window, sinks, heads, scores, o, h0, h1)
    if is_quantized(wo_row):
        _quantize(o, wo_row[GROUP], oq[0], od[0], os[0], oqs[0])
    n = (wo_row[ROWS] + row_unit(wo_row) - 1) // row_unit(wo_row)
    if parts == 1:
        _rows(wo_buf, wo_row, o, oq[0], od[0], os[0], oqs[0], y, 0, n)
    else:
        for p in prange(parts):
            first, end = split(n, p, parts)
            _rows(wo_buf, wo_row, o, oq[0], od[0], os[0], oqs[0], y, first, end)
    _attention_output(h, y, bo, moe_norm, eps, x_out)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _quantize(x, g, xq, xd, xs, xqs):
    quantize_activations(x, g, xq, xd, xs, xqs)


def scratch_size(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Elements of attention_token's scratch for a model's shape."""
    return 2 * hidden + (2 * heads + 2 * kv_heads) * head_dim


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def gated_sum(resid, vectors, ids, gates, out):
    """out [H] = resid [H] + sum_j gates[j] vectors[ids[j]]: one token's residual with its experts' default
    vectors, the quasi-hidden state before its norm."""
    for h in range(resid.shape[0]):
        out[h] = resid[h]
    for j in range(ids.shape[0]):
        g = gates[j]
        for h in range(resid.shape[0]):
            out[h] += g * vectors[ids[j], h]


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _sketch_share(x, means, inputs, bias, outputs, gate, up, gate_bias, up_bias, down, ids, gates, first, step,
                  clamped, limit, alpha, z, out):
    """out [H] += sum_j gates[j] sketch_e(x), e = ids[j], over j = first, first + step, ... (sketch_sum's terms, one
    thread's share); z [>= r] scratch."""
    H, r, n = out.shape[0], inputs.shape[1], gate.shape[1]
    for j in range(first, ids.shape[0], step):
        e, g = ids[j], gates[j]
        for i in range(r):
            acc = widen(bias[e, i])
            for h in range(H):
                acc += widen(inputs[e, i, h]) * x[h]
            z[i] = g * acc
        for h in range(H):
            out[h] += g * widen(means[e, h])
        for i in range(r):
            zi = z[i]
            for h in range(H):
                out[h] += zi * widen(outputs[e, i, h])
        for i in range(n):
            a, b = widen(gate_bias[e, i]), widen(up_bias[e, i])
            for h in range(H):
                a += widen(gate[e, i, h]) * x[h]
                b += widen(up[e, i, h]) * x[h]
            if clamped:
                a = min(a, limit)
                b = min(max(b, -limit), limit)
                act = (b + np.float32(1.0)) * a / (np.float32(1.0) + np.exp(-alpha * a))
            else:
                act = b * a / (np.float32(1.0) + np.exp(-a))
            act *= g
            for h in range(H):
                out[h] += act * widen(down[e, i, h])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _zero(v):
    """v [n] = 0."""
    for i in range(v.shape[0]):
        v[i] = np.float32(0.0)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _sum_rows(first, rows, out):
    """out [H] = first [H] + the sum of rows [P, H] (rows empty: a copy)."""
    for h in range(out.shape[0]):
        out[h] = first[h]
    for p in range(rows.shape[0]):
        for h in range(out.shape[0]):
            out[h] += rows[p, h]


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def sketch_sum(resid, x, means, inputs, bias, outputs, gate, up, gate_bias, up_bias, down, ids, gates, clamped,
               limit, alpha, z, acc, out):
    """out [H] = resid [H] + sum_j gates[j] sketch_e(x), e = ids[j]: one token's residual with its experts'
    sketches (engine/predictors.ExpertSketch) on its MoE input x [H]: means[e] + (inputs[e] x + bias[e])
    outputs[e] + sum_i glu(gate[e, i] x + gate_bias[e, i], up[e, i] x + up_bias[e, i]) down[e, i]; glu is
    silu(g) u, or with `clamped` GPT-OSS's (u clamped to +-limit, plus 1) g sigmoid(alpha g), g clamped above at
    limit. means [E, H]; inputs, outputs [E, r, H]; bias [E, r]; gate, up, down [E, n, H]; gate_bias, up_bias
    [E, n]; float32 or 16-bit (`widen`). The experts split over acc's P threads where P > 1, each summing its
    share into its row of acc [P, H] (at real size the call streams megabytes of sketches); with P = 1 into out.
    z [P, >= r] scratch."""
    parts = acc.shape[0]
    if parts == 1:
        _sum_rows(resid, acc[:0], out)
        _sketch_share(x, means, inputs, bias, outputs, gate, up, gate_bias, up_bias, down, ids, gates, 0, 1,
                      clamped, limit, alpha, z[0], out)
        return
    for p in prange(parts):
        _zero(acc[p])
        _sketch_share(x, means, inputs, bias, outputs, gate, up, gate_bias, up_bias, down, ids, gates, p, parts,
                      clamped, limit, alpha, z[p], acc[p])
    _sum_rows(resid, acc, out)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST, inline="always")
def _quasi_hidden(resid, vectors, ids, gates, norm, eps, q):
    """One token's quasi-hidden state q [:H] = rms_norm(resid [H] + sum_j gates[j] vectors[ids[j]], norm)."""
    H = resid.shape[0]
    gated_sum(resid, vectors, ids, gates, q[:H])
    rms_norm(q[:H], norm, eps, q[:H])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def quasi_hidden_logits(resid, vectors, ids, gates, norm, eps, router, q, out):
    """Next-layer router logits out [E] of one token's quasi-hidden state q [H] = rms_norm(resid [H] +
    sum_j gates[j] vectors[ids[j]], norm): vectors [E, H] the layer's default vectors, router [E, H]."""
    _quasi_hidden(resid, vectors, ids, gates, norm, eps, q)
    gemv(router, q, EMPTY, out)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _previous_silu(rows, prev_ids, prev_gates, hidden):
    """transition_logits' middle: hidden += the previous token's rows, then silu."""
    for j in range(prev_ids.shape[0]):
        g = prev_gates[j]
        for i in range(hidden.shape[0]):
            hidden[i] += g * rows[prev_ids[j], i]
    for i in range(hidden.shape[0]):
        hidden[i] = hidden[i] / (np.float32(1.0) + np.exp(-hidden[i]))


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def transition_logits(q, w1, b1, rows, prev_ids, prev_gates, w2, b2, hidden, out):
    """One estimator transition's next-layer logits out [E] for one token's input q [H]: w2 silu(w1 q + b1 +
    sum_j prev_gates[j] rows[prev_ids[j]]) + b2, with w1 [W, H], rows [E, W] (a row per expert the previous
    token ran at the next layer; none given: unknown), w2 [E, W]; hidden [W] scratch."""
    gemv(w1, q, b1, hidden)
    _previous_silu(rows, prev_ids, prev_gates, hidden)
    gemv(w2, hidden, b2, out)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def estimator_logits(resid, vectors, ids, gates, norm, eps, w1, b1, rows, prev_ids, prev_gates, w2, b2, q, hidden,
                     out):
    """transition_logits on the quasi-hidden state q [H] of one token (quasi_hidden_logits); q, hidden scratch."""
    _quasi_hidden(resid, vectors, ids, gates, norm, eps, q)
    transition_logits(q, w1, b1, rows, prev_ids, prev_gates, w2, b2, hidden, out)


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def lookahead_logits(q, router, w1, b1, rows, prev_ids, prev_gates, w2, b2, hidden, out, parts):
    """The lookahead's next-layer logits out [E] on its input q [H]: the next layer's router [E, H] on q plus the
    transition's net (transition_logits), in one call; its products split by rows over `parts` threads (at real
    size the net's first matrix and the router are 1.5 MB)."""
    if parts == 1:
        transition_logits(q, w1, b1, rows, prev_ids, prev_gates, w2, b2, hidden, out)
        _gemv_rows(router, q, out, out, 0, out.shape[0])  # the net's logits as the bias: read before written
        return
    for p in prange(parts):
        first, end = split(hidden.shape[0], p, parts)
        _gemv_rows(w1, q, b1, hidden, first, end)
    _previous_silu(rows, prev_ids, prev_gates, hidden)
    for p in prange(parts):
        first, end = split(out.shape[0], p, parts)
        _gemv_rows(w2, hidden, b2, out, first, end)
        _gemv_rows(router, q, out, out, first, end)
