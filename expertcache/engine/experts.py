"""Expert compute over stacked weights (w13 [S, 2F, H], w2 [S, H, F], indexed by slot or
expert id; optional biases b13 [S, 2F], b2 [S, H]): one token's k experts as matrix-vector
products, or a batch grouped by expert, in PyTorch (CUDA, training), and the compiled CPU calls
over a cache's slots in any format (`CompiledExperts`). Offload-agnostic: the cache has already
rewritten expert ids into slot ids."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kernel.decode_blob import COLS, ENCODING, GROUP, PLAN_COLUMNS, RAW_BF16, RAW_F16, RAW_F32, ROWS, VALUES
from ..kernel.expert_compute import (
    activation_group,
    experts_of_token,
    experts_token,
    experts_token_sum,
    experts_window,
    token_work,
    window_work,
)
from . import threads


@dataclass(frozen=True)
class ExpertKind:
    """What an expert computes besides its weights: biases, and the gated activation of (gate, up)."""
    bias: bool = False
    limit: float | None = None  # GPT-OSS: gate clamped above, up clamped to +-limit, (up + 1) * gate * sigmoid(a gate)
    alpha: float = 1.702

    @classmethod
    def of(cls, args) -> "ExpertKind":
        """The expert kind of a ModelArgs."""
        return cls(args.expert_bias, args.swiglu_limit, args.swiglu_alpha)

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The gated activation: silu(g) * u, or GPT-OSS's clamped form."""
        if self.limit is None:
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        return (u.clamp(-self.limit, self.limit) + 1) * (g * torch.sigmoid(g * self.alpha))


SWIGLU = ExpertKind()
# how the compiled kernels see float tensors of each dtype: numpy has no fp16 arithmetic in numba and no bf16
# at all, so 16-bit weights go in as their bits (widened exactly, kernel/compiled.widen and kernel/simd.py)
KERNEL_VIEWS = {torch.float32: torch.float32, torch.float16: torch.uint16, torch.bfloat16: torch.int16}
RAW_ENCODINGS = {torch.float32: RAW_F32, torch.float16: RAW_F16, torch.bfloat16: RAW_BF16}


def kernel_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the compiled kernel reads it (KERNEL_VIEWS), sharing its memory."""
    return t.view(KERNEL_VIEWS[t.dtype]).numpy()


def expert_groups(ids: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """ids [T, k] -> (order [T * k], experts, counts): the flat assignments sorted by id (stable),
    each used id once in ascending order and how many assignments it has. Assignment
    order[i] is token order[i] // k at rank order[i] % k."""
    assert ids.dim() == 2, f"ids must be [T, k], got {tuple(ids.shape)}"
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return order, used.tolist(), counts.tolist()


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
           b2: torch.Tensor | None = None, kind: ExpertKind = SWIGLU) -> torch.Tensor:
    """One expert over a batch: x [n, H], w13 [2F, H], w2 [H, F] (biases b13 [2F], b2 [H]) -> [n, H]."""
    assert w13.shape == (2 * w2.shape[1], x.shape[-1]), \
        f"x [n, H], w13 [2F, H], w2 [H, F] do not fit: {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
    g, u = F.linear(x, w13, b13).chunk(2, dim=-1)
    return F.linear(kind.glu(g, u), w2, b2)


def experts_one_token(x, slots, weights, w13, w2, b13=None, b2=None, kind: ExpertKind = SWIGLU):
    """Decode: one token, k matrix-vector products straight from the slots (no gather copy).
    x [1, H], slots [1, k] (long), weights [1, k] -> [1, H]."""
    assert x.shape[0] == 1 and slots.shape == weights.shape, (x.shape, slots.shape, weights.shape)
    xv, ids = x[0], slots[0].tolist()
    if w13.dtype != x.dtype:  # 16-bit slots under fp32 compute: each used expert widened (exact)
        w13, w2 = w13[ids].to(x.dtype), w2[ids].to(x.dtype)
        b13, b2 = (None, None) if b13 is None else (b13[ids].to(x.dtype), b2[ids].to(x.dtype))
        ids = list(range(len(ids)))
    h = torch.stack([w13[s] @ xv for s in ids])  # [k, 2F]
    if b13 is not None:
        h = h + b13[ids]
    g, u = h.chunk(2, dim=-1)  # [k, F] each
    gate = weights[0].to(x.dtype)
    act = kind.glu(g, u) * gate.unsqueeze(-1)
    out = w2[ids[0]] @ act[0]
    for j in range(1, len(ids)):
        out.addmv_(w2[ids[j]], act[j])
    if b2 is not None:  # sum_j gate_j (W2_j act_j + b2_j): the gates already sit in act
        out.addmv_(b2[ids].t(), gate)
    return out.unsqueeze(0)


