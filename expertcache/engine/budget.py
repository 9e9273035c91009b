"""What the fast tier holds besides its expert slots, by part, sized from the checkpoint's headers and the
configuration before any weight is read: the dense weights as the engine holds them, the KV cache at
max_seq, the stores' staging buffers, the workspace (a forward's activations, the kernels' scratch, the
largest transient of loading) and the prefetch predictor's vectors, nets and sketches. `--memory-budget` sizes
the expert cache from what is left, and a budget too small is refused before the model loads.

The budget is what a run holds beyond its baseline: the process after its imports and with its compiled
kernels loaded (PyTorch, numba's LLVM and the kernels' machine code: 390-430 MiB resident here, the same for every
model), which `benchmarks/memory_cap.py` and `benchmarks/verb_memory.py` measure as a forward of the built-in
model."""
from __future__ import annotations

import ctypes
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..address_space import address_space_room, status_bytes
from ..kernel.expert_compute import PASS
from ..models.args import ModelArgs
from .checkpoint import Checkpoint
from .quant import ENCODE_ROWS, ExpertFormat, encoded_bytes
from .weights import dense_names, is_matrix

ATTENTION_CHUNK = 256  # query rows a window's attention computes at a time (transformer.py), bounding its scores
FORWARD_CHUNK = 512  # tokens of one forward pass: Engine.forward runs a longer window in passes of this many
# the passes a memory budget too small for FORWARD_CHUNK's workspace takes instead, before it is refused: a prompt
# then runs in more passes (each reading its missing experts again) rather than not at all
SMALLER_PASSES = (256, 128, 64, 32, 16)
# forwards of at most this many tokens (a decode step, a server's batch of steps) get back, as expert slots on the
# CPU, the memory that a budget's longer passes take for their workspace (Engine._fit_slots)
DECODE_PASS = 16
# the pages of code a run keeps executing (PyTorch's, LLVM's, Python's), which a memory cgroup must leave it: under
# a cap of 300 MiB a run of the built-in model thrashed with 44 MiB of them, and ran at full speed with 64
CODE_BYTES = 64 * 2**20
LARGE_BLOCK = 2**20  # blocks of this many bytes or more are mapped apart from malloc's heap (map_large_blocks)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each fixed part of the fast tier."""
    dense: int
    kv: int
    buffers: int
    workspace: int
    predictor: int = 0  # the one the engine is made with (predictors.predictor_bytes)

    def parts(self) -> dict[str, int]:
        """The parts by name, as the budget's error names them (a predictor's where there is one)."""
        return {"dense weights": self.dense, "KV cache": self.kv, "transfer buffers": self.buffers,
                "workspace": self.workspace} | ({"predictor": self.predictor} if self.predictor else {})

    @property
    def total(self) -> int:
        """Every fixed part together."""
        return self.dense + self.kv + self.buffers + self.workspace + self.predictor


def dense_bytes(ckpt: Checkpoint, args: ModelArgs, compute: torch.dtype, held: torch.dtype | None,
                quantized: ExpertFormat | None) -> tuple[int, int]:
    """(bytes the dense weights take as the engine holds them, the largest transient of loading them), from the
    checkpoint's headers: vectors in the compute dtype, matrices as `held` (None: as stored), or quantized to
    `quantized` (the output matrix too; the router never), a tied output matrix counted once unless quantized
    (its copy). A matrix read in the dtype it is held in takes no transient; a converted one (fp8 dequantised, or
    another dtype) its fp32 copy, a quantized one a chunk's temporaries (quant.encode_matrix)."""
    total, largest = 0, 0
    for ours, theirs in dense_names(ckpt, args).items():
        info = ckpt.info(theirs)
        n = math.prod(info.shape)
        if not is_matrix(ours):
            size = n * compute.itemsize
        elif quantized is not None and not ours.endswith("router") and ours != "embed":
            size = encoded_bytes([tuple(info.shape)], quantized)
            largest = max(largest, 4 * min(info.shape[0], ENCODE_ROWS) * info.shape[1] * 4)
        else:
            stored = info.dtype if info.dtype in (torch.float16, torch.bfloat16, torch.float32) else compute
            size = n * (held or stored).itemsize
            if (held or stored) != info.dtype:
                largest = max(largest, 2 * n * 4)
        total += size
    names = dense_names(ckpt, args)
    if "lm_head" not in names and quantized is not None:  # tied: the output matrix quantized beside the embedding
        embed = ckpt.info(names["embed"])
        total += encoded_bytes([tuple(embed.shape)], quantized)
    return total, largest


