"""Router-logit traces: every token's router logits at every MoE layer, with the model's
shape, the token ids and document boundaries, in one versioned file.

Layout (little-endian): b"ECTRACE\\0", uint32 format version, uint32 header length, the
header as UTF-8 JSON (the model's shape and its router: kind, groups, scaling factor and
selection bias, see kernel/routing.Router.header), zero padding to a multiple of 64 bytes, token ids int32 [N], then the
logits [N, L, E] in the header's dtype (float16 or float32). Logits are recorded from the
exact model over windows of `context` tokens (the KV cache restarts at each window), the
way `ppl` and the simulator read the text.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import replaced
from ..errors import BadInput, CheckpointError

MAGIC = b"ECTRACE\0"
FORMAT_VERSION = 2  # 2: the router (kind, groups, scaling, selection bias) in the header


@dataclass
class Trace:
    """A router-logit trace: header (model shape, context, documents), token ids [N] and logits [N, L, E]."""
    header: dict
    tokens: np.ndarray  # [N] int32
    logits: np.ndarray  # [N, L, E]

    @property
    def num_tokens(self) -> int:
        """Tokens in the trace."""
        return len(self.tokens)


def write_trace(path: Path, header: dict, tokens: np.ndarray, logits: np.ndarray) -> None:
    """Write tokens [N] and logits [N, L, E] with `header` in the trace layout."""
    assert logits.ndim == 3 and logits.shape[0] == len(tokens), \
        f"logits must be [N, L, E] for {len(tokens)} tokens, got {logits.shape}"
    header = {**header, "format_version": FORMAT_VERSION, "tokens": int(len(tokens)),
              "dtype": str(logits.dtype), "shape": list(logits.shape)}
    raw = json.dumps(header).encode()
    pad = (-(len(MAGIC) + 8 + len(raw))) % 64
    with replaced(path) as tmp, open(tmp, "wb") as f:  # an interrupted write keeps the trace it replaces
        f.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(raw) + pad) + raw + b" " * pad)
        f.write(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
        f.write(np.ascontiguousarray(logits).tobytes())


def read_trace(path: Path) -> Trace:
    """Open a trace file, its tokens and logits memory-mapped; raises CheckpointError on a missing or
    foreign file."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                raise CheckpointError(f"{path} is not an expertcache trace; record one with `expertcache trace`")
            version, hlen = struct.unpack("<II", head[len(MAGIC):])
            if version != FORMAT_VERSION:
                raise CheckpointError(f"{path} is a trace of format version {version}; this expertcache reads "
                                      f"version {FORMAT_VERSION}: record it again with `expertcache trace`")
            header = json.loads(f.read(hlen))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such trace; record one with `expertcache trace`") from None
    offset = len(MAGIC) + 8 + hlen
    try:
        n = header["tokens"]
        want = offset + 4 * n + int(np.prod(header["shape"])) * np.dtype(header["dtype"]).itemsize
        if Path(path).stat().st_size < want:
            raise CheckpointError(f"{path} is truncated ({Path(path).stat().st_size} of {want} bytes); record it "
                                  "again with `expertcache trace`")
        tokens = np.memmap(path, dtype="<i4", mode="r", offset=offset, shape=(n,))
        logits = np.memmap(path, dtype=header["dtype"], mode="r", offset=offset + 4 * n, shape=tuple(header["shape"]))
    except (KeyError, TypeError, ValueError) as e:  # a header without its fields, or of another shape
        raise CheckpointError(f"{path}: unreadable trace header ({e}); record it again with `expertcache trace`") \
            from None
    return Trace(header, tokens, logits)


def record_trace(model_path: Path, ids: list[int], out: Path, context: int = 512, dtype: str = "float16",
                 documents: list | None = None, progress: Callable[[int], None] | None = None) -> Trace:
    """Record the exact model's router logits over `ids` in windows of `context` into `out`, as `dtype`; returns it
    read back."""
    from .prediction import record_states
    if not ids:
        raise BadInput("no tokens to trace: the text is empty; give a longer text")
    model, states = record_states(model_path, ids, context, progress)
    a = model.args
    logits = np.stack([l.numpy() for l in states.logits], axis=1).astype(dtype)  # [N, L, E], MoE layers
    from ..engine.stores import ExpertShape
    header = {"model": str(model_path), "family": a.family, "num_layers": a.num_moe_layers,
              "num_experts": a.num_experts, "top_k": a.top_k, "norm_topk_prob": a.norm_topk_prob,
              "hidden_size": a.hidden_size, "expert_params": ExpertShape.of(a).numel, "context": context,
              "documents": documents or [], **model.router.header()}
    write_trace(out, header, np.asarray(ids, dtype=np.int32), logits)
    return read_trace(out)