def plan_row(encoding: int, rows: int, cols: int) -> np.ndarray:
    """A float matrix's plan row: its encoding, values at offset 0, rows and columns."""
    row = np.full(PLAN_COLUMNS, -1, np.int64)
    row[ENCODING], row[VALUES], row[ROWS], row[COLS], row[GROUP] = encoding, 0, rows, cols, 0
    return row


def stacked_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor stacked by slot ([S, ...]) as uint8 [S, bytes] sharing its memory: each slot's part as
    kernel.matvec reads it."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


NO_PART = np.zeros((0, 0), np.uint8)  # the bias buffers of a family without expert biases


class CompiledExperts:
    """The compiled expert calls (kernel.expert_compute), a decode token's and a window's, over one cache's CPU
    slots in any format: float slot tensors (fp32, fp16, bf16) or quantized blobs (int8, int4, MXFP4) with
    their plan. Each call splits its products over the threads when they stream enough weights
    (engine/threads.py); the scratch grows to the largest call run so far."""

    def __init__(self, buf13: np.ndarray, row13: np.ndarray, buf2: np.ndarray, row2: np.ndarray,
                 biases: tuple | None, kind: ExpertKind, expert_bytes: int):
        self.buf13, self.row13, self.buf2, self.row2 = buf13, row13, buf2, row2
        self.biases = biases or (NO_PART, row13, NO_PART, row13)
        self.limit, self.alpha = np.float32(kind.limit or 0.0), np.float32(kind.alpha)
        self.H, self.F = int(row2[ROWS]), int(row2[COLS])
        self.groups = activation_group(row13), activation_group(row2)
        self.expert_bytes = expert_bytes
        self.token_work: dict[tuple[int, int, int], tuple] = {}  # by (k, parts, token of a decode batch)
        self.window_work: tuple | None = None
        self.window_shape = (0, 0, 0)  # (tokens, k, parts) the window scratch holds

    @classmethod
    def of_floats(cls, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                  kind: ExpertKind) -> "CompiledExperts":
        """Over float slots w13 [S, 2F, H], w2 [S, H, F] (biases b13 [S, 2F], b2 [S, H]) on the CPU."""
        biases = None if b13 is None else (stacked_bytes(b13), plan_row(RAW_ENCODINGS[b13.dtype], 1, b13.shape[1]),
                                           stacked_bytes(b2), plan_row(RAW_ENCODINGS[b2.dtype], 1, b2.shape[1]))
        return cls(stacked_bytes(w13), plan_row(RAW_ENCODINGS[w13.dtype], *w13.shape[1:]), stacked_bytes(w2),
                   plan_row(RAW_ENCODINGS[w2.dtype], *w2.shape[1:]), biases, kind,
                   (w13[0].numel() + w2[0].numel()) * w13.element_size())

    @classmethod
    def of_blobs(cls, blobs: torch.Tensor, plan: np.ndarray, kind: ExpertKind) -> "CompiledExperts":
        """Over quantized slots: blobs uint8 [S, bytes] in the format of `plan` (quant.decode_plan)."""
        b = blobs.numpy()
        biases = (b, plan[2], b, plan[3]) if plan.shape[0] > 2 else None
        return cls(b, plan[0], b, plan[1], biases, kind, blobs.shape[1])

    @staticmethod
    def applies(w13: torch.Tensor | None) -> bool:
        """Whether float slots of this kind can run compiled: fp32, fp16 or bf16 on the CPU, outside autograd."""
        return w13 is not None and w13.device.type == "cpu" and w13.dtype in RAW_ENCODINGS and not w13.requires_grad

    def _matrices(self) -> tuple:
        return (self.buf13, self.row13, self.buf2, self.row2, *self.biases, self.limit, self.alpha)

    def _token_work(self, k: int, parts: int, token: int = 0) -> tuple:
        work = self.token_work.get((k, parts, token))
        if work is None:
            work = self.token_work[k, parts, token] = token_work(k, self.H, self.F, *self.groups, parts)
        return work

    def __call__(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray) -> torch.Tensor:
        """Decode: x [1, H] fp32, slots [k] int64, gates [k] float32 -> [1, H]."""
        k = slots.shape[0]
        parts = threads.parts(k * self.expert_bytes)
        out = torch.empty_like(x)
        experts_token(x.numpy()[0], slots, gates, *self._matrices(), self._token_work(k, parts), out.numpy()[0],
                      parts)
        return out

    @property
    def one_by_one(self) -> bool:
        """Whether a decode token's experts are worth running one by one as their reads land (`some`, `total`):
        where an expert streams as much as a split over the threads pays for. Below that a call's own cost is
        more than the compute it hides (the built-in model's 60 KiB experts)."""
        return self.expert_bytes >= threads.MIN_PARALLEL_BYTES

    def some(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray, which: np.ndarray, first: bool,
             token: int = 0) -> None:
        """The experts `which` (int64 indices into slots) of a decode token, the arguments as `__call__`'s, into
        the scratch of `token` (a decode batch's tokens each have their own), not yet summed; `first`: the
        token's first such call. `total` ends the token: the same output as `__call__`'s, bit for bit (the same
        products over the same row ranges, summed in order)."""
        parts = threads.parts(self.expert_bytes)
        experts_of_token(x.numpy()[0], which, first, slots, gates, self.buf13, self.row13, self.buf2, self.row2,
                         *self.biases[:2], self.limit, self.alpha, self._token_work(slots.shape[0], parts, token),
                         parts)

    def total(self, slots: np.ndarray, gates: np.ndarray, token: int = 0) -> torch.Tensor:
        """The token's output [1, H] once `some` has run each of its experts."""
        out = torch.empty(1, self.H)
        work = self._token_work(slots.shape[0], threads.parts(self.expert_bytes), token)
        experts_token_sum(slots, gates, *self.biases[2:], work, out.numpy()[0])
        return out

    def window(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray) -> torch.Tensor:
        """A window's experts in one compiled call: x [T, H] fp32, slots [T, k] int64, gates [T, k] float32
        (gate 0: padding) -> [T, H]."""
        T, k = slots.shape
        parts = threads.parts(min(T * k, self.buf13.shape[0]) * self.expert_bytes)
        have = self.window_shape
        if self.window_work is None or T > have[0] or k != have[1] or parts != have[2]:
            self.window_work = window_work(max(T, have[0]), k, self.buf13.shape[0], self.H, self.F, *self.groups,
                                           parts)
            self.window_shape = (max(T, have[0]), k, parts)
        out = torch.empty_like(x)
        experts_window(x.contiguous().numpy(), np.ascontiguousarray(slots), np.ascontiguousarray(gates),
                       *self._matrices(), self.window_work, out.numpy(), parts)
        return out

    @property
    def work_bytes(self) -> int:
        """Bytes of the scratch held now."""
        held = [w for works in self.token_work.values() for w in works] + list(self.window_work or ())
        return sum(w.nbytes for w in held)


