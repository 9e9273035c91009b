"""Expert reads through io_uring (Linux): the engine's own thread queues each O_DIRECT read and
reaps its completion, so no worker thread is woken for a read and none contends with the
decoding thread for the GIL. On this project's 2-core VM a fork-join of 4 expert-sized reads
took 264 us through the ring against 386 us through a 4-thread pool (benchmarks/io_probe.py
--fork-join).

The ring is spoken to directly: its two system calls through libc's `syscall`, its queues as
shared memory. No compiled binding is needed, so nothing here can carry instructions this CPU
lacks (a prebuilt liburing wheel used AVX-512 and died of SIGILL on AVX2 machines). The
queues' ordering relies on x86-64's: stores reach memory in program order and loads are not
reordered with other loads, so publishing a tail after writing its entries needs no fence.

`RingReads.open` returns None where io_uring is not available (another OS or CPU architecture,
a kernel or sandbox that refuses the ring); the transfer engine then keeps its worker threads.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import time

import numpy as np

# <linux/io_uring.h>
_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427  # the same numbers on every architecture since Linux 5.1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_READV, _OP_READ_FIXED = 1, 4
_REGISTER_BUFFERS = 0
_ENTER_GETEVENTS = 1
# IORING_FEAT_NODROP (5.5: no completion is lost to a full queue) and IORING_FEAT_RW_CUR_POS (5.6: it marked
# IOSQE_ASYNC, which reads no longer use, and is still required): an older kernel keeps the worker threads
_FEATURES_NEEDED = (1 << 1) | (1 << 3)
# io_uring_params: sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd, resv[3];
# then the SQ ring's offsets (head, tail, ring_mask, ring_entries, flags, dropped, array, resv1, user_addr)
# and the CQ ring's (head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1, user_addr)
_PARAMS = struct.Struct("<10I 8I Q 8I Q")
# an SQE's 64 bytes: opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data, buf_index, personality,
# splice_fd_in, addr3, pad
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")  # user_data, res, flags

_USABLE = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
if _USABLE:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long


def _call(*args: int) -> int:
    """A system call through libc; its result, or -errno."""
    r = _syscall(*(ctypes.c_long(a) for a in args))
    return -ctypes.get_errno() if r < 0 else r


class Iovec:
    """The iovec array of a read's destination buffers, kept alive with them."""

    def __init__(self, buffers: list):
        self.buffers = [np.frombuffer(b, np.uint8) for b in buffers]
        if any(not b.flags.writeable for b in self.buffers):
            raise ValueError("a read's destination buffer must be writable")
        self.array = np.array([x for b in self.buffers for x in (b.ctypes.data, b.nbytes)], np.uint64)
        self.address, self.count = self.array.ctypes.data, len(self.buffers)


