"""Expert compute over stacked weights (w13 [S, 2F, H], w2 [S, H, F], indexed by slot or
expert id; optional biases b13 [S, 2F], b2 [S, H]): one token's k experts as matrix-vector
products, or a batch grouped by expert. Offload-agnostic: the cache has already rewritten
expert ids into slot ids."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kernel.expert_compute import experts_token, experts_window, window_scratch


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
NO_BIAS = np.zeros((0, 0), np.float32)
# how the compiled kernel sees slots of each dtype: numpy has no fp16 arithmetic in numba and no bf16
# at all, so 16-bit slots go in as their bits (kernel/compiled.widen converts them exactly)
KERNEL_VIEWS = {torch.float32: torch.float32, torch.float16: torch.uint16, torch.bfloat16: torch.int16}


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


def compiled_applies(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether decode's compiled kernel can run: one fp32 token on the CPU, no autograd."""
    return (x.shape[0] == 1 and x.device.type == "cpu" and x.dtype == w13.dtype == torch.float32
            and not (x.requires_grad or w13.requires_grad))


def experts_one_token_compiled(x, slots, weights, w13, w2, b13=None, b2=None, kind: ExpertKind = SWIGLU):
    """experts_one_token as one compiled call (kernel.expert_compute); x [1, H] fp32 on the CPU."""
    return CompiledSlots(w13, w2, b13, b2, kind)(x.contiguous(), slots[0].numpy(), weights[0].to(torch.float32).numpy())


def grown_scratch(scratch: tuple[np.ndarray, ...] | None, assignments: int, S: int, H: int, F: int
                  ) -> tuple[np.ndarray, ...]:
    """A window kernel's scratch (kernel.expert_compute.window_scratch), new when `scratch` has no room for
    `assignments` (token, expert) pairs: the kernel checks no bounds."""
    return scratch if scratch is not None and assignments <= len(scratch[1]) else window_scratch(assignments, S, H, F)


class CompiledSlots:
    """The compiled expert calls (kernel.expert_compute), a decode token's and a window's, over one
    cache's CPU slot tensors (fp32, fp16 or bf16), their numpy views taken once: what is left per call
    is the kernel itself."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                 kind: ExpertKind):
        biases = (NO_BIAS, NO_BIAS) if b13 is None else (kernel_view(b13), kernel_view(b2))
        self.weights = (kernel_view(w13), kernel_view(w2), *biases, np.float32(kind.limit or 0.0),
                        np.float32(kind.alpha), np.empty(w2.shape[2], np.float32))
        self.scratch: tuple[np.ndarray, ...] | None = None  # windows', grown to the most assignments run so far

    @staticmethod
    def applies(w13: torch.Tensor | None) -> bool:
        """Whether slots of this kind can run compiled: fp32, fp16 or bf16 on the CPU, outside autograd."""
        return w13 is not None and w13.device.type == "cpu" and w13.dtype in KERNEL_VIEWS and not w13.requires_grad

    def __call__(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray) -> torch.Tensor:
        """x [1, H] fp32, slots [k] int64, gates [k] float32 -> [1, H]."""
        out = torch.empty_like(x)
        experts_token(x.numpy()[0], slots, gates, *self.weights, out.numpy()[0])
        return out

    def window(self, x: torch.Tensor, slots: np.ndarray, gates: np.ndarray) -> torch.Tensor:
        """A window's experts in one compiled call (kernel.expert_compute.experts_window): x [T, H] fp32,
        slots [T, k] int64, gates [T, k] float32 -> [T, H]."""
        w13, w2 = self.weights[:2]
        self.scratch = grown_scratch(self.scratch, slots.size, w13.shape[0], w13.shape[2], w2.shape[2])
        out = torch.empty_like(x)
        experts_window(x.contiguous().numpy(), np.ascontiguousarray(slots), np.ascontiguousarray(gates),
                       *self.weights[:6], *self.scratch, out.numpy())
        return out


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
    weights [T, k] -> the gate-weighted sum of each token's experts [T, H]."""
    if compiled_applies(x, w13):
        return experts_one_token_compiled(x, slots, weights, w13, w2, b13, b2, kind)
    run = experts_one_token if x.shape[0] == 1 else experts_grouped
    return run(x, slots, weights, w13, w2, b13, b2, kind)