def experts_grouped(x, slots, weights, w13, w2, b13=None, b2=None, kind: ExpertKind = SWIGLU):
    """Large batches: one matmul pair per used slot. x [T, H], slots, weights [T, k] -> [T, H].
    Slots in another float dtype than x (16-bit slots, fp32 compute) are widened per expert run."""
    if w13.requires_grad:  # training: per-expert views, so backward does not build a full-size gradient per index
        w13, w2 = w13.unbind(0), w2.unbind(0)

    def expert(s: int):
        return tuple(None if t is None else t[s].to(x.dtype) for t in (w13, w2, b13, b2))
    return experts_grouped_by(x, slots, weights, expert, kind)


def experts_grouped_by(x, slots, weights, expert, kind: ExpertKind = SWIGLU):
    """experts_grouped with each used slot's weights from `expert(slot) -> (w13 [2F, H], w2 [H, F],
    b13 [2F] or None, b2 [H] or None)` in x's dtype: how quantized slots dequantise per expert run."""
    assert slots.shape == weights.shape and slots.shape[0] == x.shape[0], (x.shape, slots.shape, weights.shape)
    k = slots.shape[1]
    order, used, counts = expert_groups(slots.to(x.device))
    token = order // k
    xs = x[token]
    out_rows, start = [], 0
    for s, c in zip(used, counts):
        out_rows.append(swiglu(xs[start:start + c], *expert(s), kind))
        start += c
    y = torch.cat(out_rows) * weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def experts_compute(x, slots, weights, w13, w2, b13=None, b2=None, kind: ExpertKind = SWIGLU):
    """x [T, H], slots [T, k] (a host tensor: the decode path reads it without a device sync),
    weights [T, k] -> the gate-weighted sum of each token's experts [T, H]: PyTorch's ops (CUDA, autograd)."""
    run = experts_one_token if x.shape[0] == 1 else experts_grouped
    return run(x, slots, weights, w13, w2, b13, b2, kind)
