"""Faults of the slow tier: a corrupt blob is caught by its checksum and named; a failed or short
read (on a worker thread or through io_uring) leaves the cache consistent (the expert absent, its slot free, nothing
in flight) and the engine computing exactly what a clean engine computes from the same state."""
import errno
import json
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import ROUTING_COUNTS, open_checkpoint
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.quant import ExpertFormat
from expertcache.engine.stores import DiskStore, RamStore, convert_to_disk
from expertcache.engine.uring import RingReads
from expertcache.errors import FetchError, NonFiniteOutput
from expertcache.models import model_args
from hf_models import save_tiny

FAMILY = "qwen3_moe"  # 2 layers, 8 experts, top-2
needs_ring = pytest.mark.skipif(RingReads.open() is None, reason="io_uring is not available here")


@pytest.fixture
def model(tiny, tmp_path):
    """A copy of the tiny checkpoint and its converted disk store: (checkpoint folder, store folder)."""
    path = tmp_path / "model"
    shutil.copytree(tiny[FAMILY][0], path)
    ckpt = open_checkpoint(path)
    return path, convert_to_disk(ckpt, model_args(ckpt.config), tmp_path / "store")


@pytest.fixture
def paged_model(tmp_path):
    """The tiny family with hidden 64 and experts of 16: fp32 parts of whole pages (w13 8 KiB, w2 4 KiB), so that
    the disk store reads them through io_uring straight into the slots. (checkpoint folder, store folder)."""
    path = tmp_path / "paged"
    save_tiny(FAMILY, path, hidden_size=64, moe_intermediate_size=16)
    ckpt = open_checkpoint(path)
    return path, convert_to_disk(ckpt, model_args(ckpt.config), tmp_path / "paged-store")


def blob_bytes(store):
    return json.loads((store / "experts.json").read_text())["blob_bytes"]


def corrupt(store, layer, expert, data, at=100):
    """Overwrite bytes inside the blob of (layer, expert)."""
    E = json.loads((store / "experts.json").read_text())["num_experts"]
    with open(store / "experts.bin", "r+b") as f:
        f.seek((layer * E + expert) * blob_bytes(store) + at)
        f.write(data)


def test_corrupt_blob_ends_ppl_with_exit_2(capsys, model):
    path, store = model
    counts = np.ones((2, 8), np.int64)
    counts[1, 5] = 100  # a warm start reads expert 5 of layer 1 first
    (path / ROUTING_COUNTS).write_text(json.dumps({"counts": counts.tolist()}))
    corrupt(store, 1, 5, os.urandom(64))
    code = cli.main(["ppl", "--model", str(path), "--store", "disk", "--store-dir", str(store), "--initial", "warm",
                     "--text", __file__])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert "expert 5 of layer 1" in err and "CRC32C" in err and "rerun `expertcache convert --force --out" in err, err


def test_corruption_found_in_a_fetch_or_as_non_finite_logits(model):
    path, store = model
    for e in range(8):  # every expert of layer 1: whatever the tokens route to is corrupt
        corrupt(store, 1, e, b"\xff" * 256)  # fp32 NaNs
    ids = torch.arange(10) % 96
    cfg = EngineConfig(store="disk", store_dir=store, initial="cold")
    engine = Engine(path, cfg)
    with pytest.raises(FetchError, match="of layer 1 fails its CRC32C check"):
        engine.forward(ids, 0)
    unchecked = Engine(path, EngineConfig(store="disk", store_dir=store, initial="cold", verify=False))
    with pytest.raises(NonFiniteOutput, match="non-finite logits at position 0"):
        unchecked.forward(ids, 0)
    engine.close()
    unchecked.close()


