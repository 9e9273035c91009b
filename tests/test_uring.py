"""The io_uring ring spoken to through its system calls: reads land the file's bytes in the iovec's
buffers or in registered ones, errors and short reads come back as results, the queues wrap, and more
reads than the ring holds are queued in turns."""
import errno
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from expertcache.engine.uring import RingReads

ring_here = pytest.mark.skipif(RingReads.open() is None, reason="io_uring is not available here")
PAGE = mmap.PAGESIZE


@pytest.fixture
def direct_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    path = tmp_path / "blobs.bin"
    data.tofile(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    yield fd, data
    os.close(fd)


def pages(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n * PAGE), np.uint8)  # page-aligned, as O_DIRECT needs


def drain(ring: RingReads, n: int) -> list[tuple[int, int]]:
    got = []
    while len(got) < n:
        got += ring.completions(block=True)
    return got


@ring_here
def test_vectored_reads_land_the_files_bytes(direct_file):
    fd, data = direct_file
    ring = RingReads.open()
    bufs = [pages(3) for _ in range(6)]
    iovecs = [ring.iovec([b[:PAGE], b[PAGE:]]) for b in bufs]  # two parts, as a slot's w13 and w2
    offsets = [PAGE * k for k in (0, 7, 3, 40, 61, 20)]
    for i, (iov, off) in enumerate(zip(iovecs, offsets)):
        ring.read(fd, iov, off, 100 + i)
    got = drain(ring, 6)
    assert sorted(got) == [(100 + i, 3 * PAGE) for i in range(6)]
    for b, off in zip(bufs, offsets):
        assert np.array_equal(b, data[off:off + 3 * PAGE])
    ring.close()


@ring_here
def test_reads_into_registered_buffers_land_the_files_bytes(direct_file):
    """Registered buffers take fixed reads, each into the buffer its index names, short past the file's end;
    a second set is refused (its reads would go through `read`)."""
    fd, data = direct_file
    ring = RingReads.open()
    bufs = [pages(3) for _ in range(4)]
    assert ring.register(bufs) and not ring.register([pages(1)])
    offsets = [PAGE * k for k in (5, 0, 33, 62)]
    for i, off in enumerate(offsets):
        ring.read_fixed(fd, i, off, 200 + i)
    got = dict(drain(ring, 4))
    assert got == {200: 3 * PAGE, 201: 3 * PAGE, 202: 3 * PAGE, 203: 2 * PAGE}
    for b, off in zip(bufs, offsets):
        assert np.array_equal(b[:len(data[off:off + 3 * PAGE])], data[off:off + 3 * PAGE])
    ring.close()


@ring_here
def test_errors_and_short_reads_come_back_as_results(direct_file):
    fd, data = direct_file
    ring = RingReads.open()
    buf = pages(2)
    iov = ring.iovec([buf])
    ring.read(fd, iov, 100, 1)  # O_DIRECT at an unaligned offset
    assert drain(ring, 1) == [(1, -22)]  # -EINVAL
    ring.read(fd, iov, len(data) - PAGE, 2)  # the file ends after one page
    assert drain(ring, 1) == [(2, PAGE)]
    assert np.array_equal(buf[:PAGE], data[-PAGE:])
    ring.read(-1, iov, 0, 3)  # a closed descriptor
    assert drain(ring, 1) == [(3, -9)]  # -EBADF
    ring.close()


@ring_here
def test_the_queues_wrap_and_a_full_ring_submits_in_turns(direct_file):
    fd, data = direct_file
    ring = RingReads.open(entries=4)
    assert ring.entries == 4
    buf = [pages(1) for _ in range(10)]
    iovecs = [ring.iovec([b]) for b in buf]
    for round_ in range(5):  # 50 reads through 4 slots: the indices wrap many times
        for i in range(10):  # 10 queued before any wait: the ring submits when it is full
            ring.read(fd, iovecs[i], PAGE * ((round_ * 10 + i) % 64), i)
        got = drain(ring, 10)
        assert sorted(t for t, _ in got) == list(range(10)) and all(n == PAGE for _, n in got)
        for i in range(10):
            off = PAGE * ((round_ * 10 + i) % 64)
            assert np.array_equal(buf[i], data[off:off + PAGE])
    ring.close()
    ring.close()  # a second close does nothing


