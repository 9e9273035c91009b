"""Asynchronous expert transfers from the slow tier into cache slots.

Fetches, background admissions and prefetches all go through `submit`, which returns
a `Transfer`; `wait` blocks until its slot holds the expert and reports the stall.
On CPU, O_DIRECT reads go through io_uring where the system has it (engine/uring.py: queued
and reaped by the engine's own thread): straight into float slots of the store's dtype, or into
a page-aligned staging buffer whose encoded bytes a quantized slot takes, or that a low-precision
copy is decoded from when reaped; other reads (a dtype conversion, buffered modes) run on worker
threads (O_DIRECT reads release the GIL). On CUDA the copies are issued on a separate stream
and completion is a recorded event.

The workers are a minimal pool rather than concurrent.futures: a read's hand-off, start,
completion and cancellation are C-level queue and lock operations, so a worker holds the GIL
only for the few statements around its read and the decoding thread is not kept waiting for it.
"""
from __future__ import annotations

import mmap
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..choices import IO_BACKENDS  # noqa: F401 (re-exported)
from ..errors import BadInput
from .stores import ExpertStore
from .uring import RingReads


@dataclass(eq=False)
class Transfer:
    """One expert's copy from the slow tier into a cache slot. A worker's read holds `landed` until
    it has finished (successfully or not: `error`); a CUDA copy's completion is its `event`."""
    layer: int
    expert: int
    slot: int
    kind: str  # "fetch" | "admit" | "prefetch" | "lowbit" | "upgrade" | "fill" (decisions.KINDS)
    landed: "threading.Lock | None" = None  # held while a worker's read is queued or running
    ring: "TransferEngine | None" = None  # the engine whose io_uring holds this read until it is reaped
    claim: threading.Lock = field(default_factory=threading.Lock)  # taken by the worker that starts it, or by cancel
    error: BaseException | None = None
    event: "torch.cuda.Event | None" = None
    stall_s: float = 0.0  # a read the calling thread ran itself: the time it blocked there

    def done(self) -> bool:
        """Whether the copy has finished, successfully or not, without blocking."""
        if self.ring is not None:
            self.ring.reap(block=False)
            if self.ring is not None:
                return False
        if self.landed is not None and self.landed.locked():
            return False
        return self.event is None or self.event.query()

    def cancel(self) -> bool:
        """Keep a queued read from starting; False once a worker has started it (or it ran in place)."""
        return self.landed is not None and self.claim.acquire(False)