class FaultyReads:
    """os.preadv that fails its `at`-th call (counted from arming): EIO, or a read that comes back
    short. Records the (layer, expert) whose read failed."""

    def __init__(self, monkeypatch, blob, num_experts, mode, at):
        self.real, self.blob, self.E, self.mode, self.at = os.preadv, blob, num_experts, mode, at
        self.calls, self.armed, self.failed = 0, False, None
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd, buffers, offset):
        n = self.real(fd, buffers, offset)
        if not self.armed:
            return n
        self.calls += 1
        if self.calls != self.at:
            return n
        self.failed = divmod(offset // self.blob, self.E)
        if self.mode == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return n // 2


class FaultyRing:
    """io_uring completions of which the `at`-th read of one of `kinds` (counted from arming) comes back as EIO
    or short, as the kernel would report them. Records the (layer, expert) whose read failed and counts the
    completions taken, so that a test can show the reads went through the ring."""

    def __init__(self, monkeypatch, engine, mode, at, kinds=("fetch",)):
        self.transfers, self.mode, self.at, self.kinds = engine.cache.transfers, mode, at, kinds
        assert self.transfers.ring is not None, "the engine reads without io_uring"
        self.calls, self.completed, self.armed, self.failed = 0, 0, False, None
        real = RingReads.completions

        def completions(ring, block):
            out = real(ring, block)
            self.completed += len(out)
            return [self._fault(ticket, n) for ticket, n in out] if self.armed else out
        monkeypatch.setattr(RingReads, "completions", completions)

    def _fault(self, ticket, n):
        t = self.transfers.reads[ticket][0]
        if t.kind not in self.kinds:
            return ticket, n
        self.calls += 1
        if self.calls != self.at:
            return ticket, n
        self.failed = (t.layer, t.expert)
        return ticket, -errno.EIO if self.mode == "eio" else n // 2


def check_consistent(engine):
    """Every mapping has its inverse; nothing is in flight; every resident slot holds its expert."""
    cache, st = engine.cache, engine.cache.state
    E = engine.args.num_experts
    assert not cache.pending and not st.pending.any()
    for s in np.flatnonzero(st.owner >= 0):
        assert st.slot_of.reshape(-1)[st.owner[s]] == s
    for flat in np.flatnonzero(st.slot_of.reshape(-1) >= 0):
        assert st.owner[st.slot_of.reshape(-1)[flat]] == flat
    ram = RamStore(engine.checkpoint, engine.args)
    for s in np.flatnonzero((st.owner >= 0) & ~st.low):  # a slot holding a small copy holds other bytes
        layer, e = divmod(int(st.owner[s]), E)
        assert torch.equal(cache.w13[s], ram.w13[layer, e]) and torch.equal(cache.w2[s], ram.w2[layer, e])


def clone_state(src, dst):
    """Give engine `dst` the cache state (bookkeeping, slot contents via its own store, policy
    account, token clock) of engine `src`."""
    for name in src.cache.state._fields:
        if name != "log":  # the action log is scratch, sized by the last call
            np.copyto(getattr(dst.cache.state, name), getattr(src.cache.state, name))
    for s in np.flatnonzero(src.cache.state.owner >= 0):
        layer, e = divmod(int(src.cache.state.owner[s]), src.args.num_experts)
        dst.store.read_into(layer, e, dst.cache.w13[s], dst.cache.w2[s])
    if src.policy.account is not None:
        np.copyto(dst.policy.bind(*src.policy.account.shape), src.policy.account)
    dst.stats.tokens = src.stats.tokens


@pytest.mark.parametrize("io", ["threads", pytest.param("uring", marks=needs_ring)])
@pytest.mark.parametrize("mode", ["eio", "short"])
@pytest.mark.parametrize("policy,at", [("fetch-all", 1), ("fetch-all", 4), ("quality-first", 2),
                                       ("quality-first", 7), ("threshold:tau=0.3,beta=0.2", 5)])
def test_failed_read_leaves_the_cache_consistent(request, monkeypatch, io, mode, policy, at):
    """A read that fails (on a worker thread: os.preadv; through io_uring: its completion) leaves the cache
    consistent and the engine computing what a clean one computes from the same state."""
    path, store = request.getfixturevalue("model" if io == "threads" else "paged_model")
    cfg = EngineConfig(store="disk", store_dir=store, policy=policy, initial="cold",
                       cache=CacheConfig(fraction=0.5, io=io))
    g = torch.Generator().manual_seed(at)
    first, faulted, after = (torch.randint(0, 96, (n,), generator=g) for n in (12, 16, 12))
    engine = Engine(path, cfg)
    engine.forward(first, 0)
    if io == "threads":
        faults = FaultyReads(monkeypatch, blob_bytes(store), engine.args.num_experts, mode, at)
    else:
        faults = FaultyRing(monkeypatch, engine, mode, at)
        assert engine.stats.read_mode == "o_direct+io_uring"
    faults.armed = True
    with pytest.raises(FetchError) as info:
        engine.forward(faulted, 0)
    layer, e = faults.failed
    assert f"expert {e} of layer {layer}" in str(info.value)
    assert ("short read" if mode == "short" else "Errno 5") in str(info.value)
    assert engine.cache.slot_of[layer, e] == -1
    check_consistent(engine)
    faults.armed = False

    clean = Engine(path, cfg)
    clone_state(engine, clean)
    for pos, ids in enumerate([after, after[:1], after[1:2]]):  # a window, then two decode steps
        p = 0 if pos == 0 else len(after) + pos - 1
        torch.testing.assert_close(engine.forward(ids, p), clean.forward(ids, p), rtol=0, atol=0)
    assert np.array_equal(engine.cache.slot_of, clean.cache.slot_of)
    check_consistent(engine)
    engine.close()
    clean.close()


@pytest.mark.parametrize("policy", ["threshold:tau=0.6,beta=0.05", "lowbit:tau=0.6,upgrade=1,beta=0.05"])
def test_a_failed_background_read_is_no_requests_error(model, policy):
    """Admissions that fail are repaired where they land (the expert left absent, or read again as a fetch when
    a token waits for it), counted, and raised in no forward: the one that polls them, maybe another
    request's, did not ask for them. Every resident slot still holds its expert."""
    path, store = model
    cfg = EngineConfig(store="disk", store_dir=store, policy=policy, initial="cold", cache=CacheConfig(fraction=0.5))
    engine = Engine(path, cfg)
    transfers, real = engine.cache.transfers, engine.cache.transfers._copy

    def copy(t):
        if t.kind in ("admit", "prefetch", "upgrade"):
            raise FetchError(f"expert {t.expert} of layer {t.layer}: injected")
        return real(t)
    transfers._copy = copy
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 96, (16,), generator=g)
        assert engine.forward(ids, 0).isfinite().all()
        for pos in range(6):  # decode steps poll the admissions the window started
            engine.forward(ids[pos:pos + 1], 16 + pos)
    engine.cache.finish_all()
    failed = engine.stats.failed_background_reads + engine.cache.failed_background
    assert failed > 0 and engine.stats.background_fetches > 0, (failed, engine.stats.background_fetches)
    check_consistent(engine)
    engine.close()


