"""Seconds a thread has spent compiling kernels, or loading their cached machine code: numba does either at a
kernel's first call in a process, inside whatever a first run times (minutes on a new machine, a tenth of a second
from the cache), and a timing that counted them would be a figure of the compiler."""
from __future__ import annotations

import threading
import time

from numba.core import event


class _CompileClock(event.Listener):
    """Sums, per thread, the time between the start and end of each outermost `numba:compiler_lock` event: numba
    holds that lock to compile a kernel and to load one from its cache (which `numba:compile` leaves out), and
    never once a kernel is loaded; a kernel's compile nests those of what it calls."""

    def __init__(self):
        self.local = threading.local()

    def on_start(self, ev):
        depth = getattr(self.local, "depth", 0)
        if depth == 0:
            self.local.start = time.perf_counter()
        self.local.depth = depth + 1

    def on_end(self, ev):
        self.local.depth -= 1
        if self.local.depth == 0:
            self.local.seconds = self.seconds() + time.perf_counter() - self.local.start

    def seconds(self) -> float:
        return getattr(self.local, "seconds", 0.0)


_CLOCK = _CompileClock()
event.register("numba:compiler_lock", _CLOCK)


def compile_seconds() -> float:
    """The calling thread's seconds of compiling so far: a timed span's difference of two readings is the part
    of it that compiled."""
    return _CLOCK.seconds()
