"""Gated DeltaNet (Qwen3-Next's linear attention): a causal depthwise conv over q, k, v, then the
gated delta rule, a recurrent state S [Hv, Dk, Dv] per layer updated per token as

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S

Decode (one token) runs that recurrence; a window of tokens runs the chunked form, which gives
the same outputs and final state with matrix products per chunk (HF's torch fallback, the
maths of flash-linear-attention's chunk kernel). The conv and recurrent states are carried
from call to call and restart at position 0, where the KV cache restarts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.args import ModelArgs

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dimension, as flash-linear-attention's l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """Token by token. q, k [Hv, T, Dk] (normalised and scaled), v [Hv, T, Dv], g, beta [Hv, T],
    state [Hv, Dk, Dv] (float32) -> (o [Hv, T, Dv], final state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv = (state * k[:, t, :, None]).sum(dim=-2)  # k_t^T S [Hv, Dv]
        state = state + k[:, t, :, None] * ((v[:, t] - kv) * beta[:, t, None])[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same maths as `delta_rule_recurrent`, chunk by chunk: within a chunk the delta rule's
    triangular system is solved at once (UT transform), across chunks the state carries."""
    H, T, Dk = q.shape
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(n):
        u = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q_dec[:, i] @ state + intra[:, i] @ u
        state = state * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ u
    return out.reshape(H, n * chunk, -1)[:, :T], state


class GatedDeltaNet:
    """One linear-attention layer over its weights in our names (lin_qkvz, lin_ba, lin_conv [C, K],
    lin_dt_bias, lin_A_log, lin_norm, lin_out), with its conv and recurrent states."""

    def __init__(self, args: ModelArgs, L: dict[str, torch.Tensor]):
        a = self.args = args
        self.L = L
        self.Hk, self.Hv = a.linear_num_key_heads, a.linear_num_value_heads
        self.Dk, self.Dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.conv_dim = 2 * self.Hk * self.Dk + self.Hv * self.Dv
        self.reset()

    def reset(self) -> None:
        """Empty conv and recurrent states (the start of a sequence)."""
        L = self.L
        self.conv_state = L["lin_conv"].new_zeros(self.conv_dim, self.args.linear_conv_kernel - 1)
        self.state = torch.zeros(self.Hv, self.Dk, self.Dv, device=L["lin_conv"].device, dtype=torch.float32)

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x [T, H] (normed) at positions pos.. -> the layer's output [T, H]; advances the states."""
        if pos == 0:
            self.reset()
        L, T = self.L, x.shape[0]
        Hk, Hv, Dk, Dv = self.Hk, self.Hv, self.Dk, self.Dv
        r = Hv // Hk
        # HF's fused projections are grouped per key head: [q, k, v (r heads), z (r heads)] and [b (r), a (r)]
        q, k, v, z = L["lin_qkvz"](x).view(T, Hk, 2 * Dk + 2 * r * Dv).split([Dk, Dk, r * Dv, r * Dv], -1)
        b, a = L["lin_ba"](x).view(T, Hk, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1).t()  # [C, T]
        window = torch.cat([self.conv_state, mixed], dim=-1)  # the previous K - 1 inputs, then these
        self.conv_state = window[:, window.shape[1] - self.conv_state.shape[1]:].clone()
        mixed = F.silu(F.conv1d(window[None], L["lin_conv"][:, None], groups=self.conv_dim)[0]).t()  # [T, C]
        q, k, v = mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        q, k = (t.reshape(T, Hk, Dk).repeat_interleave(r, dim=1).transpose(0, 1).float() for t in (q, k))
        v = v.reshape(T, Hv, Dv).transpose(0, 1).float()
        beta = b.reshape(T, Hv).sigmoid().t().float()
        g = (-L["lin_A_log"].float().exp() * F.softplus(a.reshape(T, Hv).float() + L["lin_dt_bias"])).t()
        q, k = l2norm(q) * Dk ** -0.5, l2norm(k)
        rule = delta_rule_recurrent if T == 1 else delta_rule_chunked
        o, self.state = rule(q, k, v, g, beta, self.state)
        o = o.transpose(0, 1).to(x.dtype)  # [T, Hv, Dv]
        o = F.rms_norm(o.float(), (Dv,), eps=self.args.rms_norm_eps).to(x.dtype) * L["lin_norm"]
        o = o * F.silu(z.reshape(T, Hv, Dv).float()).to(x.dtype)
        return L["lin_out"](o.reshape(T, Hv * Dv))