def test_fetch_all_after_a_fault_matches_the_exact_baseline(model, monkeypatch):
    path, store = model
    cfg = EngineConfig(store="disk", store_dir=store, initial="cold", cache=CacheConfig(fraction=0.25))
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(0))
    engine = Engine(path, cfg)
    faults = FaultyReads(monkeypatch, blob_bytes(store), engine.args.num_experts, "eio", 3)
    faults.armed = True
    with pytest.raises(FetchError):
        engine.forward(ids, 0)
    faults.armed = False
    exact = Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    torch.testing.assert_close(engine.forward(ids, 0), exact.forward(ids, 0))
    engine.close()


def test_the_calling_thread_reads_a_tokens_only_fetch(model, monkeypatch):
    """With caller reads, a layer's only miss of a decode step is read by the waiting thread and
    several misses by the workers; the logits equal those of reads all on the workers."""
    path, store = model
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1))
    reads: dict[tuple[int, int], list[bool]] = {}  # (step, layer) -> read in the calling thread?
    step = 0
    read_into = DiskStore.read_into

    def recorded(self, layer, *a):
        reads.setdefault((step, layer), []).append(threading.current_thread() is threading.main_thread())
        return read_into(self, layer, *a)

    logits = []
    for caller_reads in (True, False):
        cfg = EngineConfig(store="disk", store_dir=store, initial="cold",
                           cache=CacheConfig(fraction=0.5, caller_reads=caller_reads))
        engine = Engine(path, cfg)  # cold: the first steps miss several experts per layer
        monkeypatch.setattr(DiskStore, "read_into", recorded)
        reads.clear()
        out = []
        for step in range(12):
            out.append(engine.forward(ids[step:step + 1], step))
        monkeypatch.setattr(DiskStore, "read_into", read_into)
        sizes = {len(r) for r in reads.values()}
        assert 1 in sizes and max(sizes) > 1  # both cases happened
        for here in reads.values():
            assert here == [caller_reads and len(here) == 1] * len(here)
        logits.append(torch.cat(out))
        engine.close()
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@needs_ring
@pytest.mark.parametrize("policy", ["fetch-all", "lowbit:tau=0.15"])
def test_io_uring_reads_equal_worker_reads(tmp_path, policy):
    """Reads through io_uring (the built-in model's fp16 blobs land straight in fp16 slots; its int4
    small copies through a staging buffer, decoded when reaped) give the logits of reads on worker
    threads, and the statistics say which way they went."""
    ids = torch.arange(40, 52)
    logits, modes = [], []
    for io in ("uring", "threads"):
        engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, cache=CacheConfig(fraction=0.25, io=io),
                                           initial="cold", policy=policy))
        logits.append(torch.cat([engine.forward(ids[:4], 0)] + [engine.forward(ids[t:t + 1], t) for t in range(4, 12)]))
        assert engine.stats.sync_fetches > 0 and (engine.stats.lowbit_fetches > 0) == (policy != "fetch-all")
        modes.append(engine.stats.read_mode)
        engine.close()
    assert torch.equal(logits[0], logits[1])
    assert modes == ["o_direct+io_uring", "o_direct"]


