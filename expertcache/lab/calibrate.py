"""Calibration on text disjoint from the evaluation text: how often each expert is routed
(the warm cache's initial residency) and each expert's default vector, its mean output
d_{l,e} over the tokens routed to it (the quasi-hidden state's ingredient).

Files written beside the model:
- routing_counts.json: {"counts": [L][E] ints, "tokens": n, "text": source}
- default_vectors.safetensors: "default_vectors" [L, E, H] fp32, "counts" [L, E] int64;
  experts never routed get a zero vector (their count is 0).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic import replaced_together
from ..choices import CALIB_TEXT  # noqa: F401 (re-exported)
from ..engine.checkpoint import (
    DEFAULT_VECTORS,
    ROUTING_COUNTS,
    Checkpoint,
    check_token_ids,
    encode_prefix,
    open_checkpoint,
)
from ..engine.engine import check_context
from ..engine.experts import SWIGLU, ExpertKind, expert_groups, swiglu
from ..engine.moe import route
from ..engine.perplexity import windows
from ..engine.tensor_file import CHECKSUM, tensors_checksum
from ..engine.threads import kernels_own_the_cores
from ..engine.transformer import Transformer
from ..engine.weights import dense_weights, expert_parts, router_of
from ..errors import BadInput, CacheTooSmall, CheckpointError
from ..kernel.routing import Router
from ..models import model_args
from ..models.args import ModelArgs


@dataclass
class Calibration:
    """Routing counts [L, E] and default vectors [L, E, H] measured on `tokens` tokens of calibration text."""
    counts: torch.Tensor  # [L, E] routed selections
    default_vectors: torch.Tensor  # [L, E, H]
    tokens: int

    @property
    def never_routed(self) -> int:
        """How many (layer, expert) pairs were never routed (their default vector is zero)."""
        return int((self.counts == 0).sum())


class RecordingMoE:
    """An exact MoE function that reads each expert its tokens route to from the checkpoint as it computes it,
    one expert at a time (run_exact calls it once per layer with every token), and sums each expert's output."""

    def __init__(self, ckpt: Checkpoint, args: ModelArgs, router: Router, kind: ExpertKind = SWIGLU):
        self.ckpt, self.args, self.router, self.top_k, self.kind = ckpt, args, router, router.top_k, kind
        L, E, H = args.num_moe_layers, args.num_experts, args.hidden_size
        self.sums = torch.zeros(L, E, H, dtype=torch.float64)
        self.counts = torch.zeros(L, E, dtype=torch.int64)

    def seen(self, layer: int, expert: int, x: torch.Tensor, y: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """Expert `expert` of `layer` (its weights `parts`, expert_parts') ran on the inputs x [n, H] of the tokens
        routed to it, giving y [n, H]."""
        self.sums[layer, expert] += y.sum(0).double()
        self.counts[layer, expert] += len(y)

    def __call__(self, layer: int, x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        routing = route(x, router, self.router, layer)
        weights, ids = torch.from_numpy(routing.weights), torch.from_numpy(routing.ids)
        out = torch.zeros_like(x)
        order, used, counts = expert_groups(ids)
        start = 0
        for e, c in zip(used, counts):
            pos = order[start:start + c]
            start += c
            tok = pos // self.top_k
            parts = [p.float() for p in expert_parts(self.ckpt, self.args, layer, e)]
            y = swiglu(x[tok], *parts, *([None, None] if len(parts) == 2 else []), kind=self.kind)  # its own output
            self.seen(layer, e, x[tok], y, parts)
            out.index_add_(0, tok, y * weights.reshape(-1)[pos].unsqueeze(-1))
        return out if self.router.scale == 1.0 else out * self.router.scale


def encode_text(model_path: Path, text: str, max_tokens: int | None = None) -> list[int]:
    """`text` encoded with the model's tokenizer.json, cut to `max_tokens` if given."""
    from tokenizers import Tokenizer
    ckpt = open_checkpoint(model_path)
    if ckpt.tokenizer_file is None:
        raise CheckpointError(f"{model_path}: no tokenizer.json to encode text with; {ckpt.tokenizer_fix()}")
    tokenizer = Tokenizer.from_file(str(ckpt.tokenizer_file))
    ids = encode_prefix(lambda t: tokenizer.encode(t).ids, text, max_tokens)
    return check_token_ids(ids, model_args(ckpt.config).vocab_size, model_path)


def run_exact(model_path: Path, ids: list[int], make_moe: Callable[[Checkpoint, ModelArgs, Router], RecordingMoE],
              context: int = 512, progress: Callable[[int], None] | None = None
              ) -> tuple[Transformer, RecordingMoE, list[int]]:
    """Run the exact model over `ids` in windows of `context` (each from position 0), layer by layer over every
    window at once, with the MoE function `make_moe(checkpoint, args, router)` recording what it needs: each
    layer's MoE call sees all the text's tokens, so that an expert is read from the checkpoint once per layer
    and held alone (the run holds the dense weights, the text's hidden states and one expert, not the model).
    Returns the model, the MoE function and the windows' lengths; `progress(tokens)` after each layer, its share
    of the text's tokens (so that a bar over the tokens ends full). A MoE function with `before_attention(layer,
    windows)` sees each decoder layer's input, window by window, before its attention runs."""
    ckpt = open_checkpoint(model_path)
    args = model_args(ckpt.config)
    check_context(context, args)
    weights = dense_weights(ckpt, args)
    moe = make_moe(ckpt, args, router_of(args, weights))
    model = Transformer(args, weights, moe, torch.device("cpu"), context)
    del weights
    model.prefetch = getattr(moe, "hook", None)
    x = torch.as_tensor(ids, dtype=torch.long)
    spans = [(start, end - 1) for start, end in windows(len(x) + 1, context)]  # every token an input
    with torch.inference_mode(), kernels_own_the_cores():
        hs = [model.embed[x[a:b]].to(model.dtype) for a, b in spans]
        lengths = [h.shape[0] for h in hs]
        before = getattr(moe, "before_attention", None)
        for i in range(args.num_layers):
            if before is not None:
                before(i, hs)
            xs = []
            for w, h in enumerate(hs):  # attention per window, as a window's forward runs it
                hs[w], xn = model.attention_block(i, h, 0)
                xs.append(xn)
            h = model.feed_forward(i, model.layers[i], torch.cat(hs), torch.cat(xs))  # the text's tokens together
            hs = list(h.split(lengths))
            if progress:
                L, n = args.num_layers, len(ids)
                progress((i + 1) * n // L - i * n // L)
    model.moe, model.prefetch = None, None
    return model, moe, lengths


def calibration_bytes(model_path: Path, tokens: int, context: int = 512) -> dict[str, int]:
    """What a calibration of `tokens` tokens in windows of `context` holds beyond its process's baseline, by part,
    from the checkpoint's headers: the dense weights as loaded, the text's hidden states through a layer (the
    residual, the normed input, the MoE output and attention's projections, [tokens, H] float32 each), one
    window's attention scores (in chunks of query rows), one expert in fp32 with its tokens' products, and the
    per-expert sums [L, E, H] float64."""
    from ..engine.budget import ATTENTION_CHUNK, dense_bytes
    ckpt = open_checkpoint(model_path)
    a = model_args(ckpt.config)
    dense, transient = dense_bytes(ckpt, a, torch.float32, None, None)
    H, F = a.hidden_size, a.expert_dim
    width = max(a.num_heads * a.head_dim * 3, H)
    return {"dense weights": dense + transient,
            "hidden states": tokens * (6 * H + 2 * width + a.num_experts) * 4,
            "attention": 3 * a.num_heads * min(context, ATTENTION_CHUNK) * context * 4,
            "one expert": 2 * 3 * H * F * 4 + tokens * (2 * F + 2 * H) * 4,
            "expert sums": a.num_moe_layers * a.num_experts * H * 8}


def check_calibration_budget(model_path: Path, tokens: int, budget: int, context: int = 512) -> None:
    """CacheTooSmall naming the parts and the minimum when a calibration does not fit `budget` bytes."""
    parts = calibration_bytes(model_path, tokens, context)
    need = sum(parts.values())
    if need > budget:
        listed = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
        raise CacheTooSmall(f"calibrating {tokens} tokens needs {need / 2**20:.1f} MiB ({listed}), more than "
                            f"--memory-budget {budget / 2**20:.1f} MiB: raise it to at least "
                            f"{math.ceil(need / 2**20 * 10) / 10:.1f}M or lower --max-tokens")


# fewer tokens than this route too few times to fit anything from: a 5-token text gave every predictor a recall
# of 100% on itself and replaced the model's files with what it learned from one sentence
MIN_FIT_TOKENS = 64
MIN_FIT_DISTINCT = 16  # distinct tokens a text to fit from must hold: a line repeated, or one character, routes as
# no text a model is run on does, and a fit from it replaced the model's files without a word


def check_fit_tokens(ids: list[int], what: str) -> None:
    """BadInput when `ids` are too few tokens to fit `what` from (MIN_FIT_TOKENS), or too few distinct ones
    (MIN_FIT_DISTINCT)."""
    if len(ids) < MIN_FIT_TOKENS:
        raise BadInput(f"{what} needs at least {MIN_FIT_TOKENS} tokens of text to fit from; the text gave "
                       f"{len(ids)}: give a longer --text (or a larger --max-tokens)")
    if (distinct := len(set(ids))) < MIN_FIT_DISTINCT:
        raise BadInput(f"{what} needs varied text to fit from: the text's {len(ids):,} tokens are {distinct} "
                       f"distinct ones repeated (at least {MIN_FIT_DISTINCT}); give text like what the model is run on")


def calibrate(model_path: Path, ids: list[int], context: int = 512,
              progress: Callable[[int], None] | None = None) -> Calibration:
    """Routing counts and default vectors of the exact model over `ids`, in windows of `context`."""
    check_fit_tokens(ids, "calibrate")
    _, moe, _ = run_exact(model_path, ids, lambda ckpt, a, router: RecordingMoE(ckpt, a, router, ExpertKind.of(a)),
                          context, progress)
    vectors = (moe.sums / moe.counts.clamp(min=1).unsqueeze(-1)).float()
    return Calibration(moe.counts, vectors, len(ids))


def save_calibration(c: Calibration, model_path: Path, source: str) -> None:
    """Write routing_counts.json and default_vectors.safetensors beside the model; `source` names the text."""
    with replaced_together(model_path / ROUTING_COUNTS, model_path / DEFAULT_VECTORS) as (counts, vectors):
        counts.write_text(json.dumps({"counts": c.counts.tolist(), "tokens": c.tokens, "text": source}))
        tensors = {"default_vectors": c.default_vectors.contiguous(), "counts": c.counts.contiguous()}
        save_file(tensors, str(vectors), metadata={CHECKSUM: tensors_checksum(tensors)})
