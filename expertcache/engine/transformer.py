"""The decoder: embeddings, attention with a static KV cache, and MoE layers whose experts
come from the expert cache (dense layers, `ModelArgs.is_dense`, run a SwiGLU MLP).
One sequence at a time (generation, or a teacher-forced window), or a batch of sequences decoding
one token each against their own keys and values (`forward_batch`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadInput
from ..kernel import dense_decode
from ..models.args import ModelArgs
from .attention import apply_rope, attention_mask, rope_frequencies, rope_tables, sink_attention
from ..kernel.linear import activation_work
from . import threads
from .linear import ActivationScratch, Linear
from .linear_attention import GatedDeltaNet
from .mla import LatentAttention
from .quant import ExpertFormat
from .budget import ATTENTION_CHUNK
from .weights import MATRICES, router_of

# each dense matrix's bias, in our names (a Linear holds its bias)
MATRIX_BIASES = {"wqkv": "bqkv", "wo": "bo", "wq_a": "bq_a", "wkv_a": "bkv_a"}

# (MoE layer, normed MoE input [T, H], router weight [E, H]) -> routed experts' output [T, H]; a router's bias
# lives in the model's Router (kernel/routing.py), which the MoE function routes with
MoEFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# (MoE layer, residual stream after attention [T, H]) -> None: lets a predictor request layer+1's experts
PrefetchHook = Callable[[int, torch.Tensor], None]


KV_START = 256  # positions the KV cache holds before it first grows


class Transformer:
    """The decoder over dense weights in our names; `moe(layer, x, router)` supplies each MoE layer's
    routed output, `prefetch(layer, h)` (if set) sees the residual after each attention; `layer`
    counts MoE layers (the decoder layers of `ModelArgs.moe_layers`, in order)."""
    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], moe: MoEFn,
                 device: torch.device, max_seq: int = 2048, dtype: torch.dtype = torch.float32,
                 dense: ExpertFormat | None = None, held: torch.dtype | None = None):
        """weights: dense_weights' tensors; dtype: the compute dtype (activations, norms); the dense matrices
        held as `held` (None: as given) or quantized to `dense` (the CPU kernels' int8 / int4)."""
        self.args, self.moe, self.device, self.max_seq = args, moe, device, max_seq
        a = args
        w = weights  # each tensor read as it is converted (weights.DenseWeights), a layer's before the next layer's
        self.dtype = dtype
        self.embed, self.norm = w["embed"].to(device), w["norm"].to(device)

        self.scratch_activations = ActivationScratch()  # a window's int8 activations, shared by the matrices
        self.position: int | None = None  # the first position of the one sequence's forward running (attention_ahead)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, dense, held if device.type == "cpu" else dtype, self.scratch_activations)
        self.lm_head = linear(w["lm_head"].to(device) if "lm_head" in w else self.embed)  # tied: no lm_head saved
        self.layers = []
        for i in range(a.num_layers):
            p = f"layers.{i}."
            L = {k[len(p):]: w[k].to(device) for k in w if k.startswith(p)}
            if "wk" in L:  # linear-attention and latent-attention layers have no k, v (latent: wq without a q rank)
                L["wqkv"] = torch.cat([L.pop("wq"), L.pop("wk"), L.pop("wv")])  # one matmul for q, k, v
            if a.attention_bias and "bq" in L:
                L["bqkv"] = torch.cat([L.pop("bq"), L.pop("bk"), L.pop("bv")])
            for mlp in ("shared", "dense"):
                if mlp + "_w1" in L:
                    L[mlp + "_w13"] = torch.cat([L.pop(mlp + "_w1"), L.pop(mlp + "_w3")])
            for name in [n for n in L if n in MATRICES + ("wqkv", "shared_w13", "dense_w13") and n != "router"]:
                L[name] = linear(L[name], L.pop(MATRIX_BIASES[name], None) if name in MATRIX_BIASES else None)
            if "router" in L:  # a plain tensor (never quantized), which the router's compiled product widens on the CPU
                L["router"] = L["router"].to(held or L["router"].dtype) if device.type == "cpu" else L["router"].to(dtype)
            self.layers.append(L)
        self.moe_layers = [self.layers[i] for i in a.moe_layers]  # indexed as the cache and the kernel do
        self.moe_index = {i: j for j, i in enumerate(a.moe_layers)}  # decoder layer -> MoE layer
        self.router = router_of(a, weights)
        # multi-head latent attention caches a latent per position (preallocated at max_seq), not keys and values
        self.latent = LatentAttention(a, max_seq, device, dtype) if a.attention == "mla" else None
        if self.latent is None:  # RoPE over the rotated part of each head (all of it unless partial)
            self.cos, self.sin = rope_tables(*rope_frequencies(a), max_seq, device, dtype)
        # Gated DeltaNet layers carry a recurrent state instead of keys and values
        self.linear = {i: GatedDeltaNet(a, self.layers[i]) for i in range(a.num_layers)
                       if a.layer_type(i) == "linear_attention"}
        kv_layers = [] if self.latent is not None else [i for i in range(a.num_layers) if i not in self.linear]
        self.kv_index = {i: n for n, i in enumerate(kv_layers)}
        # keys and values grow to what a sequence uses (doubling), up to max_seq
        shape = (len(self.kv_index), a.num_kv_heads, min(max_seq, KV_START), a.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.prefetch: PrefetchHook | None = None
        # decode's compiled logits and attention block (kernel/dense_decode.py): fp32 compute on the
        # CPU; the attention block for GQA layers (not latent or gated attention)
        self.compiled_logits = device.type == "cpu" and dtype == torch.float32
        self.compiled = self.compiled_logits and self.latent is None and not a.attention_gate
        if self.compiled:
            self.token_args = {i: self._token_args(i, self.layers[i]) for i in self.kv_index}
            self.scratch = np.empty(dense_decode.scratch_size(a.hidden_size, a.num_heads, a.num_kv_heads,
                                                              a.head_dim), np.float32)
            self.scores = np.empty((a.num_heads, max_seq), np.float32)
            self.cos_np, self.sin_np = self.cos.numpy(), self.sin.numpy()
        self._kv_views: tuple = (None, None)  # (keys, values, their arrays) during a forward (_kv_arrays)

    def kv_bytes(self, positions: int) -> int:
        """Bytes of the attention caches holding `positions` positions: keys and values, and a latent
        cache (multi-head latent attention), which is preallocated at max_seq and counts in full."""
        k = self.k_cache
        latent = self.latent.nbytes if self.latent is not None else 0
        return 2 * k.shape[0] * k.shape[1] * positions * k.shape[3] * k.element_size() + latent

    @property
    def state_beyond_kv(self) -> bool:
        """Whether a sequence's state is more than its keys and values (latent attention's cache, linear
        attention's recurrent state): held by the model, not swapped or batched with a sequence's keys and values."""
        return self.latent is not None or bool(self.linear)

    @property
    def kv_positions(self) -> int:
        """Positions the KV cache holds now (it grows as a sequence needs)."""
        return self.k_cache.shape[2]

    def _reserve(self, positions: int) -> None:
        """Grow the KV cache to hold `positions` positions (at least doubling, at most max_seq)."""
        have = self.k_cache.shape[2]
        if positions <= have:
            return
        n = min(self.max_seq, max(positions, 2 * have))

        def grow(c: torch.Tensor) -> torch.Tensor:
            return torch.cat([c, c.new_zeros(c.shape[0], c.shape[1], n - have, c.shape[3])], dim=2)
        self.k_cache, self.v_cache = grow(self.k_cache), grow(self.v_cache)

    @property
    def dense_bytes(self) -> int:
        """Bytes of the dense (non-expert) weights as held, each tensor counted once (a tied output matrix held
        as the embedding is not counted twice)."""
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [v for L in self.layers for v in L.values()]:
            parts = ([t.weight if t.weight is not None else t.buf, t.bias] if isinstance(t, Linear) else [t])
            for x in parts:
                if x is None:
                    continue
                key = x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data
                if key not in seen:
                    seen.add(key)
                    total += x.nbytes
        return total

    def _rope(self, x, pos: int):  # x [heads, T, D]; a partial rotary leaves the last D - rot channels as they are
        return apply_rope(x, self.cos, self.sin, pos)

    def _attention(self, i: int, L: dict, x: torch.Tensor, pos: int) -> torch.Tensor:
        if self.latent is not None:
            return self.latent(i, L, x, pos)
        q, k, v, gate = self._qkv(L, x)
        return self._out(L, self._attend(i, L, q, k, v, pos, self.k_cache, self.v_cache), gate)

    def _qkv(self, L: dict, x: torch.Tensor):
        """x [T, H] -> q [T, Hq, D], k, v [T, Hkv, D] (normed, clipped, not yet rotated), and the output
        gate [T, Hq, D] or None."""
        a = self.args
        T = x.shape[0]
        qkv = L["wqkv"](x)
        nq, nk = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, k, v = qkv.split([nq * (2 if a.attention_gate else 1), nk, nk], dim=-1)
        gate = None
        if a.attention_gate:  # per head: D query channels, then D gate channels
            q, gate = q.view(T, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
            q = q.reshape(T, nq)
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
        return q, k, v.view(T, a.num_kv_heads, a.head_dim), gate

    def _attend(self, i: int, L: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One sequence's attention: q [T, Hq, D], k, v [T, Hkv, D] at positions pos.. are rotated, their keys
        and values written to k_cache, v_cache [kv layers, Hkv, positions, D] -> o [T, Hq * D]."""
        a = self.args
        T = q.shape[0]
        q, k = self._rope(torch.cat([q, k], dim=1).transpose(0, 1), pos).split([a.num_heads, a.num_kv_heads])
        c = self.kv_index[i]
        k_cache[c, :, pos:pos + T] = k
        v_cache[c, :, pos:pos + T] = v.transpose(0, 1)
        window = a.sliding_window if a.layer_type(i) == "sliding_attention" else None
        parts = []
        for t0 in range(0, T, ATTENTION_CHUNK):  # query rows in chunks: the scores held are a chunk's, not T x S
            t1 = min(T, t0 + ATTENTION_CHUNK)
            keys, values = k_cache[c, :, :pos + t1], v_cache[c, :, :pos + t1]
            mask = attention_mask(t1 - t0, pos + t0, window, q.device)
            if a.attention_sinks:
                parts.append(sink_attention(q[:, t0:t1], keys, values, L["sinks"], mask))
            else:
                parts.append(F.scaled_dot_product_attention(q[None, :, t0:t1], keys[None], values[None],
                                                            attn_mask=mask, enable_gqa=True)[0])
        o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return o.transpose(0, 1).reshape(T, a.num_heads * a.head_dim)

    def _out(self, L: dict, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The output projection of o [T, Hq * D], gated per channel when the model has an attention gate."""
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(o.shape))
        return L["wo"](o)

    def _token_args(self, i: int, L: dict) -> tuple:
        """Layer i's weights as attention_token takes them (empty arrays for what the family lacks)."""
        a = self.args
        empty = dense_decode.EMPTY

        def arr(name: str) -> np.ndarray:
            return L[name].contiguous().numpy() if name in L else empty

        def bias(m: Linear) -> np.ndarray:
            return m.bias.numpy() if m.bias is not None else empty
        mode = {None: dense_decode.NORM_NONE, "full": dense_decode.NORM_FULL, "head": dense_decode.NORM_HEAD}
        window = a.sliding_window if a.layer_type(i) == "sliding_attention" else 0
        qkv, wo = L["wqkv"], L["wo"]
        return (arr("attn_norm"), arr("moe_norm"), np.float32(a.rms_norm_eps), qkv.buf, qkv.row, bias(qkv),
                mode[a.qk_norm], arr("q_norm"), arr("k_norm"), np.float32(a.clip_qkv or 0.0)), \
            (window, arr("sinks") if a.attention_sinks else empty, wo.buf, wo.row, bias(wo), a.num_heads,
             a.num_kv_heads), (activation_work(1, qkv.cols, qkv.row), activation_work(1, wo.cols, wo.row),
                               threads.parts(qkv.nbytes + wo.nbytes))

    def _attention_token(self, i: int, h: torch.Tensor, pos: int, kv: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """Decode: layer i's attention block on one token in one compiled call; h [1, H] is updated in
        place and the MoE input rms_norm(h) returned. kv: the keys and values to use (default: the model's)."""
        x = torch.empty_like(h)
        self._attention_call(i, h.numpy()[0], pos, x.numpy()[0],
                             None if kv is None else (kv[0].numpy(), kv[1].numpy()))
        return x

    def _attention_call(self, i: int, h: np.ndarray, pos: int, x_out: np.ndarray,
                        kv: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """The compiled attention block of layer i on h [H] (updated in place) at `pos` into x_out [H], against the
        keys and values kv (default: the model's)."""
        before, after, (qkv_work, o_work, parts) = self.token_args[i]
        c = self.kv_index[i]
        k_cache, v_cache = kv or self._kv_arrays()
        dense_decode.attention_token(h, *before, self.cos_np[pos], self.sin_np[pos], pos, k_cache[c], v_cache[c],
                                     *after, self.scratch, qkv_work, o_work, self.scores, x_out, parts)

    def _kv_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The model's keys and values as arrays for the compiled block, made once a forward (a view costs ~2 us
        here, twice a layer), again when the cache has grown; forward lets go of them at its end, so that a cache
        swapped out (another sequence's, generate.py) is not kept alive."""
        if self._kv_views[0] is not self.k_cache or self._kv_views[1] is not self.v_cache:
            self._kv_views = (self.k_cache, self.v_cache, self.k_cache.numpy(), self.v_cache.numpy())
        return self._kv_views[2:]

    def _mlp(self, L: dict, x: torch.Tensor, name: str) -> torch.Tensor:
        """A SwiGLU MLP of the layer's `name`_w13, `name`_w2 (the shared expert, or a dense layer's MLP)."""
        g, u = L[name + "_w13"](x).chunk(2, dim=-1)
        return L[name + "_w2"](F.silu(g) * u)

    def _shared_expert(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        y = self._mlp(L, x, "shared")
        return torch.sigmoid(L["shared_gate"](x)) * y if self.args.shared_expert_gate else y

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int, last: bool = False) -> torch.Tensor:
        """ids [T] at positions pos..pos+T-1 -> logits [T, V] (with `last`, [1, V]: the last position's only,
        all that a prefill samples from); extends the KV cache (and the linear-attention states, which
        restart at pos 0)."""
        assert ids.dim() == 1, f"ids must be [T], got {tuple(ids.shape)}"
        T = ids.shape[0]
        if pos + T > self.max_seq:
            raise BadInput(f"sequence of {pos + T} tokens exceeds max_seq={self.max_seq}; raise --max-seq")
        self._reserve(pos + T)
        self.position = pos
        h = self.embed[ids].to(self.dtype)  # a copy: the compiled attention block may update it in place
        try:
            for i in range(len(self.layers)):
                h, x = self.attention_block(i, h, pos)
                h = self.feed_forward(i, self.layers[i], h, x)
        finally:
            self._kv_views = (None, None)
        if last:
            h = h[-1:]
        if h.shape[0] == 1 and self.compiled_logits:
            return self._logits_token(h)
        return self._logits(h)

    def attention_block(self, i: int, h: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention over h [T, H] at positions pos.. -> (the residual stream after it, the feed-forward
        block's normed input), both [T, H]; a decode token through the compiled block (which updates h in place)."""
        a, L = self.args, self.layers[i]
        self._reserve(pos + h.shape[0])
        if h.shape[0] == 1 and self.compiled and i in self.kv_index:
            return h, self._attention_token(i, h, pos)
        xa = F.rms_norm(h, (a.hidden_size,), L["attn_norm"], a.rms_norm_eps)
        h = h + (self.linear[i](xa, pos) if i in self.linear else self._attention(i, L, xa, pos))
        return h, F.rms_norm(h, (a.hidden_size,), L["moe_norm"], a.rms_norm_eps)

    def attention_ahead(self, i: int, h: torch.Tensor, own: bool = False) -> torch.Tensor | None:
        """Layer i's attention block run early on an estimate h [T, H] of its input, at the positions of the
        forward running, for a predictor: the MoE input it gives (normed), or None where running it would change
        state that is not written again (linear attention) or the forward is a decode batch. The keys and values
        it writes are written again by layer i's own attention in the same forward. `own`: h is the caller's
        scratch, which a decode token's compiled block may update in place (else it is copied)."""
        if self.position is None or i in self.linear:
            return None
        return self.attention_block(i, h if own else h.clone(), self.position)[1]

    def attention_ahead_token(self, i: int, h: np.ndarray, x_out: np.ndarray) -> bool:
        """attention_ahead for one decode token in one compiled call, without torch: h [H] (the caller's scratch,
        updated in place) -> x_out [H], layer i's MoE input. False where the compiled block cannot run it (then
        attention_ahead says what can)."""
        pos = self.position
        if pos is None or not self.compiled or i not in self.kv_index or pos >= self.k_cache.shape[2]:
            return False
        self._attention_call(i, h, pos, x_out)
        return True

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of the last residual stream h [T, H]: final norm, output matrix."""
        a = self.args
        return self.lm_head(F.rms_norm(h, (a.hidden_size,), self.norm, a.rms_norm_eps))

    def _logits_token(self, h: torch.Tensor) -> torch.Tensor:
        """Decode's logits [1, V] of h [1, H] (final norm, output matrix as held) in two compiled calls."""
        x = torch.empty_like(h)
        dense_decode.rms_norm(h.numpy()[0], self.norm.numpy(), np.float32(self.args.rms_norm_eps), x.numpy()[0])
        return self.lm_head(x)

    def feed_forward(self, i: int, L: dict, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The residual stream h [T, H] after layer i's dense MLP or MoE block (routed and shared experts) on its
        normed input x [T, H]."""
        a = self.args
        if a.is_dense(i):
            return h + self._mlp(L, x, "dense")
        j = self.moe_index[i]
        if self.prefetch is not None:
            self.prefetch(j, h)
        y = self.moe(j, x, L["router"])
        if a.shared_expert_dim:
            y = y + self._shared_expert(L, x)
        return h + y

    @torch.inference_mode()
    def check_batch(self, B: int, positions: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """BadInput unless this model decodes in batches (keys and values are its only per-sequence state),
        `positions` are B whole numbers >= 0 and `kv` B (keys, values) pairs laid out as its own cache (dtype,
        device, layers, heads and head size, contiguous) holding each position: the compiled attention reads and
        writes them without bounds checks, and a negative position, a buffer of half the head size or of float64
        decoded garbage in silence."""
        if self.state_beyond_kv:
            raise BadInput("batched decode needs a model whose per-sequence state is its keys and values; "
                           "this one has latent or linear attention: decode one sequence at a time")
        if not isinstance(positions, (list, tuple)) or not isinstance(kv, (list, tuple)) or \
                len(positions) != B or len(kv) != B:
            got = f"{len(positions)} and {len(kv)}" if isinstance(positions, (list, tuple)) and \
                isinstance(kv, (list, tuple)) else f"a {type(positions).__name__} and a {type(kv).__name__}"
            raise BadInput(f"forward_batch takes a list of {B} positions and a list of {B} (keys, values) pairs for "
                           f"{B} token ids, one of each per sequence; got {got}")
        for b, (pos, pair) in enumerate(zip(positions, kv)):
            if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos < self.max_seq:
                raise BadInput(f"forward_batch: position {pos!r} of sequence {b} must be a whole number in "
                               f"[0, {self.max_seq})")
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise BadInput(f"forward_batch: kv[{b}] must be a (keys, values) pair of tensors")
            for name, t, own in (("keys", pair[0], self.k_cache), ("values", pair[1], self.v_cache)):
                want = "[" + ", ".join(map(str, (*own.shape[:2], "N", *own.shape[3:]))) + "]"
                if not isinstance(t, torch.Tensor) or t.dim() != own.dim() or t.shape[:2] != own.shape[:2] or \
                        t.shape[3:] != own.shape[3:] or t.dtype != own.dtype or t.device != own.device or \
                        not t.is_contiguous():
                    got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else \
                        type(t).__name__
                    raise BadInput(f"forward_batch: kv[{b}]'s {name} must be a contiguous {own.dtype} tensor of "
                                   f"shape {want} on {own.device}, as the model's own cache; got {got}")
                if pos >= t.shape[2]:
                    raise BadInput(f"position {pos} is beyond its KV buffer of {t.shape[2]} positions; "
                                   "allocate the buffer for the whole sequence")

    def forward_batch(self, ids: torch.Tensor, positions: list[int],
                      kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Decode B sequences one token each: ids [B], sequence b's token at position positions[b] with its keys
        and values in kv[b] = (k_cache, v_cache) [kv layers, Hkv, >= positions[b] + 1, D] -> logits [B, V].
        The MoE blocks run on the batch (the MoE layer decides its B tokens in order); attention runs per
        sequence against its own cache, through decode's compiled attention block where it applies, else with
        the projections on the batch. Models with state beyond keys and values (latent attention, linear
        attention) decode one sequence at a time through `forward`."""
        self.check_batch(ids.shape[0], positions, kv)
        a = self.args
        self.position = None  # several sequences: no attention runs ahead
        h = self.embed[ids].to(self.dtype)  # a copy: the compiled attention block updates its rows in place
        for i, L in enumerate(self.layers):
            if self.compiled:
                x = torch.cat([self._attention_token(i, h[b:b + 1], pos, kv[b]) for b, pos in enumerate(positions)])
            else:
                xa = F.rms_norm(h, (a.hidden_size,), L["attn_norm"], a.rms_norm_eps)
                q, k, v, gate = self._qkv(L, xa)
                o = torch.cat([self._attend(i, L, q[b:b + 1], k[b:b + 1], v[b:b + 1], pos, *kv[b])
                               for b, pos in enumerate(positions)])
                h = h + self._out(L, o, gate)
                x = F.rms_norm(h, (a.hidden_size,), L["moe_norm"], a.rms_norm_eps)
            h = self.feed_forward(i, L, h, x)
        return self._logits(h)