@needs_ring
@pytest.mark.parametrize("allowed", [3, 1, 0], ids=["registered", "one-registered", "refused"])
def test_io_uring_staging_buffers_are_bounded(tmp_path, monkeypatch, allowed):
    """int4 slots take their blobs through staging buffers: a window whose misses outnumber them waits for
    buffers to come free, so there are never more than io_workers + 1 (what the memory budget counts), and
    the logits are those of reads on worker threads. The buffers are registered with the ring (fixed reads);
    where the kernel refuses that for all of them (the locked-memory limit), as many as it takes, the others
    taking vectored reads."""
    register = RingReads.register
    monkeypatch.setattr(RingReads, "register", lambda ring, buffers: len(buffers) <= allowed and
                        register(ring, buffers))
    ids = torch.arange(40, 104)
    logits = []
    for io in ("uring", "threads"):
        engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold", slot_dtype="int4",
                                           store_format=ExpertFormat.parse("int4"),
                                           cache=CacheConfig(fraction=0.25, io=io, io_workers=2)))
        logits.append(engine.forward(ids, 0))
        assert engine.stats.sync_fetches > 6 * 3  # more than three misses a layer
        if io == "uring":
            transfers = engine.cache.transfers
            assert transfers.staged == {engine.store.expert_bytes: 3}
            assert engine.budget()["buffer_bytes"] == 3 * engine.store.expert_bytes
            assert (transfers.ring.registered is not None) == (allowed > 0)
            assert [index for _, _, index in transfers.made[engine.store.blob]] == \
                [i if i < allowed else None for i in range(3)]
        engine.close()
    assert torch.equal(logits[0], logits[1])


@needs_ring
def test_waits_for_a_staging_buffer_count_as_stall(tmp_path, monkeypatch):
    """A read whose submission blocks until a staging buffer comes free waits on the slow tier: that time is in
    the statistics' stall, as a wait for the read itself is."""
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold", slot_dtype="int4",
                                       store_format=ExpertFormat.parse("int4"),
                                       cache=CacheConfig(fraction=0.25, io="uring", io_workers=0)))
    transfers, taken = engine.cache.transfers, []
    take = transfers.take_buffer_wait
    monkeypatch.setattr(transfers, "take_buffer_wait", lambda: taken.append(take()) or taken[-1])
    engine.forward(torch.arange(40, 104), 0)
    assert transfers.staged == {engine.store.expert_bytes: 1}  # every read after the first waited for the buffer
    assert taken[0] == 0 and len(taken) == 2 and taken[1] > 0  # before the forward (a cold start), then its own
    assert engine.stats.stall_s >= taken[1]
    engine.close()


