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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engine.checkpoint import DEFAULT_VECTORS, ROUTING_COUNTS, open_checkpoint
from ..engine.experts import SWIGLU, ExpertKind, expert_groups, swiglu
from ..engine.moe import route
from ..engine.perplexity import teacher_forced
from ..engine.stores import RamStore
from ..engine.transformer import Transformer
from ..engine.weights import dense_weights, router_of
from ..errors import CheckpointError
from ..kernel.routing import Router
from ..models import model_args

CALIB_TEXT = Path(__file__).parents[1] / "data" / "calib.txt"


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
    """An exact MoE function over all experts in RAM that also sums each expert's output."""

    def __init__(self, store: RamStore, router: Router, kind: ExpertKind = SWIGLU):
        self.store, self.router, self.top_k, self.kind = store, router, router.top_k, kind
        L, E, H = store.w13.shape[0], store.w13.shape[1], store.w2.shape[2]
        self.sums = torch.zeros(L, E, H, dtype=torch.float64)
        self.counts = torch.zeros(L, E, dtype=torch.int64)

    def __call__(self, layer: int, x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
        routing = route(x, router, self.router, layer)
        weights, ids = torch.from_numpy(routing.weights), torch.from_numpy(routing.ids)
        out = torch.zeros_like(x)
        w13, w2 = self.store.w13[layer], self.store.w2[layer]
        b13, b2 = (self.store.b13[layer], self.store.b2[layer]) if self.store.shape.bias else (None, None)
        order, used, counts = expert_groups(ids)
        start = 0
        for e, c in zip(used, counts):
            pos = order[start:start + c]
            start += c
            tok = pos // self.top_k
            y = swiglu(x[tok], w13[e], w2[e], None if b13 is None else b13[e], None if b2 is None else b2[e],
                       self.kind)  # [n, H]: the expert's own output, before its gate
            self.sums[layer, e] += y.sum(0).double()
            self.counts[layer, e] += c
            out.index_add_(0, tok, y * weights.reshape(-1)[pos].unsqueeze(-1))
        return out if self.router.scale == 1.0 else out * self.router.scale


def encode_text(model_path: Path, text: str, max_tokens: int | None = None) -> list[int]:
    """`text` encoded with the model's tokenizer.json, cut to `max_tokens` if given."""
    from tokenizers import Tokenizer
    ckpt = open_checkpoint(model_path)
    if ckpt.tokenizer_file is None:
        raise CheckpointError(f"{model_path}: no tokenizer.json to encode text with; add the model's tokenizer")
    return Tokenizer.from_file(str(ckpt.tokenizer_file)).encode(text).ids[:max_tokens]


def run_exact(model_path: Path, ids: list[int], make_moe: Callable[[RamStore, object, Router], RecordingMoE],
              context: int = 512, progress: Callable[[int], None] | None = None) -> tuple[Transformer, RecordingMoE]:
    """Run the exact model (every expert in RAM) over `ids` in windows of `context`, with the
    MoE function `make_moe(store, args, router)` recording what it needs; returns the model and it."""
    ckpt = open_checkpoint(model_path)
    args = model_args(ckpt.config)
    weights = dense_weights(ckpt, args)
    moe = make_moe(RamStore(ckpt, args), args, router_of(args, weights))
    model = Transformer(args, weights, moe, torch.device("cpu"), context)
    model.prefetch = getattr(moe, "hook", None)
    for _ in teacher_forced(lambda x: model.forward(x, 0), ids, context, progress, score=False):
        pass
    model.moe, model.prefetch = None, None
    return model, moe


def calibrate(model_path: Path, ids: list[int], context: int = 512,
              progress: Callable[[int], None] | None = None) -> Calibration:
    """Routing counts and default vectors of the exact model over `ids`, in windows of `context`."""
    _, moe = run_exact(model_path, ids, lambda store, a, router: RecordingMoE(store, router, ExpertKind.of(a)),
                       context, progress)
    vectors = (moe.sums / moe.counts.clamp(min=1).unsqueeze(-1)).float()
    return Calibration(moe.counts, vectors, len(ids))


def save_calibration(c: Calibration, model_path: Path, source: str) -> None:
    """Write routing_counts.json and default_vectors.safetensors beside the model; `source` names the text."""
    (model_path / ROUTING_COUNTS).write_text(json.dumps(
        {"counts": c.counts.tolist(), "tokens": c.tokens, "text": source}))
    save_file({"default_vectors": c.default_vectors.contiguous(), "counts": c.counts.contiguous()},
              str(model_path / DEFAULT_VECTORS))
