"""Routing: a router's logits -> the top-k experts in rank order and their gate weights.

One compiled implementation serves the engine (rows it just computed, float32) and the
simulator (a trace's rows, float16 bit patterns read through a table: numba has no float16),
so both break ties alike: equal logits go to the lower expert id. Rankings compare integer
keys (`rank_key`) in the order of the values, which vectorises.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .compiled import compiled

# float16 bit pattern -> its value as float32
HALF_TO_FLOAT = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)


@compiled
def value(row, table, e):
    """row[e] as a float: rows are float arrays, or float16 bit patterns read through `table`."""
    if table is None:
        return row[e]
    return table[row[e]]


def rank_key(row, table, e):
    """One non-negative integer per entry whose order is the ranking: value, then the lower
    index. float32 rows compare their bit patterns with the magnitude of negatives flipped;
    float16 rows (`table` given) are bit patterns already. (Chosen by type when compiled.)"""


@overload(rank_key, jit_options={"cache": True, "_nrt": False})
def _rank_key(row, table, e):
    if isinstance(table, types.NoneType):
        def float32_key(row, table, e):
            b = np.int64(row.view(np.int32)[e])
            return (((b ^ ((b >> 63) & 0x7FFFFFFF)) + 0x80000000) << 16) | (0xFFFF - e)
        return float32_key

    def float16_key(row, table, e):
        b = np.int64(row[e])
        return ((b ^ ((b >> 15) * 0x7FFF | 0x8000)) << 16) | (0xFFFF - e)
    return float16_key


@compiled
def _block_max(comp, c, E):
    """The largest of block c of comp[:E] (entries 16c .. 16c + 15)."""
    top = np.int64(-1)
    for i in range(c * 16, min(c * 16 + 16, E)):
        top = max(top, comp[i])
    return top


@compiled
def top_m(row, table, m, idx, val, comp, block_max):
    """idx[:m], val[:m] <- the m largest entries of row, descending, ties to the lower index.

    Each entry's rank_key is computed once; m times, the maximum over blocks of 16 names the
    next entry and only that block is rescanned. The scans vectorise and nothing branches on
    the data. comp [E], block_max [E / 16 + 1]: working arrays."""
    E = len(row)
    for i in range(E):
        comp[i] = rank_key(row, table, i)
    blocks = (E + 15) // 16
    for c in range(blocks):
        block_max[c] = _block_max(comp, c, E)
    for j in range(m):
        best = np.int64(-1)
        for c in range(blocks):
            best = max(best, block_max[c])
        i = 0xFFFF - (best & 0xFFFF)
        idx[j], val[j] = i, value(row, table, i)
        comp[i] = -1
        block_max[i // 16] = _block_max(comp, i // 16, E)


@compiled
def route_row(row, table, norm, ranked, vals, w, comp, block_max):
    """ranked [R] <- the row's R best experts in rank order, of which the first k = len(w)
    are routed; w [k] <- their gate weights: softmax, renormalised over the top-k when `norm`.
    vals [R], comp [E], block_max [E / 16 + 1]: working arrays."""
    k = len(w)
    top_m(row, table, len(ranked), ranked, vals, comp, block_max)
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


def route_logits(logits: np.ndarray, top_k: int, norm_topk: bool):
    """logits [T, E] -> logits [T, E] (float32, contiguous), weights [T, k] (float32), ids [T, k] (int64):
    each row's top-k experts in rank order and their softmax weights (renormalised over the k if `norm_topk`)."""
    assert logits.ndim == 2, f"logits must be [T, E], got {logits.shape}"
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    T, E = logits.shape
    ids, weights = np.empty((T, top_k), np.int64), np.empty((T, top_k), np.float32)
    route_rows(logits, None, norm_topk, ids, weights, np.empty(top_k), np.empty(E, np.int64),
               np.empty(E // 16 + 1, np.int64))
    return logits, weights, ids
