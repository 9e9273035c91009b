"""Routing: a router's logits -> the top-k experts in rank order and their gate weights.

One compiled implementation serves the engine (rows it just computed, float32) and the
simulator (a trace's rows, float16 bit patterns read through a table: numba has no float16),
so both break ties alike: equal logits go to the lower expert id. Rankings compare integer
keys (`rank_key`) in the order of the values, which vectorises.

Four router kinds. softmax: experts ranked by logit, gates the softmax (renormalised over the
top-k when `norm`); a per-expert logit bias (GPT-OSS), where the router has one, is added to
the logits before both, so the decision kernel ranks the biased logits. The three *selection*
routers score each expert in float32, sigmoid(logit) (`sigmoid`: DeepSeek-V3, GLM-4.5) or the
softmax over the logits (`softmax_selection`: ERNIE 4.5; `softmax_limited`: DeepSeek-V2's
group-limited greedy routing); experts are *selected* by score + a per-expert correction bias
(none in DeepSeek-V2), only within the `topk_group` best of `n_group` groups (a group's worth:
the sum of its two best biased scores, or under `softmax_limited` its best score); the gates are
the unbiased scores of the chosen experts, divided by their sum (+1e-20) when `norm`. The
routed_scaling_factor multiplies the layer's combined output, not the gates, so that gate weights
stay shares of a token's routed mass for every router (the policies' thresholds mean the same on
every family). For a selection router the decision kernel ranks the *selection row*: biased
scores, -inf outside the token's allowed groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import types
from numba.extending import overload

from .compiled import compiled

KINDS = ("softmax", "sigmoid", "softmax_selection", "softmax_limited")
# the routers that select by a biased score and weigh by the score, and the scoring code each passes the kernels
SELECTION = ("sigmoid", "softmax_selection", "softmax_limited")
SIGMOID, SOFTMAX, SOFTMAX_BEST = 0, 1, 2  # scores sigmoid(logit); softmax (a group's worth: its two best); its best

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


@compiled
def biased_row(row, table, bias, out):
    """Softmax router with a logit bias, one token: out [E] <- row + bias (float32)."""
    for e in range(len(row)):
        out[e] = np.float32(value(row, table, e)) + bias[e]


@compiled
def select_row(row, table, bias, n_group, topk_group, scoring, sel, scores, group_score):
    """Selection router, one token: scores [E] <- sigmoid(row) (`scoring` SIGMOID), or the softmax of
    row (SOFTMAX, SOFTMAX_BEST; float32); sel [E] <- scores + bias inside the token's topk_group best
    groups (a group's worth: its two best biased scores summed, under SOFTMAX_BEST its best one; ties to
    the lower group), -inf outside them. group_score [n_group]: working array."""
    E = len(row)
    one = np.float32(1.0)
    if scoring != SIGMOID:
        top, total = np.float32(-np.inf), np.float32(0.0)
        for e in range(E):
            top = max(top, np.float32(value(row, table, e)))
        for e in range(E):
            scores[e] = np.exp(np.float32(value(row, table, e)) - top)
            total += scores[e]
        for e in range(E):
            scores[e] = np.float32(scores[e] / total)
            sel[e] = scores[e] + bias[e]
    else:
        for e in range(E):
            g = one / (one + np.exp(-np.float32(value(row, table, e))))
            scores[e] = g
            sel[e] = g + bias[e]
    if topk_group >= n_group:
        return
    size = E // n_group
    for g in range(n_group):
        a, b = -np.inf, -np.inf  # best and second best of the group
        for e in range(g * size, g * size + size):
            v = sel[e]
            if v > a:
                a, b = v, a
            elif v > b:
                b = v
        group_score[g] = np.float32(a) if scoring == SOFTMAX_BEST else np.float32(a + b)
    for _ in range(n_group - topk_group):  # drop the worst groups, ties: the higher group goes first
        worst = 0
        for g in range(1, n_group):
            if group_score[g] <= group_score[worst]:
                worst = g
        group_score[worst] = np.inf
        for e in range(worst * size, worst * size + size):
            sel[e] = -np.inf


@compiled
def route_row_selection(row, table, bias, n_group, topk_group, scoring, norm, ranked, vals, w, sel, scores,
                        group_score, comp, block_max):
    """Selection router, one token: ranked [R] <- experts in selection order (allowed groups by
    biased score, then the rest by id), of which the first k = len(w) are routed; w [k] <- their
    unbiased scores, divided by their sum when `norm`. sel, scores [E] <- the selection row and the
    scores (see select_row)."""
    k = len(w)
    select_row(row, table, bias, n_group, topk_group, scoring, sel, scores, group_score)
    top_m(sel, None, len(ranked), ranked, vals, comp, block_max)
    total = np.float32(0.0)
    for j in range(k):
        w[j] = scores[ranked[j]]
        total += np.float32(w[j])
    if norm:
        total += np.float32(1e-20)
        for j in range(k):
            w[j] = np.float32(w[j]) / total


@compiled
def route_rows_selection(logits, table, bias, n_group, topk_group, scoring, norm, ids, weights, sel, scores, vals,
                         group_score, comp, block_max):
    """route_row_selection over every row of logits [T, E] into ids, weights [T, k], sel, scores [T, E]."""
    for t in range(logits.shape[0]):
        route_row_selection(logits[t], table, bias, n_group, topk_group, scoring, norm, ids[t], vals, weights[t],
                            sel[t], scores[t], group_score, comp, block_max)


@dataclass(frozen=True)
class Router:
    """How a model routes, for every place that routes (engine, calibrate, predictors, simulator)."""
    top_k: int
    norm_topk: bool
    kind: str = "softmax"  # one of KINDS
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0  # routed_scaling_factor: multiplies the combined routed output
    # [L, E] float32 per MoE layer: softmax, added to the logits before top-k and softmax; a selection router's
    # selection bias
    bias: np.ndarray | None = None

    @property
    def selects(self) -> bool:
        """True for a selection router (selection rows, gate scores apart from the ranking)."""
        return self.kind in SELECTION

    @property
    def scoring(self) -> int:
        """A selection router's scores and groups' worth as the kernels take them: SIGMOID, SOFTMAX or SOFTMAX_BEST."""
        return {"softmax_selection": SOFTMAX, "softmax_limited": SOFTMAX_BEST}.get(self.kind, SIGMOID)

    @property
    def logit_bias(self) -> bool:
        """True for a softmax router with a logit bias: its logits are biased before they are ranked."""
        return not self.selects and self.bias is not None

    def layer_bias(self, layer: int, num_experts: int) -> np.ndarray:
        """The bias of MoE layer `layer` [E] (zeros when the router has none)."""
        if self.bias is None:
            return np.zeros(num_experts, np.float32)
        return self.bias[layer]

    def bias_table(self, num_layers: int, num_experts: int) -> np.ndarray:
        """The bias of every MoE layer [L, E] float32 (zeros when the router has none)."""
        if self.bias is None:
            return np.zeros((num_layers, num_experts), np.float32)
        return np.ascontiguousarray(self.bias, dtype=np.float32)

    def route(self, logits: np.ndarray, layer: int) -> Routing:
        """logits [T, E] of MoE layer `layer` (the router's weight times x, without a bias) -> its Routing."""
        if not self.selects:
            if self.bias is not None:
                logits = np.asarray(logits, np.float32) + self.bias[layer]
            rows, weights, ids = route_logits(logits, self.top_k, self.norm_topk)
            return Routing(rows, rows, weights, ids)
        assert logits.ndim == 2, f"logits must be [T, E], got {logits.shape}"
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        T, E = logits.shape
        k = self.top_k
        ids, weights = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        sel, scores = np.empty((T, E), np.float32), np.empty((T, E), np.float32)
        route_rows_selection(logits, None, self.layer_bias(layer, E), self.n_group, self.topk_group,
                             self.scoring, self.norm_topk, ids, weights, sel, scores, np.empty(k),
                             np.empty(self.n_group, np.float32), np.empty(E, np.int64), np.empty(E // 16 + 1, np.int64))
        return Routing(sel, scores, weights, ids)

    def header(self) -> dict:
        """The router as trace-header fields (the bias as nested lists)."""
        return {"router": self.kind, "n_group": self.n_group, "topk_group": self.topk_group,
                "routed_scaling_factor": self.scale,
                "router_bias": None if self.bias is None else np.asarray(self.bias).tolist()}

    @classmethod
    def from_header(cls, h: dict) -> Router:
        """The Router a trace header records."""
        bias = h.get("router_bias")
        return cls(h["top_k"], bool(h["norm_topk_prob"]), h.get("router", "softmax"), h.get("n_group", 1),
                   h.get("topk_group", 1), h.get("routed_scaling_factor", 1.0),
                   None if bias is None else np.asarray(bias, np.float32))


@dataclass
class Routing:
    """One layer call's routes, on the host."""
    rows: np.ndarray  # [T, E] float32 what the decision kernel ranks: (biased) logits, or selection rows
    scores: np.ndarray  # [T, E] float32 the gate scores the conditional policy weighs by (selection; softmax: rows)
    weights: np.ndarray  # [T, k] float32 gate weights, shares of the routed mass
    ids: np.ndarray  # [T, k] int64 routed experts in rank order


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
