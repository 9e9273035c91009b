"""Autoregressive generation through the engine (greedy or sampled), streamed token by token."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import BadInput
from .engine import Engine


def generate(engine: Engine, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, stop: int | None = None) -> Iterator[int]:
    """Yield new token ids: one forward over the prompt, then one per token (KV cache)."""
    if not prompt:
        raise BadInput("generation needs a prompt of at least one token")
    if len(prompt) + max_new_tokens > engine.model.max_seq:
        raise BadInput(f"prompt + new tokens ({len(prompt) + max_new_tokens}) exceed max_seq="
                         f"{engine.model.max_seq}; shorten them or raise --max-seq")
    gen = torch.Generator().manual_seed(seed)
    logits = engine.forward(torch.tensor(prompt), 0)[-1]
    pos = len(prompt)
    for _ in range(max_new_tokens):
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
        else:
            token = int(logits.argmax())
        yield token
        if token == stop:
            return
        logits = engine.forward(torch.tensor([token]), pos)[-1]
        pos += 1
