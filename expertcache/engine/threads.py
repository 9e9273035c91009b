"""How many threads a compiled product is split across (kernel/expert_compute.py, kernel/dense_decode.py):
every core numba's pool has, for products that stream enough weights to pay for waking them; one thread
for the small ones, where a parallel launch costs more than it saves (the built-in model's experts)."""
from __future__ import annotations

from contextlib import contextmanager

import numba
import torch

# weights (bytes) a product must stream for its split to pay: a launch of numba's OpenMP pool costs ~2 us
# here, a thread streams ~10 GB/s, and the built-in model's decode token (k experts of 60 KiB) is faster on one
MIN_PARALLEL_BYTES = 1 << 20


def parts(weight_bytes: int) -> int:
    """Threads for a product that streams `weight_bytes` of weights."""
    return numba.get_num_threads() if weight_bytes >= MIN_PARALLEL_BYTES else 1


def describe() -> str:
    """The compiled kernels' instruction set and threads, as the statistics record them."""
    from ..kernel.simd import ISA
    return f"{ISA}, {numba.get_num_threads()} threads"


@contextmanager
def kernels_own_the_cores():
    """While the engine's compiled kernels run their products on numba's threads, PyTorch's own OpenMP pool is
    kept to one thread: two pools spinning on the same cores slowed a real-size prefill 1.7x here (its
    attention and norms are PyTorch's, its products the kernels')."""
    if numba.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