def kv_bytes(args: ModelArgs, positions: int, dtype: torch.dtype) -> int:
    """Bytes of the attention caches at `positions` positions: keys and values of the attention layers, or
    multi-head latent attention's latents (preallocated whole), or a Gated DeltaNet layer's fixed state."""
    a, size = args, dtype.itemsize
    if a.attention == "mla":
        return a.num_layers * positions * (a.kv_lora_rank + a.qk_rope_head_dim) * size
    linear = [i for i in range(a.num_layers) if a.layer_type(i) == "linear_attention"]
    kv = (a.num_layers - len(linear)) * 2 * a.num_kv_heads * a.head_dim * positions * size
    if linear:
        state = a.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim * 4
        conv = (2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads
                * a.linear_value_head_dim) * a.linear_conv_kernel * size
        kv += len(linear) * (state + conv)
    return kv


def workspace_bytes(args: ModelArgs, max_seq: int, largest_dense: int, passes: int = FORWARD_CHUNK,
                    scored: int | None = None) -> int:
    """Memory a run needs beyond weights, caches and buffers: a scored window's logits [scored, V] (max_seq
    tokens unless fewer); one forward pass's activations (`passes` tokens: hidden states, projections) and each
    attention chunk's scores; the expert kernels' scratch (one pass of PASS assignments); and at load
    `largest_dense`, the largest dense tensor once in fp32 (a conversion, or a quantized matrix's encoding)."""
    a = args
    chunk = min(max_seq, passes)
    width = max(a.num_heads * a.head_dim * 3, a.hidden_size, 2 * (a.dense_dim or 0), 2 * (a.shared_expert_dim or 0))
    logits = min(max_seq, scored or max_seq) * a.vocab_size * 4
    forward = chunk * (8 * a.hidden_size + 2 * width) * 4
    scores = 3 * a.num_heads * min(chunk, ATTENTION_CHUNK) * max_seq * 4
    F, H = a.expert_dim, a.hidden_size
    experts = min(PASS, chunk * a.top_k) * (3 * H + 3 * F + 2 * F) * 4 + chunk * H * 2
    return logits + forward + scores + experts + largest_dense


def map_large_blocks() -> None:
    """Have glibc's malloc serve every block of LARGE_BLOCK bytes or more by a mapping of its own, given back to the
    system when freed. By default it raises that threshold to the largest block freed (up to 32 MiB) and keeps such
    blocks in its heap, which held on to what later forwards freed: a perplexity run under a memory budget grew by
    a window's logits every few windows (190 MiB over 8,192 tokens of the built-in model) until a cap killed it.
    A MALLOC_MMAP_THRESHOLD_ the user set is kept; elsewhere than glibc this does nothing."""
    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        ctypes.CDLL(None).mallopt(-3, LARGE_BLOCK)  # M_MMAP_THRESHOLD; a fixed one is no longer raised
    except (OSError, AttributeError):
        pass


def available_memory() -> int | None:
    """Bytes the machine can still give this process: MemAvailable and free swap (/proc/meminfo), and no more than
    its cgroup's limit less what the group holds (its page cache aside: the kernel takes that back before it
    kills), cgroup v2 or v1, nor than its address-space limit leaves (address_space_room); None where Linux does
    not say."""
    try:
        info = dict(re.findall(r"^(\w+):\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M))
        free = (int(info["MemAvailable"]) + int(info.get("SwapFree", 0))) * 1024
    except (OSError, KeyError):
        return None
    return min([free] + [room for room in (_cgroup_room(), address_space_room()) if room is not None])


def _cgroup_room(proc: Path = Path("/proc/self"), fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The room left in this process's memory cgroup (`proc`: the process's /proc folder; `fs`: where cgroups are
    mounted), or None where no limit is set or readable."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        root = fs if v2 else fs / "memory"
        names = ("memory.max", "memory.current", "inactive_file", "active_file", "file_mapped") if v2 else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "total_active_file",
             "total_mapped_file")
        for group in (root / path.lstrip("/"), root):  # a container sees its own group at the root
            try:
                limit, used = (group / names[0]).read_text().strip(), int((group / names[1]).read_text())
                stat = dict(row.split() for row in (group / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if limit == "max" or int(limit) >= 2**60:  # no limit (v1 writes a huge number)
                return None
            # its page cache, active or not, is the kernel's to take back before it kills (as MemAvailable counts
            # it): a checkpoint read twice (a store's conversion, an engine opened again) is active, not in use. All
            # but the code a run keeps executing, where this group holds it: taken back, those pages are read again
            # at once (a run counted on them read its libraries over and over for minutes, rather than end). Code
            # another group brought in (mapped here, not charged here) stays resident without this group's room:
            # the process's resident pages of mapped files (RssFile) beyond the group's
            elsewhere = max((status_bytes("RssFile", proc) or 0) - int(stat.get(names[4], 0)), 0)
            code = max(CODE_BYTES - elsewhere, 0)
            return int(limit) - used + int(stat.get(names[2], 0)) + int(stat.get(names[3], 0)) - code
    return None