@needs_ring
def test_a_warm_starts_waits_for_staging_buffers_are_no_tokens_stall(tmp_path):
    """Filling every slot at a warm start waits for staging buffers outside any forward: with every expert
    resident, a forward then stalls for nothing."""
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="warm", slot_dtype="int4",
                                       store_format=ExpertFormat.parse("int4"),
                                       cache=CacheConfig(fraction=1.0, io="uring", io_workers=0)))
    engine.forward(torch.arange(40, 104), 0)
    assert engine.stats.sync_fetches == 0 and engine.stats.stall_s == 0
    engine.close()


@needs_ring
def test_io_uring_read_faults_leave_the_cache_consistent(tmp_path, monkeypatch):
    """Through io_uring a corrupt blob fails its checksum and a truncated store file gives a short read:
    each a FetchError naming the expert, with the expert absent and nothing left in flight."""
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, cache=CacheConfig(fraction=0.25, io="uring"),
                                       initial="cold"))
    cache, store, E = engine.cache, engine.store, engine.args.num_experts
    with open(store.path, "r+b") as f:
        f.seek(store.offset(3, 7) + 100)
        f.write(os.urandom(64))
    with pytest.raises(FetchError, match="expert 7 of layer 3 fails its CRC32C check"):
        cache.fill(3, [6, 7, 8])
    assert cache.slot_of[3, 7] < 0 and cache.slot_of[3, 6] >= 0 and not cache.pending
    os.truncate(store.path, store.offset(5, E - 1) + 4096)
    with pytest.raises(FetchError, match=f"short read of expert {E - 1} of layer 5: 4096 of"):
        cache.fill(5, [E - 1])
    assert cache.slot_of[5, E - 1] < 0 and not cache.pending and not cache.state.pending.any()
    ring = FaultyRing(monkeypatch, engine, "eio", 1, kinds=("fill",))
    ring.armed = True
    with pytest.raises(FetchError, match=r"reading expert 2 of layer 0 from the disk store failed \(\[Errno 5\]"):
        cache.fill(0, [2])  # its completion carries the error the kernel reports
    assert ring.failed == (0, 2) and ring.completed == 1
    assert cache.slot_of[0, 2] < 0 and not cache.pending and not cache.state.pending.any()
    engine.close()


@needs_ring
@pytest.mark.parametrize("slot_dtype", ["auto", "int4"])  # straight into the slots, through staging buffers
def test_a_read_the_ring_refuses_to_queue_leaves_nothing_to_wait_for(tmp_path, monkeypatch, slot_dtype):
    """io_uring_enter failing as a read is queued (an errno it does not retry, or the kernel taking no read for a
    second) raised from `submit` with the read already counted in flight: closing the engine then waited for its
    completion and raised "would wait forever" in place of the error, and its staging buffer was never reused."""
    from expertcache.engine.quant import ExpertFormat
    fmt = ExpertFormat.parse("int4") if slot_dtype == "int4" else None
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold", slot_dtype=slot_dtype,
                                       store_format=fmt, cache=CacheConfig(fraction=0.25, io="uring")))
    real, calls = RingReads._queue, []

    def queue(ring, *a):  # every read, into registered buffers or not
        calls.append(a)
        if len(calls) == 2:
            raise OSError(errno.EAGAIN, "io_uring_enter: the kernel took no read for a second; retry later")
        return real(ring, *a)
    monkeypatch.setattr(RingReads, "_queue", queue)
    with pytest.raises(OSError, match="the kernel took no read"):
        engine.cache.fill(2, [4, 5, 6])
    cache = engine.cache
    assert cache.slot_of[2, 5] < 0 and not cache.transfers.reads and not cache.pending and not cache.state.pending.any()
    cache.fill(2, [5, 6, 7])  # every staging buffer came back
    assert (cache.slot_of[2, 5:8] >= 0).all()
    if slot_dtype == "auto":
        check_consistent(engine)
    engine.close()


def test_io_backend_errors_name_the_fix():
    """--io uring where reads cannot take it, or an unknown backend, is refused in one line naming the choices."""
    from expertcache.errors import BadInput
    with pytest.raises(BadInput, match="--io uring needs .*; use --io auto or --io threads"):
        Engine(None, EngineConfig(store="ram", cache=CacheConfig(io="uring")))
    with pytest.raises(BadInput, match="unknown I/O backend 'fast'; choose one of auto, uring, threads"):
        Engine(None, EngineConfig(store="ram", cache=CacheConfig(io="fast")))


