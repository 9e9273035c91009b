"""Seconds a thread has spent compiling kernels: numba compiles a kernel at its first call, inside whatever a
first run times (minutes on a new machine), and a timing that counted them would be a figure of the compiler."""
from __future__ import annotations

import threading
import time

from numba.core import event


class _CompileClock(event.Listener):
    """Sums, per thread, the time between the start and end of each outermost `numba:compile` event (a kernel's
    compile nests the compiles of what it calls)."""

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
event.register("numba:compile", _CLOCK)


def compile_seconds() -> float:
    """The calling thread's seconds of compiling so far: a timed span's difference of two readings is the part
    of it that compiled."""
    return _CLOCK.seconds()
