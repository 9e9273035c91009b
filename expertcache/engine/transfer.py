"""Asynchronous expert transfers from the slow tier into cache slots.

Fetches, background admissions and prefetches all go through `submit`, which returns
a `Transfer`; `wait` blocks until its slot holds the expert and reports the stall.
On CPU a thread pool runs the store's reads (O_DIRECT reads release the GIL); on CUDA
the copies are issued on a separate stream and completion is a recorded event.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .stores import ExpertStore


@dataclass
class Transfer:
    """One expert's copy from the slow tier into a cache slot; `future` (a pool read) or `event`
    (a CUDA copy) tells when it has completed."""
    layer: int
    expert: int
    slot: int
    kind: str  # "fetch" | "admit" | "prefetch"
    future: Future | None = None
    event: "torch.cuda.Event | None" = None
    stall_s: float = 0.0  # a read the calling thread ran itself: the time it blocked there

    def done(self) -> bool:
        """Whether the copy has finished, successfully or not, without blocking."""
        if self.future is not None and not self.future.done():
            return False
        return self.event is None or self.event.query()


class TransferEngine:
    """Copies experts from a store into the cache's slot tensors (w13, w2 and optional biases,
    first dimension the slot): on a thread pool on CPU, on a copy stream on CUDA."""
    def __init__(self, store: ExpertStore, w13: torch.Tensor, w2: torch.Tensor, workers: int = 4,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None):
        self.store, self.w13, self.w2 = store, w13, w2
        self.small: ExpertStore | None = None  # low-precision copies, read by "lowbit" transfers
        self.slot_tensors = [t for t in (w13, w2, b13, b2) if t is not None]  # what one slot holds
        self.cuda = w13.is_cuda
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="expert-io")
        self.stream = torch.cuda.Stream(device=w13.device) if self.cuda else None

    def _copy(self, t: Transfer) -> int:
        store = self.small if t.kind == "lowbit" else self.store
        if self.stream is None:
            return store.read_into(t.layer, t.expert, *(x[t.slot] for x in self.slot_tensors))
        # The slot's previous expert may still be read by queued compute: copy after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            n = store.read_into(t.layer, t.expert, *(x[t.slot] for x in self.slot_tensors))
            t.event = torch.cuda.Event()
            t.event.record(self.stream)
        return n

    def submit(self, layer: int, expert: int, slot: int, kind: str, here: bool = False) -> Transfer:
        """Start copying `expert` of `layer` into `slot` (kind: fetch, admit or prefetch); an inline store
        copies at once. `here`: the caller is about to wait for this copy and has nothing else to do,
        so it reads in its own thread instead of handing the read to a worker (a read error is kept
        for `wait` to raise, as a worker's would be)."""
        t = Transfer(layer, expert, slot, kind)
        if kind == "lowbit" and self.small is None:
            raise RuntimeError("a low-precision fetch without a store of small copies (ExpertCache.attach_small)")
        if (self.small if kind == "lowbit" else self.store).inline:
            self._copy(t)  # a host memcpy, or already asynchronous on the copy stream
        elif here:
            t.future = Future()
            start = time.perf_counter()
            try:
                t.future.set_result(self._copy(t))
            except Exception as e:  # noqa: BLE001 -- raised by `wait`, like a worker's read error
                t.future.set_exception(e)
            t.stall_s = time.perf_counter() - start
        else:
            t.future = self.pool.submit(self._copy, t)
        return t

    def wait(self, t: Transfer) -> float:
        """Block until t's slot holds its expert; returns seconds stalled. Raises the read's error."""
        if t.done() and (t.future is None or t.future.exception() is None):
            if t.event is not None:
                torch.cuda.current_stream().wait_event(t.event)
            return t.stall_s
        start = time.perf_counter()
        if t.future is not None:
            t.future.result()
        if t.event is not None:
            t.event.synchronize()
        return t.stall_s + time.perf_counter() - start

    def close(self) -> None:
        """Wait for the reads in flight and stop the pool's threads."""
        self.pool.shutdown(wait=True)


class InstantTransfers:
    """Transfers of a virtual cache: no bytes move, every transfer has completed."""

    def submit(self, layer: int, expert: int, slot: int, kind: str, here: bool = False) -> Transfer:
        """A transfer that has already completed."""
        return Transfer(layer, expert, slot, kind)

    def wait(self, t: Transfer) -> float:
        """Never stalls: returns 0.0 seconds."""
        return 0.0

    def close(self) -> None:
        """Nothing to release."""
        pass