@needs_ring
def test_io_uring_refused_for_a_float_store_of_unpaged_parts_names_why(tiny, tmp_path):
    """GPT-OSS's float experts carry biases, whose parts are not whole pages: their reads go through worker
    threads, and --io uring was refused naming conditions that all held; the message names the parts."""
    from expertcache.errors import BadInput
    with pytest.raises(BadInput, match="whole 4 KiB pages.*biases.*--io auto"):
        Engine(tiny["gpt_oss"][0], EngineConfig(store="disk", store_dir=tmp_path, cache=CacheConfig(io="uring")))


@needs_ring
def test_io_uring_refused_for_a_quantized_store_into_float_slots_names_the_slot_dtype(paged_model, tmp_path):
    """An int8 store decoded into float slots reads on worker threads: --io uring is refused naming that, and the
    slot dtype that keeps the blobs as they are (not the parts' pages, which are whole here)."""
    from expertcache.errors import BadInput
    path, _ = paged_model
    with pytest.raises(BadInput, match="quantized store .*float slots decode each int8 blob.*--slot-dtype int8"):
        Engine(path, EngineConfig(store="disk", store_dir=tmp_path / "int8", store_format=ExpertFormat.parse("int8"),
                                  cache=CacheConfig(io="uring")))


def io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("expert-io-")]


@needs_ring
def test_io_worker_threads_start_only_for_a_read_that_needs_one(paged_model):
    """Where io_uring serves every read no worker thread is started; with --io threads the workers start at
    the first read handed to them, not when the engine opens."""
    path, store = paged_model
    before = len(io_threads())
    ids = torch.arange(16) % 96
    ring = Engine(path, EngineConfig(store="disk", store_dir=store, initial="cold", cache=CacheConfig(io="uring")))
    ring.forward(ids, 0)
    assert ring.stats.sync_fetches > 0 and ring.cache.transfers.workers == [] and len(io_threads()) == before
    ring.close()
    threads = Engine(path, EngineConfig(store="disk", store_dir=store, initial="cold", cache=CacheConfig(io="threads")))
    assert threads.cache.transfers.workers == [] and len(io_threads()) == before
    threads.forward(ids, 0)  # a window's misses: several reads a layer, handed to the workers
    assert len(threads.cache.transfers.workers) == 4 and len(io_threads()) == before + 4
    threads.close()
    assert len(io_threads()) == before


def test_a_reconversion_counts_the_space_of_what_it_replaces(model, monkeypatch):
    """A store converted again (into the same folder, or after a conversion killed midway left its partial file) on
    a disk with less free than a store gets back the space of the files it replaces, instead of being refused; one
    refused leaves the earlier store as it was, not without its experts.json."""
    import expertcache.engine.stores.convert as convert
    from expertcache.errors import NotEnoughDisk
    path, store = model
    ckpt = open_checkpoint(path)
    args = model_args(ckpt.config)
    size = (store / "experts.bin").stat().st_size
    free = [size // 2]
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(0, 0, free[0]))
    convert_to_disk(ckpt, args, store)  # its own experts.bin, replaced
    os.replace(store / "experts.bin", store / "experts.bin.partial")  # as a conversion killed near its end leaves it
    (store / "experts.json").unlink()
    convert_to_disk(ckpt, args, store)
    DiskStore(store, args).close()
    small = convert_to_disk(ckpt, args, store.with_name("int4"), fmt=ExpertFormat.parse("int4"))
    free[0] = 0
    with pytest.raises(NotEnoughDisk, match="free disk space"):
        convert_to_disk(ckpt, args, small)  # fp32 experts: larger than the int4 store it would replace
    assert DiskStore(small, args).format == ExpertFormat.parse("int4")


@pytest.mark.parametrize("edit", [lambda m: [m], lambda m: {k: v for k, v in m.items() if k != "num_layers"},
                                  lambda m: {**m, "w13": 5}, lambda m: {**m, "checksums": ["a"] * len(m["checksums"])},
                                  lambda m: {**m, "dtype": ["fp16"]}])
