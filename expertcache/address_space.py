"""The process's address-space limit (ulimit -v), which counts every mapping, touched or not: what it is, what it
leaves, and the check that it holds the libraries. Imports nothing heavy: the check must run before numba is
first imported, where OpenBLAS spun for ever under a small limit."""
from __future__ import annotations

import os
import re
import resource
from pathlib import Path

from .errors import BadInput

# the address space PyTorch, numba's LLVM and the BLAS map before a model loads, and what each CPU adds (a thread of
# OpenBLAS's and one of OpenMP's, each with glibc's 64 MiB heap reserve and its stack): 0.92 GiB with one thread
# of each, +0.15 GiB a CPU (VmPeak of `generate` on the built-in model, 2026-12-06); with a margin
LIBRARIES_ADDRESS_SPACE, PER_CPU_ADDRESS_SPACE = 900 << 20, 160 << 20


def address_space_limit() -> int | None:
    """This process's address-space limit in bytes (its soft ulimit -v), or None where it has none."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def address_space_room(proc: Path = Path("/proc/self")) -> int | None:
    """What the limit leaves for new mappings: the limit less the process's mapped size (VmSize), every allocation
    counting whole whether touched or not; None where it has no limit."""
    limit, mapped = address_space_limit(), status_bytes("VmSize", proc)
    return None if limit is None or mapped is None else limit - mapped


def status_bytes(field: str, proc: Path = Path("/proc/self")) -> int | None:
    """A size the process's /proc status gives in kB (VmSize, RssFile), in bytes; None where Linux does not say.
    `proc`: the process's /proc folder."""
    try:
        return int(re.search(rf"^{field}:\s+(\d+) kB", (proc / "status").read_text(), re.M)[1]) * 1024
    except (OSError, TypeError):
        return None


def check_address_space(limit: int | None = None, cpus: int | None = None) -> None:
    """BadInput where the address-space limit (`limit` bytes, default this process's) is below what the libraries
    map before any model loads: under it OpenBLAS spun for ever in its import, or LLVM aborted the process as it
    compiled the kernels, or a run ended in an error naming no limit. Run by the command line before every verb,
    and as the engine's and the kernels' packages are first imported, before numba is."""
    limit = address_space_limit() if limit is None else limit
    if limit is None:
        return
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    need = LIBRARIES_ADDRESS_SPACE + PER_CPU_ADDRESS_SPACE * cpus
    if limit < need:
        raise BadInput(f"the address-space limit (ulimit -v {limit >> 10}) is below the ~{need / 2 ** 30:.1f} GiB "
                       f"that PyTorch, the compiled kernels and their threads on {cpus} CPUs map before a model "
                       "loads; raise it (ulimit -v unlimited), and bound what a run holds with --memory-budget or a "
                       "cgroup (systemd-run --user -p MemoryMax=8G ...), which count resident memory")
