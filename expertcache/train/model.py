"""A trainable Qwen3-MoE: the same maths as HF's Qwen3MoeForCausalLM, laid out for CPU training.

Experts are stacked parameters (w13 [E, 2F, H], w2 [E, H, F]); each step sorts the
(token, expert) assignments by expert and runs one matmul pair per expert, so no
capacity padding is spent. `hf_state_dict` writes the checkpoint under HF's names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.experts import experts_grouped


@dataclass(frozen=True)
class TrainConfig:
    """The shape of the built-in model (Qwen3-MoE field names)."""
    vocab_size: int = 8192
    hidden_size: int = 160
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 40
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        """x [..., D] -> [..., D]."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):  # x [B, heads, T, D]
    """Rotary embedding (HF's rotate-half form): x [B, heads, T, D], cos, sin [T, D] -> [B, heads, T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    """One decoder layer: GQA attention with per-head q/k RMSNorm, then the MoE over stacked experts."""
    def __init__(self, c: TrainConfig):
        super().__init__()
        self.c = c
        H, D = c.hidden_size, c.head_dim
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(H, c.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)
        self.gate = nn.Linear(H, c.num_experts, bias=False)
        E, Fi = c.num_experts, c.moe_intermediate_size
        self.w13 = nn.Parameter(torch.randn(E, 2 * Fi, H) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, H, Fi) / math.sqrt(Fi) / math.sqrt(2 * c.num_hidden_layers))

    def attention(self, x, cos, sin):
        """Causal attention over the whole sequence: x [B, T, H] -> [B, T, H]."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_norm(self.q_proj(x).view(B, T, -1, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, c.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def moe(self, x):
        """x [N, H] -> (out [N, H], balance loss, expert counts [E]): softmax router, top-k, renormalised."""
        c = self.c
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        w, idx = probs.topk(c.num_experts_per_tok, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = experts_grouped(x, idx, w, self.w13, self.w2)
        # Switch-style balance per layer: E * sum_e (share of assignments) * (mean prob).
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=c.num_experts).tolist()
        share = torch.bincount(flat, minlength=c.num_experts).float() / flat.numel()
        balance = c.num_experts * (share * probs.mean(0)).sum()
        return out, balance, torch.tensor(counts)

    def forward(self, x, cos, sin):
        """x [B, T, H] -> (x [B, T, H], balance loss, expert counts [E])."""
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        B, T, H = x.shape
        out, balance, counts = self.moe(self.post_attention_layernorm(x).view(-1, H))
        return x + out.view(B, T, H), balance, counts


class TrainableQwen3Moe(nn.Module):
    """The built-in Qwen3-MoE model as a trainable module with tied embeddings."""
    def __init__(self, c: TrainConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids):
        """ids [B, T] -> logits [B, T, V], mean balance loss, expert counts [L, E]."""
        assert ids.dim() == 2, f"ids must be [B, T], got {tuple(ids.shape)}"
        T = ids.shape[1]
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(ids)
        balances, counts = [], []
        for layer in self.layers:
            x, b, n = layer(x, cos, sin)
            balances.append(b)
            counts.append(n)
        logits = self.norm(x) @ self.embed_tokens.weight.t()
        return logits, torch.stack(balances).mean(), torch.stack(counts)

    def hf_config(self) -> dict:
        """The config.json of the exported HF checkpoint."""
        c = self.c
        return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                    vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                    intermediate_size=4 * c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                    num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                    rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                    rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                    attention_bias=False, hidden_act="silu", router_aux_loss_coef=0.001,
                    bos_token_id=None, eos_token_id=0, pad_token_id=0, torch_dtype="float16")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF's Qwen3-MoE names, experts unstacked (views, detached)."""
        sd = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        Fi = self.c.moe_intermediate_size
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name in ["input_layernorm", "post_attention_layernorm"]:
                sd[p + name + ".weight"] = getattr(L, name).weight
            for name in ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]:
                sd[p + "self_attn." + name + ".weight"] = getattr(L, name).weight
            sd[p + "mlp.gate.weight"] = L.gate.weight
            for e in range(self.c.num_experts):
                q = p + f"mlp.experts.{e}."
                sd[q + "gate_proj.weight"] = L.w13[e, :Fi]
                sd[q + "up_proj.weight"] = L.w13[e, Fi:]
                sd[q + "down_proj.weight"] = L.w2[e]
        return {k: v.detach() for k, v in sd.items()}
