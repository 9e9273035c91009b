"""The decoder: embeddings, attention with a static KV cache, and MoE layers whose experts
come from the expert cache (the first `first_dense_layers` layers run a dense SwiGLU MLP).
One sequence at a time (generation, or a teacher-forced window)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..models.args import ModelArgs
from .mla import LatentAttention, rope_tables
from .weights import router_of

# (MoE layer, normed MoE input [T, H], router [E, H]) -> routed experts' output [T, H]
MoEFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# (MoE layer, residual stream after attention [T, H]) -> None: lets a predictor request layer+1's experts
PrefetchHook = Callable[[int, torch.Tensor], None]


class Transformer:
    """The decoder over dense weights in our names; `moe(layer, x, router)` supplies each MoE layer's
    routed output, `prefetch(layer, h)` (if set) sees the residual after each attention; `layer`
    counts MoE layers (decoder layer - first_dense_layers)."""
    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], moe: MoEFn,
                 device: torch.device, max_seq: int = 2048):
        self.args, self.moe, self.device, self.max_seq = args, moe, device, max_seq
        a = args
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed, self.norm = w["embed"], w["norm"]
        self.lm_head = w["embed"] if a.tie_word_embeddings else w["lm_head"]
        self.layers = []
        for i in range(a.num_layers):
            p = f"layers.{i}."
            L = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
            if a.attention == "gqa":
                L["wqkv"] = torch.cat([L.pop("wq"), L.pop("wk"), L.pop("wv")])  # one matmul for q, k, v
                if a.attention_bias:
                    L["bqkv"] = torch.cat([L.pop("bq"), L.pop("bk"), L.pop("bv")])
            for mlp in ("shared", "dense"):
                if mlp + "_w1" in L:
                    L[mlp + "_w13"] = torch.cat([L.pop(mlp + "_w1"), L.pop(mlp + "_w3")])
            self.layers.append(L)
        self.moe_layers = self.layers[a.first_dense_layers:]  # indexed as the cache and the kernel do
        self.router = router_of(a, weights)
        dtype = self.embed.dtype
        self.latent = LatentAttention(a, max_seq, device, dtype) if a.attention == "mla" else None
        if self.latent is None:
            self.cos, self.sin = rope_tables(a.rope_theta, a.rotary_dim or a.head_dim, max_seq, device, dtype)
            shape = (a.num_layers, a.num_kv_heads, max_seq, a.head_dim)
            self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
            self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.prefetch: PrefetchHook | None = None

    @property
    def kv_bytes(self) -> int:
        """Bytes of the attention cache."""
        if self.latent is not None:
            return self.latent.nbytes
        return self.k_cache.nbytes + self.v_cache.nbytes

    @property
    def dense_bytes(self) -> int:
        """Bytes of the dense (non-expert) weights, each tensor counted once."""
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [v for L in self.layers for v in L.values()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
        return total

    def _rope(self, x, pos: int):  # x [heads, T, D]
        T, R = x.shape[1], self.cos.shape[1]
        if R < x.shape[-1]:  # partial RoPE: the rest of each head passes through
            return torch.cat([self._rope(x[..., :R], pos), x[..., R:]], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos[pos:pos + T] + torch.cat((x2, x1), dim=-1) * self.sin[pos:pos + T]

    def _attention(self, i: int, L: dict, x: torch.Tensor, pos: int) -> torch.Tensor:
        if self.latent is not None:
            return self.latent(i, L, x, pos)
        a = self.args
        T = x.shape[0]
        qkv = F.linear(x, L["wqkv"], L.get("bqkv"))
        nq, nk = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, k, v = qkv.split([nq, nk, nk], dim=-1)
        if a.qk_norm == "full":
            q = F.rms_norm(q, (nq,), L["q_norm"], a.rms_norm_eps)
            k = F.rms_norm(k, (nk,), L["k_norm"], a.rms_norm_eps)
        if a.clip_qkv is not None:  # OLMoE clips after its q/k norms
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(T, a.num_heads, a.head_dim)
        k = k.view(T, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q = F.rms_norm(q, (a.head_dim,), L["q_norm"], a.rms_norm_eps)
            k = F.rms_norm(k, (a.head_dim,), L["k_norm"], a.rms_norm_eps)
        q, k = self._rope(torch.cat([q, k], dim=1).transpose(0, 1), pos).split([a.num_heads, a.num_kv_heads])
        self.k_cache[i, :, pos:pos + T] = k
        self.v_cache[i, :, pos:pos + T] = v.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)
        keys, values = self.k_cache[i, :, :pos + T], self.v_cache[i, :, :pos + T]
        if T == 1:
            mask = None
        else:  # query t sees keys up to pos + t
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        o = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                           attn_mask=mask, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(T, nq) @ L["wo"].t()

    def _mlp(self, L: dict, x: torch.Tensor, name: str) -> torch.Tensor:
        """A SwiGLU MLP of the layer's `name`_w13, `name`_w2 (the shared expert, or a dense layer's MLP)."""
        g, u = (x @ L[name + "_w13"].t()).chunk(2, dim=-1)
        return (F.silu(g) * u) @ L[name + "_w2"].t()

    def _shared_expert(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        y = self._mlp(L, x, "shared")
        return torch.sigmoid(x @ L["shared_gate"].t()) * y if self.args.shared_expert_gate else y

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """ids [T] at positions pos..pos+T-1 -> logits [T, V]; extends the KV cache."""
        assert ids.dim() == 1, f"ids must be [T], got {tuple(ids.shape)}"
        a = self.args
        T = ids.shape[0]
        if pos + T > self.max_seq:
            raise ValueError(f"sequence of {pos + T} tokens exceeds max_seq={self.max_seq}; raise --max-seq")
        h = self.embed[ids]
        for i, L in enumerate(self.layers):
            h = h + self._attention(i, L, F.rms_norm(h, (a.hidden_size,), L["attn_norm"], a.rms_norm_eps), pos)
            x = F.rms_norm(h, (a.hidden_size,), L["moe_norm"], a.rms_norm_eps)
            if i < a.first_dense_layers:
                h = h + self._mlp(L, x, "dense")
                continue
            if self.prefetch is not None:
                self.prefetch(i - a.first_dense_layers, h)
            y = self.moe(i - a.first_dense_layers, x, L["router"])
            if a.shared_expert_dim:
                y = y + self._shared_expert(L, x)
            h = h + y
        return F.rms_norm(h, (a.hidden_size,), self.norm, a.rms_norm_eps) @ self.lm_head.t()
