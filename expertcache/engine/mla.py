"""Multi-head latent attention (DeepSeek-V3).

MLA projects each token to a low-rank latent c_kv [kv_lora_rank] (RMS-normed) and one
rotary key k_rope [qk_rope_head_dim] shared by every head; the per-head keys (nope part)
and values come from the latent through kv_b_proj. The cache holds the latent and the
rotary key, as HF's does (kv_lora_rank + qk_rope_head_dim numbers per token and layer
instead of heads * (qk_head_dim + v_head_dim)); each call expands the cached latents.
Under YaRN the softmax scale grows by mscale(factor, mscale_all_dim) ** 2 (DeepSeek's
yarn_apply_mscale), besides the attention factor on the rotary tables.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.args import ModelArgs
from .attention import (
    apply_rope,
    rope_frequencies,
    rope_tables,
    yarn_factor,
    yarn_mscale,
)

LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with the default eps, not the config's


def latent_softmax_scale(a: ModelArgs) -> float:
    """DeepSeek's attention softmax scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2
    when YaRN's parameters give an mscale_all_dim (as HF's yarn_apply_mscale)."""
    scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
    if a.rope_scaling and a.rope_scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(yarn_factor(a), a.rope_scaling["mscale_all_dim"]) ** 2
    return scale


class LatentAttention:
    """MLA over a latent KV cache [layers, max_seq, kv_lora_rank] + [layers, max_seq, qk_rope_head_dim]."""

    def __init__(self, args: ModelArgs, max_seq: int, device: torch.device, dtype: torch.dtype):
        a = self.args = args
        R = a.qk_rope_head_dim
        self.cos, self.sin = rope_tables(*rope_frequencies(a, R), max_seq, device, dtype)  # the rope part of each head
        # interleaved RoPE rotates pairs (x0, x1), (x2, x3), ...: de-interleaved, that is rotate-half RoPE
        self.order = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)]).to(device) \
            if a.rope_interleave else None
        self.scale = a.softmax_scale or latent_softmax_scale(a)
        self.latent = torch.zeros(a.num_layers, max_seq, a.kv_lora_rank, device=device, dtype=dtype)
        self.k_rope = torch.zeros(a.num_layers, max_seq, R, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the latent cache."""
        return self.latent.nbytes + self.k_rope.nbytes

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:  # x [heads, T, R]
        if self.order is not None:
            x = x[..., self.order]
        return apply_rope(x, self.cos, self.sin, pos)

    def __call__(self, i: int, L: dict, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Layer i's attention: x [T, H] (normed) at positions pos.. -> [T, H]; extends the latent cache."""
        a = self.args
        T, nh = x.shape[0], a.num_heads
        nope, R, vd = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        if a.q_lora_rank:
            q_a = L["wq_a"](x)
            q = L["wq_b"](F.rms_norm(q_a, (a.q_lora_rank,), L["q_a_norm"], LATENT_NORM_EPS))
        else:
            q = L["wq"](x)
        q = q.view(T, nh, nope + R).transpose(0, 1)  # [nh, T, nope + R]
        ckv = L["wkv_a"](x)
        latent, k_rope = ckv.split([a.kv_lora_rank, R], dim=-1)
        self.latent[i, pos:pos + T] = F.rms_norm(latent, (a.kv_lora_rank,), L["kv_a_norm"], LATENT_NORM_EPS)
        self.k_rope[i, pos:pos + T] = self._rope(k_rope.unsqueeze(0), pos)[0]
        q = torch.cat([q[..., :nope], self._rope(q[..., nope:], pos)], dim=-1)
        S = pos + T
        kv = L["wkv_b"](self.latent[i, :S]).view(S, nh, nope + vd).transpose(0, 1)  # [nh, S, nope + vd]
        keys = torch.cat([kv[..., :nope], self.k_rope[i, :S].expand(nh, S, R)], dim=-1)
        values = kv[..., nope:]
        mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                           scale=self.scale)
        return L["wo"](o[0].transpose(0, 1).reshape(T, nh * vd))
