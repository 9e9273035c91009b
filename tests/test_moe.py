"""The expert kernels against a plain per-token reference, and the deferred compute of a
window when later tokens evict slots that earlier tokens used."""
import numpy as np
import pytest
import torch

from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.experts import SWIGLU, CompiledExperts, experts_grouped, experts_one_token
from expertcache.engine.perplexity import EVAL_TEXT


def reference(x, slots, weights, w13, w2):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s, w in zip(slots[t].tolist(), weights[t].tolist()):
            g, u = (w13[s] @ x[t]).chunk(2)
            out[t] += w * (w2[s] @ (torch.nn.functional.silu(g) * u))
    return out


def test_kernels_match_reference():
    g = torch.Generator().manual_seed(0)
    S, F, H, T, k = 6, 8, 16, 9, 3
    w13, w2 = torch.randn(S, 2 * F, H, generator=g), torch.randn(S, H, F, generator=g)
    x = torch.randn(T, H, generator=g)
    slots = torch.randint(0, S, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g)
    ref = reference(x, slots, weights, w13, w2)
    for t in range(T):
        one = experts_one_token(x[t:t + 1], slots[t:t + 1], weights[t:t + 1], w13, w2)
        torch.testing.assert_close(one, ref[t:t + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_grouped(x, slots, weights, w13, w2), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H", [16, 17])
def test_compiled_kernel_reads_16_bit_slots_exactly(H):
    """Slots kept as fp16 or bf16 give the compiled kernel the same result as their fp32 values
    (H=17: an odd number of down rows, which the kernel takes in pairs)."""
    g = torch.Generator().manual_seed(1)
    S, F = 5, 8
    x = torch.randn(1, H, generator=g)
    slots, gates = np.array([4, 0, 2]), np.array([0.5, 0.3, 0.2], np.float32)
    for dtype in (torch.float16, torch.bfloat16):
        w13, w2 = (torch.randn(S, *shape, generator=g).to(dtype) for shape in ((2 * F, H), (H, F)))
        ref = reference(x, torch.from_numpy(slots)[None], torch.from_numpy(gates)[None], w13.float(), w2.float())
        out = CompiledExperts.of_floats(w13, w2, None, None, SWIGLU)(x, slots, gates)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        fp32 = CompiledExperts.of_floats(w13.float(), w2.float(), None, None, SWIGLU)(x, slots, gates)
        assert torch.equal(out, fp32)  # the same products in the same order: widening is exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T, k", [(9, 3), (600, 2), (7, 1)])
def test_compiled_window_matches_reference(dtype, T, k):
    """A window's compiled call equals the per-token reference over fp32 and 16-bit slots: odd sizes
    (rows that do not fill a block of four), a slot taken twice by one token (as padding is), and a slot
    with more rows than one pass holds (T=600)."""
    from expertcache.kernel.expert_compute import PASS
    g = torch.Generator().manual_seed(2)
    S, F, H = 6, 8, 17
    w13, w2 = (torch.randn(S, *shape, generator=g).to(dtype) for shape in ((2 * F, H), (H, F)))
    x = torch.randn(T, H, generator=g)
    slots = torch.randint(0, S, (T, k), generator=g)
    slots[:, 0] = 1  # in every token: more than a pass's rows when T is
    slots[0] = 1  # in every place of the first token
    weights = torch.rand(T, k, generator=g)
    assert T < PASS or torch.bincount(slots.ravel())[1] > PASS
    ref = reference(x, slots, weights, w13.float(), w2.float())
    out = CompiledExperts.of_floats(w13, w2, None, None, SWIGLU).window(x, slots.numpy(), weights.numpy())
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


def test_a_prefill_computes_the_last_positions_logits_only(tiny):
    path, _ = tiny["olmoe"]
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=1.0)))
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(5))
    full = engine.forward(ids, 0)
    engine.reset()
    last = engine.forward(ids, 0, last=True)
    assert last.shape == (1, full.shape[1])
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flush_rows", [0, 1000])
def test_window_equals_token_by_token_under_eviction(tiny, monkeypatch, flush_rows):
    """A 64-token window through 2 slots per layer (constant eviction) equals the full model, each slot's
    work run before it changes hands through grouped calls (0) or decode's compiled kernel (1000)."""
    from expertcache.engine import moe
    monkeypatch.setattr(moe, "FLUSH_ROWS", flush_rows)
    path, hf = tiny["olmoe"]
    ids = torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(3))
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold"))
    assert engine.cache.per_layer == 2
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(engine.forward(ids, 0), ref, atol=1e-4, rtol=0)
    # the decode order is respected: each token's misses were fetched, none served from the future
    assert engine.stats.sync_fetches == engine.stats.misses > 64


def test_a_prompts_reads_ahead_of_their_experts_count_as_its_fetches():
    """Where the slots hold two groups of k, a prompt reads the next group's missing experts under this group's
    compute: they counted as prefetches, and the fetches a token and their bytes left them out."""
    from expertcache.engine.generate import prefill
    engine = Engine(None, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold", max_seq=128))
    assert engine.cache.per_layer >= 2 * engine.args.top_k
    prefill(engine, engine.encode(EVAL_TEXT.read_text()[:2000])[:96])
    stats = engine.stats
    assert stats.prefetch_fetches == stats.exposed_prefetches == stats.predictions == 0
    assert stats.sync_fetches > 2 * engine.args.num_moe_layers * engine.args.top_k
    assert stats.sync_fetch_bytes == stats.sync_fetches * engine.cache.fetch_bytes
    engine.close()


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_a_prompt_runs_expert_by_expert_exactly_reading_each_missing_expert_once(tiny, family):
    """A prompt's prefill through a quarter of the experts (prompt_order experts, the default) gives the full
    model's logits whatever the policy, reading each missing expert once a layer; decided token by token, a
    substituting policy changes its logits, and fetching every miss reads an expert again each time it was
    evicted."""
    from expertcache.engine.generate import prefill
    path, hf = tiny[family]
    ids = torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    runs = {}
    for order, policy in (("experts", "substitute-all"), ("tokens", "substitute-all"), ("tokens", "fetch-all")):
        engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold", prompt_order=order,
                                           policy=policy))
        runs[order, policy] = prefill(engine, ids.tolist()), engine.stats
        a = engine.args
        engine.close()
    by_expert, stats = runs["experts", "substitute-all"]
    torch.testing.assert_close(by_expert, ref, atol=1e-4, rtol=0)
    by_token, token_stats = runs["tokens", "substitute-all"]
    routed = 64 * a.top_k * a.num_moe_layers
    assert stats.substitutions == 0 and stats.routed == routed == stats.hits + stats.misses
    assert stats.sync_fetches <= a.num_moe_layers * a.num_experts
    if family == "olmoe":  # its routes spread over the experts: token order substitutes, and reads experts again
        assert (by_token - ref).abs().max() > 1e-3 and token_stats.substitutions
        assert runs["tokens", "fetch-all"][1].sync_fetches > a.num_moe_layers * a.num_experts
        # a prefill policy of its own (prefill protection) decides the prompt as asked, token by token
        from expertcache.policies import make_policy
        engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25), initial="cold"))
        prefill(engine, ids.tolist(), make_policy("substitute-all"))
        assert engine.stats.substitutions > 0
        engine.close()