def test_an_experts_json_of_another_shape_is_one_line(capsys, model, edit):
    """An experts.json that is valid JSON but not a store's header (a list, a field missing or of another type) is
    refused naming the file and the fix, not a traceback."""
    path, store = model
    header = store / "experts.json"
    header.write_text(json.dumps(edit(json.loads(header.read_text()))))
    code = cli.main(["ppl", "--model", str(path), "--store", "disk", "--store-dir", str(store), "--text", __file__])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "experts.json is corrupted" in err and "expertcache convert" in err


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGXCPU"])
def test_sigterm_during_a_conversion_removes_its_partial_file(tiny, tmp_path, name):
    """SIGTERM (a supervisor, `timeout`, a container stopping) midway through a conversion unwinds it as Ctrl-C
    does, removing the partial file (tens of GB of a real model's), and the process still dies of the signal; so do
    a hang-up (an ssh session dropped) and a soft CPU-time limit, which left the partial file."""
    import signal
    import subprocess
    import sys
    script = """if True:
        import os, signal, sys
        import expertcache.engine.stores.convert as convert
        from expertcache import cli
        real, calls = convert.encode, []
        def encode(*a, **k):
            calls.append(1)
            if len(calls) == 4:  # three experts written: the signal lands midway
                os.kill(os.getpid(), getattr(signal, sys.argv[3]))
            return real(*a, **k)
        convert.encode = encode
        sys.exit(cli.main(["convert", "--model", sys.argv[1], "--out", sys.argv[2]]))"""
    out = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", script, str(tiny[FAMILY][0]), str(out), name], capture_output=True,
                          text=True)
    assert proc.returncode == -getattr(signal, name), proc.stderr
    assert out.is_dir() and not list(out.glob("experts.*")), list(out.iterdir())


def test_a_damaged_kernel_cache_is_named_with_its_fix(tmp_path):
    """A truncated or emptied index file of the compiled kernels' cache (a full disk, a killed write) failed every
    run in an EOFError's traceback, the folder never named: one line names it and how to recover."""
    import subprocess
    import sys

    from expertcache.kernel.compiled import cache_dir
    Engine(None, EngineConfig(store="ram")).close()  # the kernels compiled and cached
    copy = tmp_path / "expertcache-numba" / cache_dir().name
    shutil.copytree(cache_dir(), copy)
    for index in copy.glob("*.nbi"):
        index.write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "expertcache", "generate", "--store", "ram", "-n", "1", "-p", "a"],
                          capture_output=True, text=True, env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "the compiled kernels' cache is damaged" in err[-1] and f"rm -rf {copy}" in err[-1], err[-1]


