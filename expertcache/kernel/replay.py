"""The replay loops of the simulator, compiled: routing a whole trace, and deciding a window of
it layer by layer, token by token, with the engine's own `decide_token` on a virtual cache."""
from __future__ import annotations

from .cache_state import SEGMENTS
from .compiled import compiled, prefetch
from .decisions import begin_call, decide_token, land_flying, owes_work, prefetch_ranked
from .routing import biased_row, route_row, route_row_selection, select_row


@compiled
def route_all(logits, table, norm, ranked, weights, vals, comp, block_max):
    """Route every row of logits [N, L, E] into ranked [L, N, R] and weights [L, N, k]."""
    N, L, E = logits.shape
    for n in range(N):
        for layer in range(L):
            route_row(logits[n, layer], table, norm, ranked[layer, n], vals, weights[layer, n], comp, block_max)


@compiled
def route_all_biased(logits, table, norm, ranked, weights, vals, comp, block_max, bias, row):
    """route_all for a softmax router with a logit bias [L, E]; row [E]: a working array."""
    N, L, E = logits.shape
    for n in range(N):
        for layer in range(L):
            biased_row(logits[n, layer], table, bias[layer], row)
            route_row(row, None, norm, ranked[layer, n], vals, weights[layer, n], comp, block_max)


@compiled
def route_all_selection(logits, table, norm, ranked, weights, vals, comp, block_max, bias, n_group, topk_group,
                        scoring, sel, scores, group_score):
    """route_all for a selection router (`scoring`: routing.SIGMOID, SOFTMAX or SOFTMAX_BEST): bias [L, E], groups;
    sel, scores [E] and group_score [n_group]: working arrays."""
    N, L, E = logits.shape
    for n in range(N):
        for layer in range(L):
            route_row_selection(logits[n, layer], table, bias[layer], n_group, topk_group, scoring, norm,
                                ranked[layer, n], vals, weights[layer, n], sel, scores, group_score, comp,
                                block_max)


@compiled
def replay_window(st, p, account, sc, logits, w0, ranked, weights, slots, experts, gates, selection, scoring, biased,
                  bias, n_group, topk_group, sel, group_score, pred_ids, pred_w, budget, fetched, confidence, chosen):
    """One window of the trace, the tokens w0 .. w0 + T - 1, layer by layer, token by token; -1 on success, else
    the layer whose cache was too small. logits [T, L, E] float32: the window's router logits (one type whatever
    the trace holds, so that one compiled replay serves every trace: each is about a minute of compiling);
    ranked, weights: the trace's routes, layer-major [L, N, *]; slots, experts, gates [k]: working arrays. With
    `selection`, the kernel ranks each row's selection row (scored as `scoring` says, routing.select_row; bias
    [L, E], groups; sel [E], group_score [n_group]: working arrays); with `biased` (a softmax router's logit bias
    [L, E]), each row plus the bias, in sel; else the row as it is. With a `budget`, a decode token (T == 1)
    prefetches at each layer l the predicted routes of layer l + 1 (pred_ids, pred_w [L, N, k], layer-major) after
    its decisions, as the engine does (`prefetch_ranked`; `fetched`: only what the policy would fetch;
    `confidence`: only predictions of that gate weight or more; chosen [k]: working array)."""
    T, L, E = logits.shape
    line = 64 // logits.itemsize
    for layer in range(L):
        # every transfer has landed by the next layer call; only this layer's slots (every
        # slot with a global quota) can matter to it, and they are all it may have loaded
        st.pending[st.slot_lo[layer]:st.slot_hi[layer]] = False
        begin_call(st)
        for t in range(T):
            if t:
                land_flying(st)
            n = w0 + t
            if t + 2 < T:  # rows of one layer lie L * E apart: the hardware would not guess them
                ahead = logits[t + 2, layer]
                for e in range(0, E, line):
                    prefetch(ahead, e)
            row = logits[t, layer]
            if selection:
                select_row(row, None, bias[layer], n_group, topk_group, scoring, sel, sc.gate_row, group_score)
                row = sel
            elif biased:
                biased_row(row, None, bias[layer], sel)
                row = sel
            if not decide_token(st, p, account, sc, layer, t, n, row, None, not selection,
                                ranked[layer, n], weights[layer, n], slots, experts, gates):
                return layer
            if budget and T == 1 and layer + 1 < L:
                if prefetch_ranked(st, p, layer + 1, pred_ids[layer + 1, n], pred_w[layer + 1, n], budget, fetched,
                                   confidence, n, chosen) < 0:
                    return layer + 1
        st.counts[SEGMENTS] += owes_work(st, layer)  # the window's final pass, if a slot has work left
    return -1