class TransferEngine:
    """Copies experts from a store into the cache's slot tensors (w13, w2 and optional biases,
    first dimension the slot; or with `encoded`, w13 the blobs [S, bytes] of quantized slots that
    take the store's encoded bytes as they are): through io_uring or on worker threads on CPU, on a copy
    stream on CUDA."""
    def __init__(self, store: ExpertStore, w13: torch.Tensor, w2: torch.Tensor | None, workers: int = 4,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, encoded: bool = False,
                 io: str = "auto"):
        self.store, self.w13, self.w2, self.encoded = store, w13, w2, encoded
        self.small: ExpertStore | None = None  # low-precision copies, read by "lowbit" transfers
        self.slot_tensors = [t for t in (w13, w2, b13, b2) if t is not None]  # what one slot holds
        self.cuda = w13.is_cuda
        # CPU float slots that the store reads straight into: each slot's views taken once, not per read
        direct = None if encoded or self.cuda else [store.direct_targets([x[s] for x in self.slot_tensors])
                                                     for s in range(w13.shape[0])]
        self.direct = direct if direct and all(t is not None for t in direct) else None
        # io_uring for the direct reads, and through page-aligned staging buffers for quantized slots' blobs
        # and for low-precision copies (decoded into the slot when reaped)
        self.ring, self.reads = self._ring(io), {}  # ticket -> (transfer, its store, its staging buffer or None)
        self.iovecs = [RingReads.iovec(t) for t in self.direct] if self.ring is not None and self.direct else None
        self.staging: dict[int, list[tuple[np.ndarray, object]]] = {}  # blob bytes -> free (buffer, iovec) pairs
        # blob bytes -> staging buffers made, at most as many as the store's `buffer_bytes` counts (the memory
        # budget's bound; a window's misses would otherwise grow the pool to a layer's slots)
        self.staged: dict[int, int] = {}
        self.tickets = 0
        self.stream = torch.cuda.Stream(device=w13.device) if self.cuda else None
        self.queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self.workers = [threading.Thread(target=self._work, name=f"expert-io-{i}", daemon=True) for i in range(workers)]
        for w in self.workers:
            w.start()

    def _ring(self, io: str) -> RingReads | None:
        if io not in IO_BACKENDS:
            raise BadInput(f"unknown I/O backend {io!r}; choose one of {', '.join(IO_BACKENDS)}")
        usable = (self.direct is not None or (self.encoded and not self.cuda)) and \
            getattr(self.store, "read_mode", "") == "o_direct"
        ring = RingReads.open() if usable and io != "threads" else None
        if io == "uring" and ring is None:
            raise BadInput("--io uring needs Linux on x86-64 with io_uring allowed, an O_DIRECT disk store and "
                           "float slots of the store's dtype or quantized slots; use --io auto or --io threads")
        return ring

    def _copy(self, t: Transfer) -> int:
        store = self.small if t.kind == "lowbit" else self.store
        if self.direct is not None and store is self.store:
            return store.read_direct(t.layer, t.expert, self.direct[t.slot])
        if self.encoded:
            return store.read_encoded(t.layer, t.expert, self.w13[t.slot])
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
        """Start copying `expert` of `layer` into `slot` (a `Transfer.kind`); an inline store
        copies at once; an O_DIRECT read goes to io_uring where the engine has one (the kernel starts it
        at the next `flush`). Otherwise `here`: the caller is about to wait for this copy and has nothing
        else to do, so it reads in its own thread instead of handing the read to a worker (a read error
        is kept for `wait` to raise, as a worker's would be)."""
        t = Transfer(layer, expert, slot, kind)
        store = self.small if kind == "lowbit" else self.store
        if store is None:
            raise RuntimeError("a low-precision fetch without a store of small copies (ExpertCache.attach_small)")
        if store.inline:
            self._copy(t)  # a host memcpy, or already asynchronous on the copy stream
        elif self.ring is not None and (store is self.store or getattr(store, "read_mode", "") == "o_direct"):
            self.tickets += 1
            stage = None
            if store is self.small or self.iovecs is None:  # lands in a staging buffer, taken from it when reaped
                stage = self._stage(store)
            t.ring, self.reads[self.tickets] = self, (t, store, stage)
            self.ring.read(store.fd, self.iovecs[slot] if stage is None else stage[1], store.offset(layer, expert),
                           self.tickets, background=kind in ("prefetch", "admit", "upgrade"))
        elif here:
            start = time.perf_counter()
            self._run(t)
            t.stall_s = time.perf_counter() - start
        else:
            t.landed = threading.Lock()
            t.landed.acquire()
            self.queue.put(t)
        return t

    def queues_prefetches(self) -> bool:
        """Whether prefetch reads wait in the workers' queue, where `Transfer.cancel` can still stop them
        (through io_uring every read is handed to the kernel at once)."""
        return self.ring is None

    def _stage(self, store: ExpertStore) -> tuple[np.ndarray, object]:
        """A free staging buffer for a blob of `store` (and its iovec): a new one while fewer exist than the
        store's `buffer_bytes` counts, else the next to come free as the reads in flight complete."""
        nbytes = store.blob
        free = self.staging.setdefault(nbytes, [])
        while not free and self.staged.get(nbytes, 0) >= store.buffer_bytes(len(self.workers)) // nbytes:
            self.reap(block=True)
        if free:
            return free.pop()
        self.staged[nbytes] = self.staged.get(nbytes, 0) + 1
        buf = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)  # page-aligned, as O_DIRECT needs
        return buf, RingReads.iovec([buf])

    def _run(self, t: Transfer) -> None:
        try:
            self._copy(t)
        except BaseException as e:  # noqa: BLE001 -- raised by `wait`, in the thread that needs the slot
            t.error = e

    def _work(self) -> None:
        """A worker: reads the queued transfers that are not cancelled, until a None arrives."""
        while (t := self.queue.get()) is not None:
            if t.claim.acquire(False):
                self._run(t)
                t.landed.release()

    def flush(self) -> None:
        """Start the io_uring reads submitted so far (submit queues them, so that a layer's reads go
        to the kernel in one call)."""
        if self.ring is not None:
            self.ring.submit()

    def reap(self, block: bool) -> None:
        """Take the io_uring reads that have completed (with `block`, at least one), checking each."""
        for ticket, n in self.ring.completions(block):
            t, store, stage = self.reads.pop(ticket)
            t.ring = None
            try:
                store.check_read(t.layer, t.expert, n, self.direct[t.slot] if stage is None else [stage[0]])
                if stage is not None and self.encoded:
                    store.copy_encoded(stage[0], self.w13[t.slot])
                elif stage is not None:  # a low-precision copy, decoded into the float slot
                    store.land(stage[0], [x[t.slot] for x in self.slot_tensors])
            except Exception as e:  # noqa: BLE001 -- raised by `wait`; the other completions are still taken
                t.error = e
            if stage is not None:
                self.staging[store.blob].append(stage)

    def wait(self, t: Transfer) -> float:
        """Block until t's slot holds its expert; returns seconds stalled. Raises the read's error."""
        start = time.perf_counter()
        queued = t.ring is not None or (t.landed is not None and t.landed.locked())
        while t.ring is not None:
            self.reap(block=True)
        if t.landed is not None and t.landed.locked():
            t.landed.acquire()  # released by the worker once the read has finished
            t.landed.release()
        waited = time.perf_counter() - start if queued else 0.0
        if t.error is not None:
            raise t.error
        if t.event is not None:
            if t.event.query():
                torch.cuda.current_stream().wait_event(t.event)
            else:
                t.event.synchronize()
                waited = time.perf_counter() - start
        return t.stall_s + waited

    def close(self) -> None:
        """Let the queued reads finish, stop the workers and release the ring."""
        if self.ring is not None:
            while self.reads:
                self.reap(block=True)
            self.ring.close()
        for _ in self.workers:
            self.queue.put(None)
        for w in self.workers:
            w.join()


class InstantTransfers:
    """Transfers of a virtual cache: no bytes move, every transfer has completed."""

    def submit(self, layer: int, expert: int, slot: int, kind: str, here: bool = False) -> Transfer:
        """A transfer that has already completed."""
        return Transfer(layer, expert, slot, kind)

    def wait(self, t: Transfer) -> float:
        """Never stalls: returns 0.0 seconds."""
        return 0.0

    def flush(self) -> None:
        """Nothing is queued."""
        pass

    def queues_prefetches(self) -> bool:
        """Nothing waits to be read."""
        return False

    def close(self) -> None:
        """Nothing to release."""
        pass