def test_an_interrupted_reconversion_leaves_the_earlier_store_usable(tiny, tmp_path):
    """`convert --force` over a store, stopped midway (SIGTERM, Ctrl-C), leaves the earlier store as it was where
    the disk holds both: it had removed it first, and a run then found no store and converted for minutes."""
    import signal
    import subprocess
    import sys
    from expertcache.engine.stores.convert import current_store
    path, out = tiny[FAMILY][0], tmp_path / "store"
    assert cli.main(["convert", "--model", str(path), "--out", str(out)]) == 0
    before = [(out / name).read_bytes() for name in ("experts.json", "experts.bin")]
    script = """if True:
        import os, signal, sys
        import expertcache.engine.stores.convert as convert
        from expertcache import cli
        real, calls = convert.encode, []
        def encode(*a, **k):
            calls.append(1)
            if len(calls) == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)
        convert.encode = encode
        sys.exit(cli.main(["convert", "--force", "--model", sys.argv[1], "--out", sys.argv[2]]))"""
    proc = subprocess.run([sys.executable, "-c", script, str(path), str(out)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert [(out / name).read_bytes() for name in ("experts.json", "experts.bin")] == before
    assert not (out / "experts.bin.partial").exists()
    ckpt = open_checkpoint(path)
    assert current_store(ckpt, model_args(ckpt.config), out)


def test_sigterm_inside_a_c_librarys_callback_still_ends_the_run_by_the_signal():
    """A SIGTERM that lands while a C library calls back into Python (numba's cache notification, during a first
    run's compile) raises where it cannot propagate: Python printed "Exception ignored" and dropped it, the library
    then failed in its own way ("no compiled object yet"), and the run ended in that traceback, not by the signal."""
    import signal
    import subprocess
    import sys
    script = """if True:
        import ctypes, os, signal, sys
        from expertcache import cli
        from expertcache.commands import info
        def run(a):
            def callback():
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(1000))  # the handler runs here, inside the callback
            ctypes.CFUNCTYPE(None)(callback)()
            raise RuntimeError("no compiled object yet")
        info.run = run
        sys.exit(cli.main(["info"]))"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGTERM and "Traceback" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr


def test_a_conversion_whose_header_cannot_be_written_leaves_no_store_file(capsys, tiny, tmp_path):
    """The disk fills after experts.bin is written whole, as experts.json is: the conversion fails in one line and
    removes experts.bin too (a real model's tens of GB, which no run uses without its header and none removed);
    the next conversion makes a store that opens."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "experts.json.partial").symlink_to("/dev/full")  # the header's write: no space left on device
    code = cli.main(["convert", "--model", str(tiny[FAMILY][0]), "--out", str(store)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # below the conversion's finished bar
    assert code == 2 and err.startswith("expertcache: error:") and "No space left on device" in err, err
    assert not list(store.glob("experts.*")), list(store.iterdir())
    assert cli.main(["convert", "--model", str(tiny[FAMILY][0]), "--out", str(store)]) == 0
    DiskStore(store, model_args(open_checkpoint(tiny[FAMILY][0]).config)).close()


INTERRUPTED = [("ram", "auto", "decided"), ("disk", "threads", "decided"), ("disk", "threads", "checked"),
               pytest.param("disk", "uring", "decided", marks=needs_ring),
               pytest.param("disk", "uring", "checked", marks=needs_ring),
               pytest.param("int4", "uring", "checked", marks=needs_ring)]


@pytest.mark.parametrize("store,io,where", INTERRUPTED)
def test_an_interrupted_forward_leaves_the_engine_computing_what_a_fresh_one_does(tmp_path, monkeypatch, store, io,
                                                                                   where):
    """A KeyboardInterrupt (Ctrl-C) anywhere in a forward: right after a layer's decisions mapped the experts to
    read (their reads never started: the slots held other experts' bytes, used later as theirs), or while a read is
    checked (through io_uring: the other completions it had taken were lost, and close() failed as it would wait
    forever; a staging buffer was never given back). The same engine's next forwards equal a fresh engine's, and it
    closes."""
    from expertcache.engine import cache as cache_module
    int4 = dict(slot_dtype="int4", store_format=ExpertFormat.parse("int4")) if store == "int4" else {}
    cfg = EngineConfig(store="ram" if store == "ram" else "disk", store_dir=tmp_path, initial="cold",
                       cache=CacheConfig(fraction=0.25, io=io), **int4)
    engine = Engine(None, cfg)
    engine.forward(torch.arange(60, 72), 0)
    calls = []

    def interrupting(real):
        def call(*a):
            out = real(*a)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return out
        return call
    if where == "decided":
        monkeypatch.setattr(cache_module.kernel, "decide_layer", interrupting(cache_module.kernel.decide_layer))
    else:
        monkeypatch.setattr(DiskStore, "check_read", interrupting(DiskStore.check_read))
    with pytest.raises(KeyboardInterrupt):
        engine.forward(torch.arange(12, 40), 0)
    monkeypatch.undo()
    fresh = Engine(None, cfg)  # cold: empty, as the interrupted engine's cache starts again
    ids = torch.arange(40, 56)
    for pos, x in [(0, ids[:12])] + [(t, ids[t:t + 1]) for t in range(12, 16)]:
        assert torch.equal(engine.forward(x, pos), fresh.forward(x, pos))
    transfers = engine.cache.transfers
    assert not engine.cache.pending and not getattr(transfers, "reads", None)
    assert {n: len(free) for n, free in getattr(transfers, "staging", {}).items()} == getattr(transfers, "staged", {})
    engine.close()
    fresh.close()
