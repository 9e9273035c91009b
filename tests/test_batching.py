"""Continuous batching: the batched decode forward against per-sequence forwards, and the server's
batch schedule against serial runs of the same requests."""
import os
import threading

import pytest
import torch

from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.generate import TextGeneration, batch_logits, generate
from expertcache.engine.sampling import SamplingParams
from expertcache.errors import BadInput, FetchError
from expertcache.serve.scheduler import Request, Scheduler, SchedulerConfig


@pytest.fixture(scope="module")
def builtin():
    engine = Engine(None, EngineConfig(store="ram", max_seq=256))
    yield engine
    engine.close()


def prompts_of(engine: Engine, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given lengths, different from each other."""
    V = engine.args.vocab_size
    return [[(17 * n + 31 * j + 5) % V for j in range(n)] for n in lengths]


def check_batched_logits(engine: Engine, lengths: list[int], steps: int) -> None:
    """Sequences of different lengths decode `steps` batched steps; each step's logits equal one forward per
    sequence over a copy of its keys and values, and the keys and values it writes are the same."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    gens = [TextGeneration(engine, p, params, own_kv=True) for p in prompts_of(engine, lengths)]
    for g in gens:
        g.step()  # the prompt
    for _ in range(steps):
        alone = []
        engine.kv_swapped = True  # each sequence's own keys swapped in, as a generation with its own cache does
        for g in gens:
            engine.model.k_cache, engine.model.v_cache = (t.clone() for t in g.kv)
            alone.append((engine.forward(torch.tensor(g.tokens[-1:]), g.position)[-1],
                          engine.model.k_cache, engine.model.v_cache))
        engine.kv_swapped = False
        logits = batch_logits(engine, gens)
        for b, (g, (want, k, v)) in enumerate(zip(gens, alone)):
            torch.testing.assert_close(logits[b], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g.kv[0], k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g.kv[1], v, atol=1e-5, rtol=1e-5)
            g.advance(logits[b])


@pytest.mark.parametrize("compiled", [True, False])
def test_batched_forward_equals_one_forward_per_sequence(builtin, compiled, monkeypatch):
    """Both attention paths of the batch: decode's compiled block per sequence, and the projections on the
    batch with attention per sequence (where the compiled block does not apply: GPU, 16-bit, gated)."""
    assert builtin.model.compiled
    monkeypatch.setattr(builtin.model, "compiled", compiled)
    tokens = builtin.stats.tokens
    check_batched_logits(builtin, [3, 9, 1, 20], steps=3)
    assert builtin.stats.tokens - tokens == (3 + 9 + 1 + 20) + 3 * 4 * 2  # a batch of B counts B decode tokens


@pytest.mark.parametrize("compiled", [True, False])
def test_batched_forward_with_sliding_window_and_sinks(tiny, compiled):
    """GPT-OSS: sinks, and a 4-token window that the longer sequences have passed and the shorter not."""
    engine = Engine(tiny["gpt_oss"][0], EngineConfig(initial="cold", max_seq=64))
    assert engine.args.attention_sinks and engine.args.sliding_window == 4 and engine.model.compiled
    engine.model.compiled = compiled
    check_batched_logits(engine, [2, 6, 11], steps=4)
    engine.close()


def test_batched_forward_with_prefetching(builtin):
    """A predictor prefetches the experts most of the batch's tokens predict; outputs stay exact."""
    from expertcache.engine.moe import PrefetchConfig
    builtin.set_prefetch(PrefetchConfig())
    try:
        check_batched_logits(builtin, [4, 7, 12], steps=2)
        assert builtin.stats.prefetch_fetches > 0
    finally:
        builtin.set_prefetch(None)


def test_a_batch_past_a_budgets_pass_runs_in_passes(monkeypatch):
    """Under a memory budget a batched step of more sequences than a pass's tokens runs in passes of that many, the
    workspace the budget counts, and stays exact."""
    from dataclasses import replace
    config = EngineConfig(store="disk", max_seq=64, initial="cold", memory_budget=40 * 2**20, longest_prompt=16)
    engine = Engine(None, config)
    assert engine.forward_tokens == 16
    sizes, run = [], engine.model.forward_batch
    monkeypatch.setattr(engine.model, "forward_batch", lambda ids, *a: sizes.append(len(ids)) or run(ids, *a))
    check_batched_logits(engine, list(range(1, 21)), steps=2)
    assert sizes == [16, 4] * 2
    engine.close()
    plain = Engine(None, replace(config, memory_budget=None))
    assert plain.forward_tokens > 20  # without a budget: one pass
    plain.close()


def test_batched_forward_refuses_bad_input(builtin, tiny):
    gen = TextGeneration(builtin, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), own_kv=True)
    with pytest.raises(BadInput, match="past their prompt"):
        batch_logits(builtin, [gen])
    k, v = gen.kv
    with pytest.raises(BadInput, match="beyond its KV buffer"):
        builtin.forward_batch(torch.tensor([1]), [k.shape[2]], [(k, v)])
    engine = Engine(tiny["deepseek_v3"][0], EngineConfig(initial="cold", max_seq=32))
    with pytest.raises(BadInput, match="one sequence at a time"):
        engine.forward_batch(torch.tensor([1]), [0], [(k, v)])
    engine.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "qwen3_next"])
