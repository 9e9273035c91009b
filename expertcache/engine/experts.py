"""Expert compute over stacked weights (w13 [S, 2F, H], w2 [S, H, F], indexed by slot or
expert id): one token's k experts as matrix-vector products, or a batch grouped by expert.
Offload-agnostic: the cache has already rewritten expert ids into slot ids."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_groups(ids: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """ids [T, k] -> (order [T * k], experts, counts): the flat assignments sorted by id (stable),
    each used id once in ascending order and how many assignments it has. Assignment
    order[i] is token order[i] // k at rank order[i] % k."""
    assert ids.dim() == 2, f"ids must be [T, k], got {tuple(ids.shape)}"
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return order, used.tolist(), counts.tolist()


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert over a batch: x [n, H], w13 [2F, H], w2 [H, F] -> [n, H]."""
    assert w13.shape == (2 * w2.shape[1], x.shape[-1]), \
        f"x [n, H], w13 [2F, H], w2 [H, F] do not fit: {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
    g, u = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(g) * u) @ w2.t()


def experts_one_token(x, slots, weights, w13, w2):
    """Decode: one token, k matrix-vector products straight from the slots (no gather copy).
    x [1, H], slots [1, k] (long), weights [1, k] -> [1, H]."""
    assert x.shape[0] == 1 and slots.shape == weights.shape, (x.shape, slots.shape, weights.shape)
    xv, ids = x[0], slots[0].tolist()
    g, u = torch.stack([w13[s] @ xv for s in ids]).chunk(2, dim=-1)  # [k, F] each
    act = F.silu(g) * u * weights[0].unsqueeze(-1).to(x.dtype)
    out = w2[ids[0]] @ act[0]
    for j in range(1, len(ids)):
        out.addmv_(w2[ids[j]], act[j])
    return out.unsqueeze(0)


def experts_grouped(x, slots, weights, w13, w2):
    """Large batches: one matmul pair per used slot. x [T, H], slots, weights [T, k] -> [T, H]."""
    assert slots.shape == weights.shape and slots.shape[0] == x.shape[0], (x.shape, slots.shape, weights.shape)
    k = slots.shape[1]
    order, used, counts = expert_groups(slots.to(x.device))
    token = order // k
    xs = x[token]
    if w13.requires_grad:  # training: per-expert views, so backward does not build a full-size gradient per index
        w13, w2 = w13.unbind(0), w2.unbind(0)
    out_rows, start = [], 0
    for s, c in zip(used, counts):
        out_rows.append(swiglu(xs[start:start + c], w13[s], w2[s]))
        start += c
    y = torch.cat(out_rows) * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def experts_compute(x, slots, weights, w13, w2):
    """x [T, H], slots [T, k] (a host tensor: the decode path reads it without a device sync),
    weights [T, k] -> the gate-weighted sum of each token's experts [T, H]."""
    return experts_one_token(x, slots, weights, w13, w2) if x.shape[0] == 1 else \
        experts_grouped(x, slots, weights, w13, w2)
