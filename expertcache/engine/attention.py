"""Attention variants beyond plain causal GQA with full RoPE: RoPE frequencies (default, linear, YaRN,
partial rotary) and their tables, which every attention kind shares (GQA, latent attention),
sliding-window masks, and softmax with per-head sinks (GPT-OSS)."""
from __future__ import annotations

import math

import torch

from ..errors import UnsupportedArchitecture
from ..models.args import ModelArgs, rope_type


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for stretching positions by `scale`: 0.1 * m * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_factor(a: ModelArgs) -> float:
    """The YaRN stretch `factor`; configs without one (DeepSeek-V3's) stretch max_position_embeddings over the
    original."""
    s = a.rope_scaling
    return s.get("factor") or a.max_position_embeddings / s["original_max_position_embeddings"]


def rope_frequencies(a: ModelArgs, dim: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot / 2], attention scaling of cos and sin) for the rotated part of each head,
    rot = `dim`, by default head_dim * partial_rotary_factor; YaRN as in HF's _compute_yarn_parameters."""
    dim = dim or int(a.head_dim * a.partial_rotary_factor)
    pos_freqs = a.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    s = a.rope_scaling or {}
    kind = rope_type(s)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind == "linear":  # positions divided by `factor`
        return 1.0 / (float(s["factor"]) * pos_freqs), 1.0
    if kind != "yarn":
        raise UnsupportedArchitecture(f"rope_type {kind!r} is not supported; supported: default, linear, yarn")
    original = s["original_max_position_embeddings"]
    factor = yarn_factor(a)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, s["mscale"]) / yarn_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(a.rope_theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(inv_freq: torch.Tensor, scale: float, max_seq: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq, rot] for rotate-half RoPE at frequencies inv_freq [rot / 2], both times
    `scale`; the sin signed so that rotate_half(x) * sin == cat(x2, x1) * sin_signed (one op fewer per call)."""
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    half = inv_freq.numel()
    sin_signed = torch.cat([-emb.sin()[:, :half], emb.sin()[:, half:]], dim=-1)
    return (emb.cos() * scale).to(device, dtype), (sin_signed * scale).to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int) -> torch.Tensor:
    """x [heads, T, D] at positions pos.. rotated by the tables of `rope_tables` over its first rot
    channels; a partial rotary (rot < D) leaves the last D - rot channels as they are."""
    T, rot = x.shape[1], cos.shape[1]
    xr = x[..., :rot]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos[pos:pos + T] + torch.cat((x2, x1), dim=-1) * sin[pos:pos + T]
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


def attention_mask(T: int, pos: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """bool [T, pos + T]: query t (at position pos + t) sees key j iff j <= pos + t and, with a
    sliding window, pos + t - j < window; None when every query sees every key."""
    if T == 1 and (window is None or pos < window):
        return None
    q = torch.arange(pos, pos + T, device=device)[:, None]
    k = torch.arange(pos + T, device=device)[None]
    mask = k <= q
    return mask & (k > q - window) if window is not None else mask


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention whose denominator also holds a learned logit per head (GPT-OSS's sinks).
    q [Hq, T, D], keys/values [Hkv, S, D], sinks [Hq], mask bool [T, S] or None -> [Hq, T, D]."""
    Hq, T, D = q.shape
    rep = Hq // keys.shape[0]
    keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    scores = (q @ keys.transpose(1, 2)) * D ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    scores = torch.cat([scores, sinks.view(Hq, 1, 1).expand(Hq, T, 1).to(scores.dtype)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :-1] @ values