def test_sequences_of_their_own_kv_run_one_at_a_time_where_the_state_is_the_engines(tiny, family):
    """Latent attention's cache and linear attention's state are not swapped with a sequence's keys and values: two
    generations stepped in turn read each other's (10-50% of their logits off on tiny models). The second step
    after another's is refused; run one to its end, and the next matches it run alone."""
    engine = Engine(tiny[family][0], EngineConfig(initial="cold", max_seq=32))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    alone = list(TextGeneration(engine, [5, 6, 7], params, own_kv=True))
    first, second = (TextGeneration(engine, p, params, own_kv=True) for p in ([1, 2, 3], [5, 6, 7]))
    first.step()
    second.step()
    with pytest.raises(BadInput, match="finish one generation before the next starts"):
        first.step()
    again = TextGeneration(engine, [5, 6, 7], params, own_kv=True)
    assert [o.token for o in again] == [o.token for o in alone]
    engine.close()


def test_linear_attention_runs_on_from_its_state_or_again_from_0(tiny):
    """Qwen3-Next's recurrent state holds every position it ran: a forward from an earlier position (a rerun after
    an edit) or a later one ran on from it silently (up to 9% of the logits off). Refused, naming where it may go
    on; position 0 starts again and gives the logits of a fresh run."""
    engine = Engine(tiny["qwen3_next"][0], EngineConfig(initial="cold", max_seq=32))
    ids = torch.arange(1, 13)
    whole = engine.forward(ids, 0)
    engine.forward(ids[:10], 0)
    for pos in (5, 11):
        with pytest.raises(BadInput, match="run position 10 next, or start again at 0"):
            engine.forward(ids[pos:pos + 1], pos)
    torch.testing.assert_close(engine.forward(ids[10:], 10), whole[10:])
    engine.close()