class RingReads:
    """One io_uring instance: `read` queues a vectored read tagged with a ticket, `submit` hands the
    queued reads to the kernel, `completions` returns (ticket, result) pairs: bytes read, or -errno."""

    def __init__(self, fd: int, p: tuple):
        self.fd = fd
        self.entries, cq_entries = p[0], p[1]
        sq_head, sq_tail, sq_mask, _, _, _, sq_array = p[10:17]
        cq_head, cq_tail, cq_mask, _, _, cqes = p[19:25]
        flags, prot = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ | mmap.PROT_WRITE
        self.maps = [mmap.mmap(fd, size, flags, prot, offset=off) for size, off in (
            (sq_array + 4 * self.entries, _OFF_SQ_RING), (cqes + 16 * cq_entries, _OFF_CQ_RING),
            (64 * self.entries, _OFF_SQES))]
        self.sq, self.cq, self.sqes = self.maps
        sq32, cq32 = np.frombuffer(self.sq, np.uint32), np.frombuffer(self.cq, np.uint32)
        self.u32 = (sq32, cq32)  # aligned single loads and stores of the shared indices
        self.sq_head, self.sq_tail, self.sq_mask = sq_head // 4, sq_tail // 4, int(sq32[sq_mask // 4])
        self.cq_head, self.cq_tail, self.cq_mask, self.cqes = cq_head // 4, cq_tail // 4, int(cq32[cq_mask // 4]), cqes
        sq32[sq_array // 4:sq_array // 4 + self.entries] = np.arange(self.entries)  # SQE i sits in slot i
        self.tail = int(sq32[self.sq_tail])  # the next SQE to fill; published to the kernel by `submit`
        self.head = int(cq32[self.cq_head])  # the next completion to take
        self.queued = 0  # reads prepared but not yet taken by the kernel
        self.inflight = 0  # reads the kernel has taken whose completions are not yet taken
        self.ready: list[tuple[int, int]] = []  # completions taken while making room, for `completions`
        self.registered: Iovec | None = None  # the buffers `read_fixed` reads into (`register`)

    @classmethod
    def open(cls, entries: int = 1024) -> RingReads | None:
        """A ring of `entries` submission slots, or None where io_uring cannot be used here."""
        if not _USABLE:
            return None
        params = ctypes.create_string_buffer(_PARAMS.size)
        fd = _call(_SYS_SETUP, entries, ctypes.addressof(params))
        if fd < 0:  # ENOSYS, EPERM (seccomp, io_uring_disabled), ENOMEM (locked-memory limit)
            return None
        p = _PARAMS.unpack(params.raw)
        if p[5] & _FEATURES_NEEDED != _FEATURES_NEEDED:
            os.close(fd)
            return None
        try:
            return cls(fd, p)
        except (OSError, ValueError):  # the rings could not be mapped
            os.close(fd)
            return None

    @staticmethod
    def iovec(buffers: list) -> Iovec:
        """The iovec of writable buffers (numpy arrays, whole pages at page-aligned addresses for
        O_DIRECT) that reads land in; kept by the caller for as long as reads may use it."""
        return Iovec(buffers)

    def register(self, buffers: list) -> bool:
        """Register `buffers` (writable, page-aligned) with the kernel, for `read_fixed`: their pages are pinned
        now, not at every read. False where a set is registered already, or the kernel refuses (more than the
        locked-memory limit, RLIMIT_MEMLOCK, allows an unprivileged process): reads then go through `read`."""
        if self.registered is not None:
            return False
        iovec = Iovec(buffers)
        if _call(_SYS_REGISTER, self.fd, _REGISTER_BUFFERS, iovec.address, iovec.count) < 0:
            return False
        self.registered = iovec
        return True

    def read_fixed(self, fd: int, index: int, offset: int, ticket: int) -> None:
        """Queue a read at `offset` of `fd` filling registered buffer `index` (`register`)."""
        buffer = self.registered.buffers[index]
        self._queue(_OP_READ_FIXED, fd, offset, buffer.ctypes.data, buffer.nbytes, ticket, index)

    def read(self, fd: int, iovec: Iovec, offset: int, ticket: int) -> None:
        """Queue a read at `offset` of `fd` filling iovec's buffers."""
        self._queue(_OP_READV, fd, offset, iovec.address, iovec.count, ticket, 0)

    def _queue(self, opcode: int, fd: int, offset: int, address: int, length: int, ticket: int, index: int) -> None:
        """Queue one read's submission entry: at `address`, `length` iovecs (READV) or bytes (READ_FIXED, into
        registered buffer `index`)."""
        tries = 0
        while self.queued == self.entries:  # every slot holds a read the kernel has not taken: none may be overwritten
            self._make_room(tries)
            tries += 1
        # issued inline by `submit`, prefetches too: handed to the kernel's io-wq workers (IOSQE_ASYNC) they saved
        # the calling thread ~20 us of block-layer work a read, but waited for a worker to be woken on the busy
        # cores: an oracle's prefetch gained 1.11x over on-demand loading that way, 1.17x inline (built-in model;
        # 1.03x against 1.12x at real scale; benchmarks/RESULTS.md, "Prefetch reads issued inline")
        _SQE.pack_into(self.sqes, 64 * (self.tail & self.sq_mask), opcode, 0, 0, fd, offset, address, length, 0,
                       ticket, index, 0, 0, 0, 0)
        self.tail = (self.tail + 1) & 0xFFFFFFFF
        self.queued += 1

    def _make_room(self, tries: int) -> None:
        """Hand queued reads to the kernel. It may take some, or none (EAGAIN, EBUSY: its completion queue
        is backed up, or it is short of memory): then the completions that are ready are taken (kept in
        `ready` for `completions`), or one is waited for while reads are in flight, before the next try."""
        self._enter(self.queued, 0)
        if self.queued < self.entries:
            return
        self.ready += self._take()
        if self.ready:
            return
        if self.inflight:
            self._enter(0, 1)
            self.ready += self._take()
        else:
            self._back_off(tries)

    @staticmethod
    def _back_off(tries: int) -> None:
        """The kernel took no read and none is in flight (EAGAIN: short of memory): wait a little, for about
        a second in all, then fail rather than wait forever."""
        if tries >= 1000:
            raise OSError(errno.EAGAIN, "io_uring_enter: the kernel took no read for a second; retry later")
        time.sleep(0.001)

    def _enter(self, submit: int, wait: int) -> None:
        """io_uring_enter: hand `submit` queued reads to the kernel and, with `wait`, sleep until one
        completion is ready (the kernel waits only when it took every read handed to it)."""
        sq32 = self.u32[0]
        sq32[self.sq_tail] = self.tail  # the entries before it were written first (x86-64 keeps store order)
        while True:
            r = _call(_SYS_ENTER, self.fd, submit, wait, _ENTER_GETEVENTS if wait else 0, 0, 0)
            if r != -errno.EINTR:
                break
        if r < 0 and r not in (-errno.EAGAIN, -errno.EBUSY):  # those two: retried once completions are taken
            raise OSError(-r, f"io_uring_enter: {os.strerror(-r)}")
        queued = (self.tail - int(sq32[self.sq_head])) & 0xFFFFFFFF  # the kernel's head: what it took, in full
        self.inflight += self.queued - queued
        self.queued = queued

    def submit(self) -> None:
        """Start every queued read (as many as the kernel takes now; the rest with the next call)."""
        if self.queued:
            self._enter(self.queued, 0)

    def _take(self) -> list[tuple[int, int]]:
        """The completions in the queue, taken off it."""
        cq32 = self.u32[1]
        out, tail, head = [], int(cq32[self.cq_tail]), self.head
        while head != tail:
            ticket, res, _ = _CQE.unpack_from(self.cq, self.cqes + 16 * (head & self.cq_mask))
            out.append((ticket, res))
            head = (head + 1) & 0xFFFFFFFF
        self.head = cq32[self.cq_head] = head
        self.inflight -= len(out)
        return out

    def completions(self, block: bool) -> list[tuple[int, int]]:
        """The reads that have completed, as (ticket, bytes read or -errno); with `block`, at least
        one (queued reads are submitted first so that one can complete). ValueError when blocking with
        no read queued or in flight: nothing could ever complete."""
        if self.queued:
            self._enter(self.queued, 0)
        out, self.ready = self.ready + self._take(), []
        tries = 0
        while block and not out:
            if not self.queued and not self.inflight:
                raise ValueError("completions(block=True) with no read queued or in flight would wait forever")
            self._enter(self.queued, 1)  # submits what is left, then waits when all of it was taken
            out = self._take()
            if out:
                break
            if self.queued and self.inflight:  # the kernel took part, so it did not wait: wait now
                self._enter(0, 1)
                out = self._take()
            elif not self.inflight:
                self._back_off(tries)
                tries += 1
        return out

    def recount(self) -> None:
        """`queued` and `inflight` taken again from the kernel's indices, where an interrupt may have cut their
        update short (too many in flight: a wait for a completion that never comes)."""
        sq32, cq32 = self.u32
        self.head = int(cq32[self.cq_head])
        taken = int(sq32[self.sq_head])
        self.queued = (self.tail - taken) & 0xFFFFFFFF
        self.inflight = (taken - self.head) & 0xFFFFFFFF  # one completion a read; those not taken yet

    def close(self) -> None:
        """Release the ring; reads must have completed."""
        if self.fd is not None:
            self.u32 = self.sq = self.cq = self.sqes = None  # the views must go before their maps close
            for m in self.maps:
                try:
                    m.close()
                except BufferError:  # a view held by an interrupt's traceback (sys.last_traceback): unmapped with it
                    pass
            os.close(self.fd)
            self.fd = None
