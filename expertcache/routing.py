"""Routing: a router's logits -> the top-k experts in rank order and their gate weights.

One compiled implementation serves the engine (rows it just computed, float32) and the
simulator (a trace's rows, float16 bit patterns read through a table: numba has no float16),
so both break ties alike: equal logits go to the lower expert id.
"""
from __future__ import annotations

import numpy as np
import torch

from .compiled import compiled

# float16 bit pattern -> its value as float32
HALF_TO_FLOAT = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)


@compiled
def value(row, table, e):
    """row[e] as a float: rows are float arrays, or float16 bit patterns read through `table`."""
    if table is None:
        return row[e]
    return table[row[e]]


@compiled
def top_m(row, table, m, idx, val, comp, block_max):
    """idx[:m], val[:m] <- the m largest entries of row, descending, ties to the lower index.
    comp [E] and block_max [E / 16 + 1] are working arrays for float16 rows."""
    if table is not None:
        _top_half(row, m, idx, comp, block_max)
        for i in range(m):
            val[i] = table[row[idx[i]]]
        return
    n = 0
    for e in range(len(row)):
        v = row[e]
        if n < m:
            i = n
            n += 1
        elif v > val[m - 1]:
            i = m - 1
        else:
            continue
        while i > 0 and val[i - 1] < v:
            val[i], idx[i] = val[i - 1], idx[i - 1]
            i -= 1
        val[i], idx[i] = v, e


@compiled
def _half_key(b):
    """An integer key in the order of the float16 value whose bit pattern is b."""
    b = np.int64(b)
    return b ^ ((b >> 15) * 0x7FFF | 0x8000)


@compiled
def _top_half(bits, m, idx, comp, block_max):
    """idx <- the top-m of a row of float16 bit patterns, descending, ties to the lower index.

    Each entry becomes one integer, (order-preserving key << 16) | (0xFFFF - index), whose
    maximum names the best entry; m times, the maximum over blocks of 16 is taken and only
    the winner's block is rescanned. The scans vectorise; nothing branches on the data."""
    E = len(bits)
    for i in range(E):
        comp[i] = (_half_key(bits[i]) << 16) | (0xFFFF - i)
    blocks = (E + 15) // 16
    for c in range(blocks):
        top = np.int64(-1)
        for i in range(c * 16, min(c * 16 + 16, E)):
            top = max(top, comp[i])
        block_max[c] = top
    for j in range(m):
        best = np.int64(-1)
        for c in range(blocks):
            best = max(best, block_max[c])
        i = 0xFFFF - (best & 0xFFFF)
        idx[j] = i
        comp[i] = -1
        c = i // 16
        top = np.int64(-1)
        for x in range(c * 16, min(c * 16 + 16, E)):
            top = max(top, comp[x])
        block_max[c] = top


@compiled
def route_row(row, table, norm, ids, vals, w, comp, block_max):
    """ids, w [k] <- the top-k experts of a logit row and their gate weights: softmax,
    renormalised over the top-k when `norm`. vals [k], comp [E], block_max [E / 16 + 1]:
    working arrays."""
    k = len(ids)
    top_m(row, table, k, ids, vals, comp, block_max)
    total = 0.0
    for j in range(k):
        w[j] = np.exp(vals[j] - vals[0])
        total += w[j]
    if not norm:  # weights are probabilities over all experts
        total = 0.0
        for e in range(len(row)):
            total += np.exp(value(row, table, e) - vals[0])
    for j in range(k):
        w[j] /= total


@compiled
def route_rows(logits, table, norm, ids, weights, vals, comp, block_max):
    """route_row over every row of logits [T, E] into ids, weights [T, k]."""
    for t in range(logits.shape[0]):
        route_row(logits[t], table, norm, ids[t], vals, weights[t], comp, block_max)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool):
    """x [T, H], router [E, H] -> logits [T, E] (float32), weights [T, k] (float32) and
    ids [T, k] (int64), on the host."""
    return route_logits((x @ router.t()).float().cpu().numpy(), top_k, norm_topk)


def route_logits(logits: np.ndarray, top_k: int, norm_topk: bool):
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    T, E = logits.shape
    ids, weights = np.empty((T, top_k), np.int64), np.empty((T, top_k), np.float32)
    route_rows(logits, None, norm_topk, ids, weights, np.empty(top_k), np.empty(E, np.int64),
               np.empty(E // 16 + 1, np.int64))
    return logits, weights, ids