def test_batched_forward_refuses_positions_and_caches_unlike_the_models(builtin):
    """The compiled attention reads and writes a sequence's keys and values without bounds checks: a negative
    position, a buffer of half the head size, of twice the heads or of float64 decoded garbage in silence, and
    a missing pair or a float position failed inside the forward. Each is one BadInput, before anything runs."""
    gen = TextGeneration(builtin, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), own_kv=True)
    k, v = gen.kv
    L, heads, N, D = k.shape
    ids = torch.tensor([5])
    for positions, kv, words in (
            ([-1], [(k, v)], "position -1 of sequence 0 must be a whole number"),
            ([0.5], [(k, v)], "position 0.5"), ([True], [(k, v)], "position True"),
            ([0, 1], [(k, v)], "a list of 1 positions"), ([0], [], "got 1 and 0"),
            ([0], [None], "kv\\[0\\] must be a \\(keys, values\\) pair"), ([0], [(k, v, k)], "pair"),
            ([0], [(k[..., :D // 2].contiguous(), v)], "keys must be a contiguous"),
            ([0], [(k, torch.zeros(L, 2 * heads, N, D))], "values must be"),
            ([0], [(k.double(), v)], "torch.float64"), ([0], [(k[:1].contiguous(), v)], "keys must be"),
            ([0], [(k.transpose(2, 3), v)], "contiguous"), ([0], [(k, v.numpy())], "got ndarray")):
        with pytest.raises(BadInput, match=words):
            builtin.forward_batch(ids, positions, kv)
    assert torch.isfinite(builtin.forward_batch(ids, [3], [(k, v)])).all()  # the model's own layout runs


def run_requests(engine: Engine, config: SchedulerConfig, requests: list[Request]) -> None:
    """Submit all requests at once and wait until every one has ended."""
    done = threading.Semaphore(0)
    for r in requests:
        emit = r.emit
        r.emit = lambda item, emit=emit: (emit(item), item is None and done.release())
    scheduler = Scheduler(engine, config)
    scheduler.start()
    for r in requests:
        scheduler.submit(r)
    for _ in requests:
        assert done.acquire(timeout=300), "a request did not end"
    scheduler.stop()


def collecting(prompt: list[int], params: SamplingParams) -> tuple[Request, list]:
    """A request whose outputs (tokens, then errors) land in the returned list."""
    got: list = []
    request = Request(prompt, params, lambda item: got.append(item.token if hasattr(item, "token") else item))
    return request, got


def test_generations_that_share_the_engines_kv_cache_are_not_interleaved(builtin):
    """A generate started inside the loop of another on the same engine wrote its keys over the first's, which then
    went on silently with other tokens: it is refused at its next step. A generation with its own KV cache runs
    between another's steps exactly as alone: its buffers are the model's for its own forwards only (a generation
    on the engine's cache started after it wrote into them)."""
    first, second = prompts_of(builtin, [7, 5])
    want_first, want_second = list(generate(builtin, first, 6)), list(generate(builtin, second, 6))
    outer = generate(builtin, first, 6)
    assert [next(outer) for _ in range(3)] == want_first[:3]
    assert list(generate(builtin, second, 6)) == want_second
    with pytest.raises(BadInput, match="another forward ran over the engine's KV cache"):
        next(outer)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    own = TextGeneration(builtin, first, params, own_kv=True)
    got = [own.step().token for _ in range(3)]
    assert list(generate(builtin, second, 6)) == want_second
    got += [out.token for out in own]
    assert got == want_first


@pytest.mark.parametrize("schedule", ["batch", "interleave"])
def test_concurrent_greedy_requests_equal_their_serial_runs(builtin, schedule):
    """More requests than max_active, of different lengths, so the batch changes as requests end and others are
    admitted; one seeded sampled request; one request cancelled midway."""
    prompts = prompts_of(builtin, [5, 1, 12, 3, 8, 2])
    lengths = [6, 11, 3, 9, 5, 7]
    want = [list(generate(builtin, p, n)) for p, n in zip(prompts, lengths)]
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
    alone = TextGeneration(builtin, prompts[0], sampled)
    want_sampled = [out.token for out in alone]
    jobs = [collecting(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    jobs.append(collecting(prompts[0], sampled))
    victim, victim_got = collecting(prompts[2], SamplingParams(max_tokens=40, ignore_eos=True))
    victim.emit = lambda item, emit=victim.emit: (emit(item), len(victim_got) == 2 and victim.cancel())
    started, ended, overlap = set(), set(), []  # requests with a first token, and ended ones, at each emit

    def watched(i, emit):
        def out(item):
            emit(item)
            (ended if item is None else started).add(i)
            overlap.append(len(started - ended))
        return out
    requests = [r for r, _ in jobs] + [victim]
    for i, r in enumerate(requests):
        r.emit = watched(i, r.emit)
    run_requests(builtin, SchedulerConfig(schedule=schedule, max_active=4), requests)
    assert max(overlap) > 1  # requests were decoding at the same time, not one after another
    for (_, got), ids in zip(jobs, want + [want_sampled]):
        assert got == ids + [None]
    assert victim_got[-1] is None and 2 <= len(victim_got) - 1 < 40


def test_failed_fetch_in_a_batch_ends_its_requests_and_the_scheduler_goes_on(tmp_path, builtin):
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold", max_seq=128))
    blob = tmp_path / "experts.bin"
    original = blob.read_bytes()
    prompts = prompts_of(engine, [4, 6, 3])
    want = [list(generate(builtin, p, 6)) for p in prompts]
    # the prompts prefill (one round) while the store is whole; it fails once they decode as a batch
    jobs = [collecting(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    firsts = []

    def first_token(item, emit, got) -> None:
        emit(item)
        if len(got) == 1:
            firsts.append(item)
            if len(firsts) == len(jobs):  # on the worker thread, before the next round
                os.truncate(blob, len(original) // 2)  # the later layers' experts now read short
    for request, got in jobs:
        request.emit = lambda item, emit=request.emit, got=got: first_token(item, emit, got)
    run_requests(engine, SchedulerConfig(schedule="batch", max_active=4), [r for r, _ in jobs])
    for _, got in jobs:
        assert isinstance(got[-2], Exception) and "short read" in str(got[-2])
    blob.write_bytes(original)
    jobs = [collecting(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    run_requests(engine, SchedulerConfig(schedule="batch"), [r for r, _ in jobs])
    assert [got for _, got in jobs] == [ids + [None] for ids in want]
    engine.close()


@pytest.mark.parametrize("shots", [1, 2])
def test_a_failed_batch_step_retries_each_request_alone_and_the_others_go_on_exactly(tmp_path, builtin, shots):
    """A fetch fails in the batched decode step: each request retries its step alone. With one failure every
    retry succeeds and every request ends with exactly its serial tokens; with a second failure (the first
    retried request's fetch) only that request ends with the error, the others with exactly their tokens."""
    engine = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold", max_seq=128,
                                       cache=CacheConfig(io="threads")))
    prompts = prompts_of(engine, [4, 6, 3])
    want = [list(generate(builtin, p, 6)) for p in prompts]
    transfers, real = engine.cache.transfers, engine.cache.transfers._copy
    armed, failures, repairs = [False], [], []
    clear = engine.cache.clear

    def cleared():  # the scheduler empties the cache after a failed fetch (repair_cache), before the retries
        repairs.append(len(failures))
        clear()
    engine.cache.clear = cleared

    def copy(t):
        # the first fetch of the batched step fails; with two shots also the first one after the repair
        if armed[0] and t.kind == "fetch" and len(failures) < shots and len(failures) == len(set(repairs)):
            failures.append((t.layer, t.expert))
            raise FetchError(f"expert {t.expert} of layer {t.layer}: injected")
        return real(t)
    transfers._copy = copy
    jobs = [collecting(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    firsts = []

    def first_token(item, emit, got) -> None:
        emit(item)
        if len(got) == 1:
            firsts.append(item)
            if len(firsts) == len(jobs):  # every prompt prefilled: the next round is a batched step
                armed[0], repairs[:] = True, []
    for request, got in jobs:
        request.emit = lambda item, emit=request.emit, got=got: first_token(item, emit, got)
    run_requests(engine, SchedulerConfig(schedule="batch", max_active=4), [r for r, _ in jobs])
    assert len(failures) == shots
    failed = [i for i, (_, got) in enumerate(jobs) if any(isinstance(x, Exception) for x in got)]
    assert len(failed) == shots - 1
    for i, (_, got) in enumerate(jobs):
        if i in failed:
            assert isinstance(got[-2], FetchError) and "injected" in str(got[-2]) and got[-1] is None
        else:
            assert got == want[i] + [None]
    engine.close()


def test_a_substituting_policys_outputs_depend_on_the_schedule():
    """The other side of schedule independence: under a policy that substitutes, each request computes with the
    experts the cache holds when its step runs, and the schedule decides what that is; the same requests from
    the same cold cache then give other greedy tokens batched than one after another (docs/server.md)."""
    engine = Engine(None, EngineConfig(store="ram", max_seq=256, policy="quality-first", initial="cold",
                                       cache=CacheConfig(fraction=0.1)))
    prompts = prompts_of(engine, [5, 9, 3, 7])
    outputs = {}
    for schedule in ("serial", "batch"):
        engine.reset()
        jobs = [collecting(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        run_requests(engine, SchedulerConfig(schedule=schedule, max_active=4), [r for r, _ in jobs])
        outputs[schedule] = [got for _, got in jobs]
    engine.close()
    assert all(len(o) == 13 for o in outputs["batch"])  # 12 tokens, then the end
    assert outputs["batch"] != outputs["serial"]
