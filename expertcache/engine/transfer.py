"""Asynchronous expert transfers from the slow tier into cache slots.

Fetches, background admissions and prefetches all go through `submit`, which returns
a `Transfer`; `wait` blocks until its slot holds the expert and reports the stall.
On CPU, O_DIRECT reads go through io_uring where the system has it (engine/uring.py: queued
and reaped by the engine's own thread): straight into float slots of the store's dtype, or into
a page-aligned staging buffer (registered with the ring) whose encoded bytes a quantized slot
takes, or that a low-precision copy is decoded from when reaped; other reads (a dtype conversion,
buffered modes) run on worker threads (O_DIRECT reads release the GIL). On CUDA (`DeviceCopies`) a
read lands in a pinned staging buffer on the host, is copied to the slot with non_blocking=True on a
copy stream that first waits for the compute work queued before the slot was taken, and its completion
is an event the compute stream waits on: no host synchronisation; a staging buffer is reused only once
its copy's event has completed.

The workers are a minimal pool rather than concurrent.futures: a read's hand-off, start,
completion and cancellation are C-level queue and lock operations, so a worker holds the GIL
only for the few statements around its read and the decoding thread is not kept waiting for it.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..choices import IO_BACKENDS  # noqa: F401 (re-exported)
from ..errors import BadInput, FetchError
from .slots import page_aligned_zeros
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
    ready: "torch.cuda.Event | None" = None  # CUDA: recorded on the compute stream when the slot was taken
    event: "torch.cuda.Event | None" = None  # CUDA: recorded on the copy stream after the slot's copies
    stall_s: float = 0.0  # a read the calling thread ran itself: the time it blocked there

    def done(self) -> bool:
        """Whether the copy has finished, successfully or not, without blocking."""
        if self.ring is not None:
            self.ring.reap(block=False)
            if self.ring is not None:
                return False
        # a CUDA copy is issued once `landed` is free: the compute stream waits for its event, the host does not
        return self.landed is None or not self.landed.locked()

    def cancel(self) -> bool:
        """Keep a queued read from starting; False once a worker has started it (or it ran in place)."""
        return self.landed is not None and self.claim.acquire(False)


class CudaRuntime:
    """The CUDA calls that `DeviceCopies` makes, on one device (a test passes a fake with the same methods)."""

    def __init__(self, device: torch.device):
        self.device = device

    def stream(self):
        """A new stream on the device, for the copies."""
        return torch.cuda.Stream(device=self.device)

    def current_stream(self):
        """The calling thread's current stream on the device: the compute stream, called from the engine's thread."""
        return torch.cuda.current_stream(self.device)

    def event(self):
        """A new event."""
        return torch.cuda.Event()

    def use(self, stream):
        """A context in which the calling thread's work is queued on `stream`."""
        return torch.cuda.stream(stream)

    def staging(self, like: torch.Tensor) -> torch.Tensor:
        """A page-locked host tensor of `like`'s shape and dtype: a non_blocking copy from it is asynchronous."""
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst <- src on the current stream without blocking the host."""
        dst.copy_(src, non_blocking=True)


class DeviceCopies:
    """Transfers into slots on a CUDA device. `taken` (the engine's thread, at submit) records an event on
    the compute stream: the slot's previous expert is no longer read after it. `copy` (any thread) reads the
    expert on the host into pinned staging tensors (or takes a pinned store's own page-locked tensors), and
    on the copy stream waits for that event, queues the non_blocking copies and records the transfer's
    event. `land` (the engine's thread) makes the compute stream wait for that event. A staging set goes back
    to the pool with the event of its copies and is handed out again only once that event has completed."""

    def __init__(self, slot_tensors: list[torch.Tensor], runtime: CudaRuntime, limit: int):
        self.slot_tensors, self.runtime, self.limit = slot_tensors, runtime, limit
        self.stream = runtime.stream()
        self.lock = threading.Lock()
        self.free: list[list[torch.Tensor]] = []
        self.busy: list[tuple[object, list[torch.Tensor]]] = []  # (event of the copies reading it, staging set)
        self.made = 0

    def taken(self, t: Transfer) -> None:
        t.ready = self.runtime.event()
        t.ready.record(self.runtime.current_stream())

    def _acquire(self) -> list[torch.Tensor]:
        with self.lock:
            while True:
                done = [b for b in self.busy if b[0].query()]
                for b in done:
                    self.busy.remove(b)
                    self.free.append(b[1])
                if self.free:
                    return self.free.pop()
                if self.made < self.limit or not self.busy:  # no set is being copied from: none will come free
                    self.made += 1
                    return [self.runtime.staging(x[0]) for x in self.slot_tensors]
                self.busy[0][0].synchronize()  # every set is being copied from: the oldest comes free first

    def copy(self, t: Transfer, store: ExpertStore) -> int:
        dsts = [x[t.slot] for x in self.slot_tensors]
        staging = None
        if getattr(store, "pinned_host", False):
            srcs = store.host_parts(t.layer, t.expert)
            n = store.expert_bytes
        else:
            staging = srcs = self._acquire()
            try:
                n = store.read_into(t.layer, t.expert, *srcs)
            except BaseException:
                with self.lock:
                    self.free.append(staging)
                raise
        with self.runtime.use(self.stream):
            self.stream.wait_event(t.ready)
            for dst, src in zip(dsts, srcs):
                self.runtime.copy(dst, src)
            t.event = self.runtime.event()
            t.event.record(self.stream)
        if staging is not None:
            with self.lock:
                self.busy.append((t.event, staging))
        return n

    def land(self, t: Transfer) -> None:
        self.runtime.current_stream().wait_event(t.event)

    def finish(self) -> None:
        """Block until the queued copies have completed: their staging sets may then be freed."""
        self.stream.synchronize()


class TransferEngine:
    """Copies experts from a store into the cache's slot tensors (w13, w2 and optional biases,
    first dimension the slot; or with `encoded`, w13 the blobs [S, bytes] of quantized slots that
    take the store's encoded bytes as they are): through io_uring or on worker threads on CPU, on a copy
    stream on CUDA."""
    def __init__(self, store: ExpertStore, w13: torch.Tensor, w2: torch.Tensor | None, workers: int = 4,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, encoded: bool = False,
                 io: str = "auto", runtime: CudaRuntime | None = None):
        self.store, self.w13, self.w2, self.encoded = store, w13, w2, encoded
        self.small: ExpertStore | None = None  # low-precision copies, read by "lowbit" transfers
        self.slot_tensors = [t for t in (w13, w2, b13, b2) if t is not None]  # what one slot holds
        runtime = runtime or (CudaRuntime(w13.device) if w13.is_cuda else None)
        self.cuda = runtime is not None
        self.device_copies = DeviceCopies(self.slot_tensors, runtime, workers + 1) if self.cuda else None
        # CPU float slots that the store reads straight into: each slot's views taken once, not per read
        direct = None if encoded or self.cuda else [store.direct_targets([x[s] for x in self.slot_tensors])
                                                     for s in range(w13.shape[0])]
        self.direct = direct if direct and all(t is not None for t in direct) else None
        # io_uring for the direct reads, and through page-aligned staging buffers for quantized slots' blobs
        # and for low-precision copies (decoded into the slot when reaped)
        self.ring, self.reads = self._ring(io), {}  # ticket -> (transfer, its store, its staging buffer or None)
        self.iovecs = [RingReads.iovec(t) for t in self.direct] if self.ring is not None and self.direct else None
        self.staging: dict[int, list[tuple[np.ndarray, object]]] = {}  # blob bytes -> free (buffer, iovec) pairs
        # blob bytes -> every staging buffer made, at most as many as the store's `buffer_bytes` counts (the memory
        # budget's bound; a window's misses would otherwise grow the pool to a layer's slots)
        self.made: dict[int, list[tuple[np.ndarray, object]]] = {}
        # seconds a read's submission blocked until a staging buffer came free: a wait on the slow tier like any
        # other, that no `wait` returns (`take_buffer_wait`)
        self.buffer_wait_s = 0.0
        self.tickets = 0
        self.queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self.n_workers = workers
        self.workers: list[threading.Thread] = []  # started by the first read handed to a worker (`_hand_off`)

    def _ring(self, io: str) -> RingReads | None:
        """The ring for `io` (one of IO_BACKENDS, which CacheConfig checks) where the reads can take one."""
        o_direct = getattr(self.store, "read_mode", "") == "o_direct"
        usable = o_direct and (self.direct is not None or (self.encoded and not self.cuda))
        ring = RingReads.open() if usable and io != "threads" else None
        if io == "uring" and ring is None:
            o_direct_into_cpu_floats = o_direct and not self.encoded and not self.cuda
            fmt = getattr(self.store, "format", None)
            if o_direct_into_cpu_floats and fmt is not None and fmt.quantized:
                raise BadInput(f"--io uring reads a quantized store only into slots that keep its blobs as they "
                               f"are; float slots decode each {fmt.dtype} blob on a worker thread: use --io auto, "
                               f"or --slot-dtype {fmt.dtype}")
            if o_direct_into_cpu_floats and getattr(self.store, "direct_parts", True) is False:
                raise BadInput("--io uring reads a float store straight into its slots, which needs each part of "
                               "a blob in whole 4 KiB pages, and this model's are not (its experts' biases); "
                               "use --io auto, or a quantized store and slots (--store-dtype int8 --slot-dtype "
                               "int8)")
            raise BadInput("--io uring needs Linux on x86-64 with io_uring allowed, an O_DIRECT disk store and "
                           "float slots of the store's dtype or quantized slots; use --io auto or --io threads")
        return ring

    def _copy(self, t: Transfer) -> int:
        store = self.small if t.kind == "lowbit" else self.store
        if self.direct is not None and store is self.store:
            return store.read_direct(t.layer, t.expert, self.direct[t.slot])
        if self.encoded:
            return store.read_encoded(t.layer, t.expert, self.w13[t.slot])
        if self.device_copies is None:
            return store.read_into(t.layer, t.expert, *(x[t.slot] for x in self.slot_tensors))
        return self.device_copies.copy(t, store)

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
        if self.device_copies is not None:  # the compute work queued so far is the last to read the slot's old expert
            self.device_copies.taken(t)
        if store.inline:
            self._copy(t)  # a host memcpy, or already asynchronous on the copy stream
        elif self.ring is not None and (store is self.store or getattr(store, "read_mode", "") == "o_direct"):
            self.tickets += 1
            stage = None
            if store is self.small or self.iovecs is None:  # lands in a staging buffer, taken from it when reaped
                stage = self._stage(store)
            try:
                if stage is not None and stage[2] is not None:
                    self.ring.read_fixed(store.fd, stage[2], store.offset(layer, expert), self.tickets)
                else:
                    self.ring.read(store.fd, self.iovecs[slot] if stage is None else stage[1],
                                   store.offset(layer, expert), self.tickets)
            except BaseException:  # not queued: no completion will come (`close` waited for one and raised)
                if stage is not None:
                    self.staging[store.blob].append(stage)
                raise
            t.ring, self.reads[self.tickets] = self, (t, store, stage)
        elif here:
            start = time.perf_counter()
            self._run(t)
            t.stall_s = time.perf_counter() - start
        else:
            t.landed = threading.Lock()
            t.landed.acquire()
            self._hand_off(t)
        return t

    def _hand_off(self, t: Transfer) -> None:
        """Queue t for the workers, starting them on the first read that needs one (where io_uring or the
        calling thread serves every read, none is ever started)."""
        if not self.workers:
            self.workers = [threading.Thread(target=self._work, name=f"expert-io-{i}", daemon=True)
                            for i in range(max(self.n_workers, 1))]
            for w in self.workers:
                w.start()
        self.queue.put(t)

    def take_buffer_wait(self) -> float:
        """The seconds submissions blocked for a staging buffer since the last call."""
        waited, self.buffer_wait_s = self.buffer_wait_s, 0.0
        return waited

    def queues_prefetches(self) -> bool:
        """Whether prefetch reads wait in the workers' queue, where `Transfer.cancel` can still stop them
        (through io_uring every read is handed to the kernel at once)."""
        return self.ring is None

    @property
    def staged(self) -> dict[int, int]:
        """Blob bytes -> how many staging buffers were made for them."""
        return {nbytes: len(made) for nbytes, made in self.made.items()}

    def _stage(self, store: ExpertStore) -> tuple[np.ndarray, object, int | None]:
        """A free staging buffer for a blob of `store`, its iovec and its index among the ring's registered buffers
        (None: not registered): a new one while fewer exist than the store's `buffer_bytes` counts, else the next
        to come free as the reads in flight complete. The store's own buffers are all made at its first read and
        registered with the ring (`RingReads.register`), as many as the locked-memory limit allows: an O_DIRECT read
        into a registered buffer does not pin its pages each time, the kernel's work that took 3-6x its CPU a byte
        in fio and 3-7% of the decoding thread's CPU at real shape here (benchmarks/RESULTS.md, "Registered staging
        buffers")."""
        nbytes, limit = store.blob, store.buffer_bytes(self.n_workers) // store.blob
        free = self.staging.setdefault(nbytes, [])
        if store is self.store and nbytes not in self.made and self.ring.registered is None:
            bufs = [page_aligned_zeros((nbytes,), torch.uint8).numpy() for _ in range(limit)]  # as O_DIRECT needs
            fixed = limit
            while fixed and not self.ring.register(bufs[:fixed]):  # refused past RLIMIT_MEMLOCK: fewer
                fixed //= 2
            self.made[nbytes] = [(buf, RingReads.iovec([buf]), i if i < fixed else None) for i, buf in enumerate(bufs)]
            free += self.made[nbytes][::-1]
        if not free and len(self.made.get(nbytes, ())) >= limit:
            start = time.perf_counter()
            while not free:
                self.reap(block=True)
            self.buffer_wait_s += time.perf_counter() - start
        if free:
            return free.pop()
        buf = page_aligned_zeros((nbytes,), torch.uint8).numpy()  # as O_DIRECT needs
        made = buf, RingReads.iovec([buf]), None
        self.made.setdefault(nbytes, []).append(made)
        return made

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
            if ticket not in self.reads:  # queued by a submit that an interrupt cut short: nobody waits for it
                continue
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
        if t.event is not None:  # the compute stream, not the host, waits for the copies
            self.device_copies.land(t)
        return t.stall_s + waited

    def settle(self) -> None:
        """Land every read started, whatever an interrupt (a KeyboardInterrupt between any two statements) left half
        done: the ring's counts taken again from the kernel's, its reads reaped, those whose completions the
        interrupted reap had taken marked failed (landed, unchecked), every staging buffer free again; the workers
        stopped once they have run what they hold (the next read handed to one starts them again)."""
        if self.ring is not None:
            self.ring.recount()
            while self.ring.queued or self.ring.inflight or self.ring.ready:
                self.reap(block=bool(self.ring.queued or self.ring.inflight))
            for t, _, _ in self.reads.values():
                t.ring, t.error = None, FetchError(f"the read of expert {t.expert} of layer {t.layer} was interrupted")
            self.reads = {}
            self.staging = {n: list(made) for n, made in self.made.items()}
        self._stop_workers()
        if self.device_copies is not None:
            self.device_copies.finish()

    def _stop_workers(self) -> None:
        """Stop the workers once they have run (or skipped, where cancelled) every read queued before."""
        for _ in self.workers:
            self.queue.put(None)
        for w in self.workers:
            w.join()
        self.workers = []

    def close(self) -> None:
        """Let the queued reads finish, stop the workers and release the ring."""
        if self.ring is not None:
            while self.reads:
                self.reap(block=True)
            self.ring.close()
        self._stop_workers()
        if self.device_copies is not None:
            self.device_copies.finish()


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

    def settle(self) -> None:
        """Nothing is in flight."""
        pass

    def take_buffer_wait(self) -> float:
        """No read ever waits for a buffer."""
        return 0.0

    def queues_prefetches(self) -> bool:
        """Nothing waits to be read."""
        return False

    def close(self) -> None:
        """Nothing to release."""
        pass
