"""A dense layer's product with one token or a window, compiled and split across `parts` threads by rows
(kernel.matvec over any weight format): the engine's Linear on the CPU (engine/linear.py)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .decode_blob import GROUP, ROWS
from .matvec import is_quantized, matmul_rows, matvec_rows, quantize_activations, row_unit, split

FAST = {"reassoc", "contract"}


def activation_work(tokens: int, cols: int, row: np.ndarray) -> tuple[np.ndarray, ...]:
    """Scratch for `tokens` inputs of a matrix of plan row `row` quantized to int8 (codes, scales, sums, code
    sums, as quantize_activations writes them); one column where the matrix is float."""
    g = int(row[GROUP]) if int(row[0]) >= 3 else 0
    width, groups = (-(-cols // g) * g, -(-cols // g)) if g else (1, 1)
    return (np.empty((tokens, width), np.int8), np.empty((tokens, groups), np.float32),
            np.empty((tokens, groups), np.float32), np.empty((tokens, groups), np.int32))


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _quantize_rows(x, g, xq, xd, xs, xqs, t0, t1):
    for t in range(t0, t1):
        quantize_activations(x[t], g, xq[t], xd[t], xs[t], xqs[t])


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _token_rows(buf, row, x, xq, xd, xs, xqs, out, first, end):
    unit = row_unit(row)
    matvec_rows(buf, row, x, xq, xd, xs, xqs, out, first * unit, min(row[ROWS], end * unit))


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def linear_token(buf, row, x, work, out, parts):
    """out [rows] = the matrix (buf uint8, plan row `row`) . x [cols] float32, over `parts` threads; work:
    activation_work(1, cols, row)."""
    xq, xd, xs, xqs = work
    if is_quantized(row):
        _quantize_rows(x.reshape(1, -1), row[GROUP], xq, xd, xs, xqs, 0, 1)
    n = (row[ROWS] + row_unit(row) - 1) // row_unit(row)
    if parts == 1:
        _token_rows(buf, row, x, xq[0], xd[0], xs[0], xqs[0], out, 0, n)
    else:
        for p in prange(parts):
            first, end = split(n, p, parts)
            _token_rows(buf, row, x, xq[0], xd[0], xs[0], xqs[0], out, first, end)


@njit(cache=True, _nrt=False, nogil=True, fastmath=FAST)
def _window_rows(buf, row, x, xq, xd, xs, xqs, out, first, end):
    unit = row_unit(row)
    matmul_rows(buf, row, x, xq, xd, xs, xqs, out, first * unit, min(row[ROWS], end * unit))


@njit(cache=True, nogil=True, fastmath=FAST, parallel=True)
def linear_window(buf, row, x, work, out, parts):
    """out [T, rows] = x [T, cols] float32 times the matrix's rows, over `parts` threads (tokens quantized
    first for a quantized matrix); work: activation_work(T, cols, row) or larger."""
    T = x.shape[0]
    xq, xd, xs, xqs = work
    xq, xd, xs, xqs = xq[:T], xd[:T], xs[:T], xqs[:T]
    q = is_quantized(row)
    n = (row[ROWS] + row_unit(row) - 1) // row_unit(row)
    if parts == 1:
        if q:
            _quantize_rows(x, row[GROUP], xq, xd, xs, xqs, 0, T)
        _window_rows(buf, row, x, xq, xd, xs, xqs, out, 0, n)
    else:
        if q:
            for p in prange(parts):
                t0, t1 = split(T, p, parts)
                _quantize_rows(x, row[GROUP], xq, xd, xs, xqs, t0, t1)
        for p in prange(parts):
            first, end = split(n, p, parts)
            _window_rows(buf, row, x, xq, xd, xs, xqs, out, first, end)
