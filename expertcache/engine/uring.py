"""Expert reads through io_uring (Linux): the engine's own thread queues each O_DIRECT read and
reaps its completion, so no worker thread is woken for a read and none contends with the
decoding thread for the GIL. On this project's 2-core VM a fork-join of 4 expert-sized reads
took 264 us through the ring against 386 us through a 4-thread pool (benchmarks/io_probe.py
--fork-join).

`RingReads.open` returns None where io_uring is not available (another OS, no liburing, a kernel
or sandbox that refuses the ring); the transfer engine then keeps its worker threads.
"""
from __future__ import annotations

try:
    import liburing
except ImportError:  # another platform, or the optional binding is missing
    liburing = None


class RingReads:
    """One io_uring instance: `read` queues a vectored read tagged with a ticket, `submit` hands the
    queued reads to the kernel, `completions` returns (ticket, result) pairs: bytes read, or -errno."""

    def __init__(self, ring, entries: int):
        self.ring, self.entries = ring, entries
        self.cqe = liburing.Cqe()
        self.queued = 0  # reads prepared but not yet submitted

    @classmethod
    def open(cls, entries: int = 1024) -> RingReads | None:
        """A ring of `entries` submission slots, or None where io_uring cannot be used here."""
        if liburing is None:
            return None
        ring = liburing.Ring()
        try:
            liburing.io_uring_queue_init(entries, ring, 0)
        except OSError:  # ENOSYS, EPERM (seccomp, io_uring_disabled), ENOMEM (locked-memory limit)
            return None
        return cls(ring, entries)

    @staticmethod
    def iovec(buffers: list) -> object:
        """The iovec of writable buffers (numpy arrays, whole pages at page-aligned addresses for
        O_DIRECT) that reads land in; kept by the caller for as long as reads may use it."""
        return liburing.Iovec([memoryview(b) for b in buffers])

    def read(self, fd: int, iovec, offset: int, ticket: int, background: bool = False) -> None:
        """Queue a read of len(iovec) bytes at `offset` of `fd` into iovec's buffers; `background`: one
        the caller will not wait for soon (a prefetch, an admission or an upgrade)."""
        if self.queued == self.entries:
            self.submit()
        sqe = liburing.io_uring_get_sqe(self.ring)
        liburing.io_uring_prep_readv(sqe, fd, iovec, offset)
        liburing.io_uring_sqe_set_data64(sqe, ticket)
        if background:  # issued by the kernel's io-wq workers: an inline O_DIRECT submission costs the
            # calling thread ~5 us of block-layer work a read (39 against 9 us for 8 reads here), taken
            # from the compute a prefetch is meant to overlap; a read waited for at once is issued inline
            liburing.io_uring_sqe_set_flags(sqe, liburing.IOSQE_ASYNC)
        self.queued += 1

    def submit(self) -> None:
        """Start every queued read."""
        if self.queued:
            liburing.io_uring_submit(self.ring)
            self.queued = 0

    def completions(self, block: bool) -> list[tuple[int, int]]:
        """The reads that have completed, as (ticket, bytes read or -errno); with `block`, at least
        one (queued reads are submitted first so that one can complete)."""
        self.submit()
        if block and not liburing.io_uring_cq_ready(self.ring):
            try:
                liburing.io_uring_wait_cqe(self.ring, self.cqe)
            except OSError:  # the binding raises a failed read's errno; its entry is read below
                pass
        out = []
        # one entry at a time: peeking points at the queue's head, wrapped (indexing past it is not)
        while liburing.io_uring_cq_ready(self.ring):
            try:
                liburing.io_uring_peek_cqe(self.ring, self.cqe)
            except OSError:  # as above: a failed read's entry, still at the head
                pass
            entry = self.cqe[0]
            ticket = entry.user_data
            try:
                res = entry.res
            except OSError as e:  # the binding raises a negative result as its errno
                res = -e.errno
            out.append((ticket, res))
            liburing.io_uring_cq_advance(self.ring, 1)
        return out

    def close(self) -> None:
        """Release the ring; reads must have completed."""
        if self.ring is not None:
            liburing.io_uring_queue_exit(self.ring)
            self.ring = None
