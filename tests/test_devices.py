"""The CUDA path against PyTorch's device and stream rules. Without a GPU the seams are checked on the CPU: the
transfers' copy protocol against a fake runtime that logs every stream, event and copy call; tensors' devices
where one module hands them to the next (meta tensors stand in for another device). Tests named *cuda* need a
GPU and skip without one (benchmarks/gpu_check.sh runs them where one is lent)."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from expertcache.engine.cache import CacheConfig
from expertcache.engine.slots import slot_format
from expertcache.engine.engine import Engine, EngineConfig, non_finite_cause
from expertcache.engine.linear import float_dtype
from expertcache.engine.moe import PrefetchConfig
from expertcache.engine.perplexity import teacher_forced
from expertcache.engine.quant import ExpertFormat
from expertcache.engine.sampling import Sampler, SamplingParams
from expertcache.engine.stores import ExpertShape
from expertcache.engine.transfer import TransferEngine
from expertcache.errors import BadInput

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


class FakeEvent:
    def __init__(self, log):
        self.log, self.stream, self.complete = log, None, False

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name, self))

    def query(self):
        return self.complete

    def synchronize(self):
        self.log.append(("synchronize", self))
        self.complete = True


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        assert event.stream is not None, "waiting on an event never recorded is no wait at all"
        self.log.append(("wait_event", self.name, event))

    def synchronize(self):
        self.log.append(("stream_synchronize", self.name))


class FakeRuntime:
    """CudaRuntime's methods on CPU tensors, logging the calls; `pinned` holds the staging tensors it made."""

    def __init__(self):
        self.log, self.pinned = [], []
        self.local = threading.local()  # the current stream is per thread, as torch.cuda.stream's is
        self.compute = FakeStream("compute", self.log)

    @property
    def current(self):
        return getattr(self.local, "stream", None)

    @current.setter
    def current(self, stream):
        self.local.stream = stream

    def stream(self):
        return FakeStream("copy", self.log)

    def current_stream(self):
        return self.current or self.compute

    def event(self):
        return FakeEvent(self.log)

    @contextmanager
    def use(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def staging(self, like):
        t = torch.empty(like.shape, dtype=like.dtype)
        self.pinned.append(t)
        return t

    def copy(self, dst, src):
        assert any(src is p for p in self.pinned) or getattr(src, "page_locked", False), "a copy from pageable memory"
        self.log.append(("copy", self.current_stream().name, src))
        dst.copy_(src)


class CountingStore:
    """A slow tier whose expert (l, e) is all l * 100 + e; `pinned_host` like the pinned store when asked."""
    name = read_mode = "fake"
    inline = False

    def __init__(self, pinned=False):
        self.shape = ExpertShape(2, 4, (8, 4), (4, 4))
        self.expert_bytes = self.shape.numel * 4
        self.pinned_host = pinned

    def read_into(self, layer, expert, *dsts):
        for d in dsts:
            assert d.device.type == "cpu"
            d.fill_(layer * 100 + expert)
        return self.expert_bytes

    def host_parts(self, layer, expert):
        parts = [torch.full(p, float(layer * 100 + expert)) for p in self.shape.parts]
        for p in parts:
            p.page_locked = True
        return parts

    def direct_targets(self, dsts):
        return None


def slots(store, n=3):
    return torch.zeros((n, *store.shape.w13)), torch.zeros((n, *store.shape.w2))


@pytest.mark.parametrize("pinned", [False, True], ids=["staged", "pinned-store"])
def test_device_copies_are_asynchronous_and_the_compute_stream_waits_for_them(pinned):
    store, rt = CountingStore(pinned), FakeRuntime()
    w13, w2 = slots(store)
    engine = TransferEngine(store, w13, w2, workers=2, runtime=rt)
    try:
        ts = [engine.submit(l, e, s, "fetch") for s, (l, e) in enumerate([(0, 1), (1, 2), (1, 3)])]
        for t in ts:
            assert engine.wait(t) >= 0
        for s, (l, e) in enumerate([(0, 1), (1, 2), (1, 3)]):
            assert torch.all(w13[s] == l * 100 + e) and torch.all(w2[s] == l * 100 + e)
        for t in ts:
            ops = [op for op in rt.log if t.event in op or t.ready in op]
            # the slot is taken on the compute stream; the copy stream waits for it, copies, records
            assert ops[0] == ("record", "compute", t.ready)
            assert ("wait_event", "copy", t.ready) in ops and ops.index(("wait_event", "copy", t.ready)) < \
                ops.index(("record", "copy", t.event))
            # the compute stream waits for the copy (the host never blocks on it); later ops may follow on other
            # threads (a worker's copy stream waiting on this event before it reuses the staging buffer)
            assert ops.index(("wait_event", "compute", t.event)) > ops.index(("record", "copy", t.event))
        copies = [op for op in rt.log if op[0] == "copy"]
        assert len(copies) == 6 and all(op[1] == "copy" for op in copies)
        assert not [op for op in rt.log if op[0] == "synchronize"]
        assert (len(rt.pinned) == 0) == pinned
    finally:
        engine.close()
    assert rt.log[-1] == ("stream_synchronize", "copy")  # the staging buffers outlive every copy from them


def test_a_staging_buffer_is_reused_only_once_its_copy_has_completed():
    store, rt = CountingStore(), FakeRuntime()
    w13, w2 = slots(store)
    engine = TransferEngine(store, w13, w2, workers=0, runtime=rt)  # one staging set: workers + the caller
    try:
        first = engine.submit(0, 0, 0, "fetch", here=True)
        engine.wait(first)
        assert len(rt.pinned) == 2 and not first.event.complete
        second = engine.submit(0, 1, 1, "fetch", here=True)  # must wait for the first copy to finish reading
        engine.wait(second)
        assert ("synchronize", first.event) in rt.log and len(rt.pinned) == 2
        assert torch.all(w13[0] == 0) and torch.all(w13[1] == 1)
        second.event.complete = True
        third = engine.submit(1, 0, 2, "fetch", here=True)
        engine.wait(third)
        assert ("synchronize", second.event) not in rt.log and len(rt.pinned) == 2
    finally:
        engine.close()


def test_teacher_forced_targets_are_on_the_logits_device():
    V = 11
    seen = []
    for logits, targets in teacher_forced(lambda x: torch.empty(len(x), V, device="meta"), list(range(10)), 4):
        seen.append(targets.device)
        assert targets.device == logits.device
    assert seen and all(d.type == "meta" for d in seen)


def test_the_sampler_draws_on_its_generators_device(monkeypatch):
    draws = []
    real = torch.multinomial

    def multinomial(probs, n, generator=None):
        draws.append((probs.device, generator.device))
        return real(probs, n, generator=generator)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    Sampler(SamplingParams(temperature=1.0, seed=1, repetition_penalty=1.2))(torch.randn(16),
                                                                           torch.zeros(16, dtype=torch.bool))
    assert draws and all(p == g for p, g in draws)


def test_a_bf16_checkpoint_stays_bf16_on_cuda():
    cuda = torch.device("cuda")  # a device name: no GPU needed to ask what it would hold
    assert float_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert float_dtype("auto", cuda, torch.float16) == torch.float16
    assert float_dtype("auto", cuda, torch.float32) == torch.float16
    assert slot_format("auto", cuda, ExpertFormat("bfloat16")).dtype == "bfloat16"
    assert slot_format("auto", cuda, ExpertFormat("float32")).dtype == "float16"


def test_non_finite_logits_name_fp16_overflow_when_a_wider_checkpoint_runs_in_fp16():
    narrowed = non_finite_cause({"compute": torch.float16, "dense": torch.float16, "slot": torch.bfloat16},
                                torch.bfloat16)
    assert "overflow of fp16" in narrowed and "compute and dense" in narrowed and "corrupt" not in narrowed
    assert "corrupt weights" in non_finite_cause({"compute": torch.float16, "slot": torch.float16}, torch.float16)
    assert "corrupt weights" in non_finite_cause({"compute": torch.float32, "slot": torch.bfloat16}, torch.bfloat16)


def test_pinned_store_with_a_lowbit_policy_names_the_policy_not_a_flag_never_given():
    with pytest.raises(BadInput) as e:
        Engine(None, EngineConfig(store="pinned", policy="lowbit:tau=0.15"))
    msg = str(e.value)
    assert "lowbit" in msg and "pinned" in msg and "--store-dtype" not in msg and "store dtype" not in msg


# -- on a GPU ------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("store", ["ram", "disk", "pinned"])
def test_cuda_decode_keeps_every_tensor_on_the_device(store):
    from expertcache.engine.generate import generate
    e = Engine(None, EngineConfig(device="cuda", store=store, policy="quality-first"))
    try:
        assert e.cache.w13.is_cuda and e.model.k_cache.is_cuda
        tokens = list(generate(e, e.encode("The cache"), 8))
        assert len(tokens) == 8 and e.stats.sync_fetches + e.stats.hits > 0
    finally:
        e.close()


@needs_cuda
def test_cuda_perplexity_and_seeded_sampling_match_the_cpu():
    from expertcache.engine.perplexity import perplexity
    ids = None
    results = {}
    for device in ("cpu", "cuda"):
        e = Engine(None, EngineConfig(device=device, store="ram"))
        try:
            ids = ids or e.encode("The expert cache keeps some experts in fast memory and reads the rest." * 4)
            results[device] = perplexity(e, ids, context=32).ppl
        finally:
            e.close()
    assert results["cuda"] == pytest.approx(results["cpu"], rel=2e-2)
    logits = torch.randn(64)
    draws = {d: [Sampler(SamplingParams(temperature=1.0, seed=3))(logits.to(d), torch.zeros(64, dtype=torch.bool))
                 for _ in range(3)] for d in ("cpu", "cuda")}
    assert draws["cpu"] == draws["cuda"]


def decoded_logits(config: EngineConfig, text: str = "The expert cache keeps some experts in fast memory."):
    """Each token's logits, fed one at a time (the decode path, whose per-token expert sum has a fixed order), and
    the run's statistics."""
    e = Engine(None, config)
    try:
        ids = e.encode(text)
        return torch.cat([e.forward(ids[p:p + 1], p).float().cpu() for p in range(len(ids))]), e.stats
    finally:
        e.close()


@needs_cuda
@pytest.mark.parametrize("store", ["pinned", "disk"])
def test_cuda_fetch_all_through_a_quarter_cache_gives_the_resident_logits(store):
    """Fetch-every-miss is exact on the GPU too: every expert copied into a slot on the copy stream computes
    what the all-resident model computes, bit for bit."""
    ref, _ = decoded_logits(EngineConfig(device="cuda", store="ram", cache=CacheConfig(fraction=1.0)))
    got, stats = decoded_logits(EngineConfig(device="cuda", store=store, policy="fetch-all",
                                             cache=CacheConfig(fraction=0.25)))
    assert stats.sync_fetches > 0
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


@needs_cuda
@pytest.mark.parametrize("predictor", ["router-ahead", "estimator"])
def test_cuda_prefetch_keeps_fetch_all_exact(predictor):
    ref, _ = decoded_logits(EngineConfig(device="cuda", store="ram", cache=CacheConfig(fraction=1.0)))
    got, stats = decoded_logits(EngineConfig(device="cuda", store="disk", policy="fetch-all",
                                             cache=CacheConfig(fraction=0.25),
                                             prefetch=PrefetchConfig(predictor, "prefetch")))
    assert stats.prefetch_fetches > 0
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


@needs_cuda
def test_cuda_windows_under_fetch_all_are_the_resident_models_to_fp16_rounding():
    """A window's experts run grouped by slot, so which slots hold what decides the matrix sizes cuBLAS gets, and a
    token's k experts are summed by index_add_ in no fixed order: on the GPU a window under fetch-all is the
    all-resident model's to rounding, not bit for bit as decode is (benchmarks/RESULTS.md, "On a GPU")."""
    def window_logits(config: EngineConfig) -> torch.Tensor:
        e = Engine(None, config)
        try:
            ids = e.encode("The expert cache keeps some experts in fast memory and reads the rest. " * 4)
            return torch.cat([logits.float().cpu() for logits, _ in
                              teacher_forced(lambda x: e.forward(x, 0), ids, 32)])
        finally:
            e.close()
    ref = window_logits(EngineConfig(device="cuda", store="ram", cache=CacheConfig(fraction=1.0)))
    got = window_logits(EngineConfig(device="cuda", store="pinned", cache=CacheConfig(fraction=0.25)))
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=2e-2)
