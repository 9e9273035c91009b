"""Router-logit traces: every token's router logits at every MoE layer, with the model's
shape, the token ids and document boundaries, in one versioned file.

Layout (little-endian): b"ECTRACE\\0", uint32 format version, uint32 header length, the
header as UTF-8 JSON (the model's shape and its router: kind, groups, scaling factor and
selection bias, see kernel/routing.Router.header), zero padding to a multiple of 64 bytes, token ids int32 [N], then the
logits [N, L, E] in the header's dtype (float16 or float32); the header's `crc32c` is the CRC32C of the ids' and
the logits' bytes (a trace written before it has none, and is read unchecked). Logits are recorded from the
exact model over windows of `context` tokens (the KV cache restarts at each window), the
way `ppl` and the simulator read the text.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import crc32c
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
    path: Path | None = None  # the file it was read from, named by the errors its logits raise

    @property
    def num_tokens(self) -> int:
        """Tokens in the trace."""
        return len(self.tokens)


def write_trace(path: Path, header: dict, tokens: np.ndarray, logits: np.ndarray) -> None:
    """Write tokens [N] and logits [N, L, E] with `header` in the trace layout."""
    assert logits.ndim == 3 and logits.shape[0] == len(tokens), \
        f"logits must be [N, L, E] for {len(tokens)} tokens, got {logits.shape}"
    tokens, logits = np.ascontiguousarray(tokens, dtype="<i4"), np.ascontiguousarray(logits)
    header = {**header, "format_version": FORMAT_VERSION, "tokens": int(len(tokens)),
              "dtype": str(logits.dtype), "shape": list(logits.shape),
              "crc32c": crc32c.crc32c(logits, crc32c.crc32c(tokens))}
    raw = json.dumps(header).encode()
    pad = (-(len(MAGIC) + 8 + len(raw))) % 64
    with replaced(path) as tmp, open(tmp, "wb") as f:  # an interrupted write keeps the trace it replaces
        f.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(raw) + pad) + raw + b" " * pad)
        f.write(tokens.tobytes())
        f.write(logits.tobytes())


SIZES = ("num_layers", "num_experts", "top_k", "hidden_size", "expert_params", "context")  # whole numbers >= 1
DTYPES = ("float16", "float32")  # what `expertcache trace --dtype` writes, and the replay reads


def _whole(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def header_problem(h: dict, stored: bool = False) -> str | None:
    """What is wrong with trace header `h` for a replay, described (a field missing, of another type or out of
    range), or None; `stored`: also the fields a trace file's layout needs (model, tokens, dtype, shape). A header
    is checked before anything reads it: a size of the wrong type failed deep in the replay with a traceback, a
    negative one replayed, and logits of another dtype were read as numbers they are not."""
    needed = SIZES + ("norm_topk_prob",) + (("tokens", "model", "dtype", "shape") if stored else ())
    if missing := [name for name in needed if name not in h]:
        return f"has no field {missing[0]!r}"
    for name in SIZES + (("tokens",) if stored else ()):
        if not _whole(h[name]) or h[name] < 1:
            return f"has {name}={h[name]!r}, which must be a whole number >= 1"
    if h["expert_params"] < 3 * h["hidden_size"]:  # w13 [2F, H] and w2 [H, F]: F >= 1
        return (f"has expert_params={h['expert_params']}, fewer than the {3 * h['hidden_size']} of three matrices of "
                f"hidden_size={h['hidden_size']}")
    if not isinstance(h["norm_topk_prob"], (bool, np.bool_)):
        return f"has norm_topk_prob={h['norm_topk_prob']!r}, which must be true or false"
    from ..kernel.routing import KINDS
    if h.get("router", "softmax") not in KINDS:
        return f"has router={h['router']!r}, which must be one of {', '.join(KINDS)}"
    for name in ("n_group", "topk_group"):
        if name in h and (not _whole(h[name]) or h[name] < 1):
            return f"has {name}={h[name]!r}, which must be a whole number >= 1"
    scale = h.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        return f"has routed_scaling_factor={scale!r}, which must be a finite number"
    if h.get("router_bias") is not None:
        try:
            bias = np.asarray(h["router_bias"], np.float32)
        except (ValueError, TypeError):
            return "has a router_bias that is not a table of numbers"
        if bias.shape != (h["num_layers"], h["num_experts"]) or not np.isfinite(bias).all():
            return (f"has a router_bias of shape {bias.shape} (or not finite), where its {h['num_layers']} layers x "
                    f"{h['num_experts']} experts need one finite number each")
    if stored:
        if not isinstance(h["model"], str):
            return f"has model={h['model']!r}, which must be the path of the model traced"
        if h["dtype"] not in DTYPES:
            return f"has dtype={h['dtype']!r}, which must be one of {', '.join(DTYPES)}"
        if h["shape"] != [h["tokens"], h["num_layers"], h["num_experts"]]:
            return (f"has logits of shape {h['shape']!r}, not [tokens, num_layers, num_experts] = "
                    f"{[h['tokens'], h['num_layers'], h['num_experts']]}")
    return None


def read_trace(path: Path) -> Trace:
    """Open a trace file, its tokens and logits memory-mapped; raises CheckpointError on a missing, foreign,
    truncated or corrupt file, or a header a replay cannot take (`header_problem`)."""
    path, again = Path(path), "record it again with `expertcache trace`"
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO's open waited for a writer forever
        raise CheckpointError(f"{path} is not a regular file (a pipe or a device); give a trace file written by "
                              "`expertcache trace`")
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                raise CheckpointError(f"{path} is not an expertcache trace; record one with `expertcache trace`")
            version, hlen = struct.unpack("<II", head[len(MAGIC):])
            if version != FORMAT_VERSION:
                raise CheckpointError(f"{path} is a trace of format version {version}; this expertcache reads "
                                      f"version {FORMAT_VERSION}: record it again with `expertcache trace`")
            size, offset = os.fstat(f.fileno()).st_size, len(MAGIC) + 8 + hlen
            if offset > size:  # a cut file, or a corrupt length that would read gigabytes as the header
                raise CheckpointError(f"{path} is truncated (its header runs to byte {offset}, the file to {size}); "
                                      f"{again}")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such trace; record one with `expertcache trace`") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a folder, not a trace; give a file written by `expertcache trace "
                              "--out FILE`") from None
    except OSError as e:  # no permission, an I/O error
        raise CheckpointError(f"cannot read trace {path} ({e.strerror}); check its permissions, or {again}") \
            from None
    try:
        header = json.loads(raw)
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"{path}: unreadable trace header ({e}); {again}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: unreadable trace header (a JSON {type(header).__name__}, not an object); "
                              f"{again}")
    if (problem := header_problem(header, stored=True)) is not None:
        raise CheckpointError(f"{path}: the trace header {problem}; {again}")
    n, shape, dtype = header["tokens"], tuple(header["shape"]), np.dtype(header["dtype"])
    want = offset + 4 * n + int(np.prod(shape)) * dtype.itemsize
    if size < want:
        raise CheckpointError(f"{path} is truncated ({size} of {want} bytes); {again}")
    if size > want:  # bytes past the logits: another file appended, or a header that lies about its counts
        raise CheckpointError(f"{path} has {size - want} bytes past its logits (a damaged or appended-to file); "
                              f"{again}")
    tokens = np.memmap(path, dtype="<i4", mode="r", offset=offset, shape=(n,))
    logits = np.memmap(path, dtype=dtype, mode="r", offset=offset + 4 * n, shape=shape)
    if "crc32c" in header and crc32c.crc32c(logits, crc32c.crc32c(tokens)) != header["crc32c"]:
        raise CheckpointError(f"{path}: its tokens or logits do not match the checksum written with them (a "
                              f"corrupt file); {again}")
    return Trace(header, tokens, logits, path)


def record_trace(model_path: Path, ids: list[int], out: Path, context: int = 512, dtype: str = "float16",
                 documents: list | None = None, progress: Callable[[int], None] | None = None) -> Trace:
    """Record the exact model's router logits over `ids` in windows of `context` into `out`, as `dtype`; returns it
    read back."""
    from .prediction import record_states
    if not ids:
        raise BadInput("no tokens to trace: the text is empty; give a longer text")
    if dtype not in DTYPES:  # the reader takes no other
        raise BadInput(f"logits dtype {dtype!r} cannot be traced; choose one of {', '.join(DTYPES)}")
    model, states = record_states(model_path, ids, context, progress)
    a = model.args
    logits = np.stack([l.numpy() for l in states.logits], axis=1).astype(dtype)  # [N, L, E], MoE layers
    from ..engine.stores import ExpertShape
    # the model's absolute path: a relative one named another folder (or none) when replayed from elsewhere, and
    # `simulate` then warm-started from another model's routing counts, or silently cold
    header = {"model": str(Path(model_path).resolve()), "family": a.family, "num_layers": a.num_moe_layers,
              "num_experts": a.num_experts, "top_k": a.top_k, "norm_topk_prob": a.norm_topk_prob,
              "hidden_size": a.hidden_size, "expert_params": ExpertShape.of(a).numel, "context": context,
              "documents": documents or [], **model.router.header()}
    write_trace(out, header, np.asarray(ids, dtype=np.int32), logits)
    return read_trace(out)