@ring_here
@pytest.mark.parametrize("kernel", ["one at a time", "refuses every other call"])
def test_a_kernel_that_takes_part_of_the_queue_loses_no_read(direct_file, monkeypatch, kernel):
    """io_uring_enter may submit fewer reads than asked, or none (EAGAIN, EBUSY). A full queue must then
    not overwrite an entry the kernel has not taken, and no wait may hang: every read completes with its
    own bytes."""
    from expertcache.engine import uring
    fd, data = direct_file
    real, calls = uring._call, []

    def enter(*args):
        if args[0] != uring._SYS_ENTER:
            return real(*args)
        calls.append(args[2])
        if kernel == "refuses every other call" and len(calls) % 2:
            return -errno.EAGAIN
        return real(args[0], args[1], min(args[2], 1), *args[3:])  # the kernel takes at most one read
    monkeypatch.setattr(uring, "_call", enter)
    ring = RingReads.open(entries=4)
    buf = [pages(1) for _ in range(12)]
    iovecs = [ring.iovec([b]) for b in buf]
    for i in range(12):  # three times the ring, queued before any wait
        ring.read(fd, iovecs[i], PAGE * (5 * i % 64), i)
    got = drain(ring, 12)
    assert sorted(t for t, _ in got) == list(range(12)) and all(n == PAGE for _, n in got)
    for i in range(12):
        assert np.array_equal(buf[i], data[PAGE * (5 * i % 64):PAGE * (5 * i % 64) + PAGE]), i
    assert max(calls) > 1  # the queue was handed over more than one read at a time
    with pytest.raises(ValueError, match="forever"):
        ring.completions(block=True)
    ring.close()


def test_read_only_buffers_are_refused():
    with pytest.raises(ValueError, match="writable"):
        RingReads.iovec([np.frombuffer(bytes(PAGE), np.uint8)])


def throttle_unavailable() -> str | None:
    from expertcache.lab.cgroup import ReadThrottle
    try:
        ReadThrottle(Path(__file__))
    except RuntimeError as e:
        return str(e)
    return None


@ring_here
@pytest.mark.skipif(bool(throttle_unavailable()), reason="no block-I/O cgroup can be made here (needs root)")
def test_a_read_throttle_holds_the_rings_direct_reads_at_its_rate(tmp_path):
    """benchmarks/prefetch_bound.py --disk-mbps: the engine's reads (io_uring, O_DIRECT, from its own thread)
    are charged to the process's block-I/O group, so a disk of another speed is the real reads held back. 8 MiB
    at 20 MB/s take >= 0.42 s (a bound only a working throttle can meet on any disk); the process leaves the
    group as it found it."""
    from expertcache.lab.cgroup import ReadThrottle
    n = 2048  # pages: 8 MiB
    data = np.random.default_rng(1).integers(0, 256, n * PAGE, dtype=np.uint8)
    path = tmp_path / "blobs.bin"
    data.tofile(path)
    before = Path("/proc/self/cgroup").read_text()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    ring, out = RingReads.open(), pages(n)
    iovecs = [ring.iovec([out[i * PAGE:(i + 64) * PAGE]]) for i in range(0, n, 64)]
    try:
        with ReadThrottle(path) as throttle:
            throttle.set(20_000_000)
            start = time.perf_counter()
            for i, iov in enumerate(iovecs):  # 256 KiB reads, one at a time
                ring.read(fd, iov, i * 64 * PAGE, i)
                assert drain(ring, 1) == [(i, 64 * PAGE)]
            held = time.perf_counter() - start
    finally:
        ring.close()
        os.close(fd)
    assert np.array_equal(out, data)
    assert held >= 0.3, f"8 MiB read in {held:.2f} s at a 20 MB/s throttle: the reads escaped it"
    assert Path("/proc/self/cgroup").read_text() == before
