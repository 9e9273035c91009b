"""The fast tier's slot formats: 16-bit slots (fp16, bf16) give the logits of fp32 slots holding
the same values, a fetch into them equals the ram emulation of the store's format, and they hold
twice the experts in the same bytes; quantized slots (int8, int4, MXFP4) keep the disk store's encoded
blobs and compute what dequantised fp32 slots compute, to the rounding of their int8 activations."""
import numpy as np
import pytest
import torch

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from expertcache.engine.experts import CompiledExperts, ExpertKind, experts_grouped
from expertcache.engine.quant import (
    ExpertFormat,
    decode_into,
    decode_plan,
    encode,
    encoded_bytes,
    quantize,
    unpack_lanes,
)
from expertcache.engine.stores import ExpertShape
from expertcache.kernel.linear import activation_work, linear_token
from expertcache.errors import BadInput

PROMPT = [3, 17, 5, 9, 30, 2, 11, 7, 4, 21, 8, 13]


def logits_of(engine: Engine, decode: int = 4) -> torch.Tensor:
    """A prompt's window logits, then `decode` greedy tokens one at a time (the compiled decode path)."""
    ids = torch.tensor(PROMPT)
    rows = [engine.forward(ids, 0)]
    for i in range(decode):
        nxt = rows[-1][-1:].argmax(-1)
        rows.append(engine.forward(nxt, len(PROMPT) + i))
    return torch.cat(rows)


def engine(path, **kw) -> Engine:
    return Engine(path, EngineConfig(cache=CacheConfig(fraction=0.5), initial="cold", **kw))


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("store_dtype,slot", [("fp16", "fp16"), ("bf16", "bf16"), ("int8", "fp16"), ("int4", "bf16")])
def test_16_bit_slots_equal_the_ram_emulation(tiny, tmp_path, family, store_dtype, slot):
    """A tiny fp32 checkpoint stored as fp16/bf16/int8/int4 on disk and fetched into 16-bit slots gives
    the logits of the ram store emulating that format into the same slot dtype, bit for bit (a
    quantized fetch rounds the fp32 dequantised value once to the slot's dtype, as the emulation's
    copy does); auto keeps an fp16 or bf16 store's dtype."""
    path = tiny[family][0]
    fmt = ExpertFormat.parse(store_dtype, 16)
    disk = engine(path, store="disk", store_dir=tmp_path, store_format=fmt, slot_dtype=slot)
    ram = engine(path, store="ram", store_format=fmt, slot_dtype=slot)
    assert disk.cache.w13.dtype == ram.cache.w13.dtype == getattr(torch, {"fp16": "float16"}.get(slot, "bfloat16"))
    got, want = logits_of(disk), logits_of(ram)
    assert disk.stats.sync_fetches > 0 and torch.equal(got, want)
    if not fmt.quantized:
        assert engine(path, store="disk", store_dir=tmp_path, store_format=fmt).cache.w13.dtype == disk.cache.w13.dtype
    assert engine(path, store="ram").cache.w13.dtype == torch.float32  # an fp32 checkpoint: fp32 slots


def test_builtin_fp16_slots_equal_fp32_slots_and_hold_twice_the_experts(tmp_path):
    """The built-in model's fp16 experts widen exactly: its auto (fp16) slots give fp32 slots' logits,
    from the ram store and from the disk store (whose whole-page parts are read straight into the
    slot rows); at equal cache bytes fp16 slots hold twice the experts, and the budget counts them."""
    fp32 = Engine(None, EngineConfig(store="ram", slot_dtype="fp32"))
    fp16 = Engine(None, EngineConfig(store="ram"))
    assert fp16.cache.w13.dtype == torch.float16 and fp16.budget()["slot_dtype"] == "fp16"
    assert fp16.budget()["cache_bytes"] * 2 == fp32.budget()["cache_bytes"]
    want = logits_of(fp32)
    torch.testing.assert_close(logits_of(fp16), want, atol=1e-5, rtol=1e-5)
    disk = Engine(None, EngineConfig(store="disk", store_dir=tmp_path, initial="cold"))
    assert disk.cache.w13.dtype == torch.float16 and disk.store.direct_parts
    assert disk.cache.w13.data_ptr() % 4096 == 0
    torch.testing.assert_close(logits_of(disk), want, atol=1e-5, rtol=1e-5)
    assert disk.stats.sync_fetches > 0
    size = fp32.cache.bytes
    big = Engine(None, EngineConfig(store="ram", cache=CacheConfig(bytes=size)))
    assert big.cache.per_layer == 2 * fp32.cache.per_layer and big.cache.bytes == size
    budget = 120 * 2**20  # about 15 MiB left for expert slots at max_seq 2048
    per = {d: Engine(None, EngineConfig(store="ram", slot_dtype=d, memory_budget=budget)).budget()[
        "slots_per_layer_long_pass"] for d in ("fp32", "fp16")}  # a decode's: every expert, in both
    assert per["fp16"] >= 2 * per["fp32"] - 1


def random_blobs(fmt: ExpertFormat, parts, S: int, g: torch.Generator) -> torch.Tensor:
    n = encoded_bytes(parts, fmt)
    blobs = torch.zeros(S, n, dtype=torch.uint8)
    for s in range(S):
        tensors = [torch.randn(p, generator=g) * 0.2 for p in parts]
        blobs[s] = torch.frombuffer(bytearray(encode(tensors, parts, fmt, n)), dtype=torch.uint8)
    return blobs


def int8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [n] as the quantized kernels see it: each group of `group` values rounded to int8 steps of max|x| / 127."""
    n = x.shape[0]
    g = torch.nn.functional.pad(x, (0, -n % group)).view(-1, group)
    step = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(step == 0, 1.0, step)) * step).view(-1)[:n]


FORMATS = [("int8", 16, "asym"), ("int8", 8, "sym"), ("int4", 32, "asym"), ("int4", 16, "sym"), ("mxfp4", 32, "")]


@pytest.mark.parametrize("dtype,group,scheme", FORMATS)
@pytest.mark.parametrize("rows,cols", [(40, 64), (16, 40), (3, 96)])
def test_quantized_product_is_the_dequantised_one_over_int8_activations(dtype, group, scheme, rows, cols):
    """One quantized matrix times one vector (kernel.linear over the packed codes) is the dequantised matrix
    times the vector's int8 rounding, to fp32 rounding: for asymmetric codes, their centred part meets the
    rounded vector and the rest (minimum plus the centre's worth of scale) the exact one. Rows that do not
    fill a block of 16, columns that do not fill a group."""
    g = torch.Generator().manual_seed(7)
    fmt = ExpertFormat.parse(dtype, group, scheme or "asym")
    w = torch.randn(rows, cols, generator=g) * 0.3
    parts = [(rows, cols)]
    buf = np.frombuffer(encode([w], parts, fmt, encoded_bytes(parts, fmt)), np.uint8).copy()
    row = decode_plan(parts, fmt)[0]
    deq = torch.empty(rows, cols)
    decode_into(torch.from_numpy(buf), parts, fmt, [deq])
    x = torch.randn(cols, generator=g)
    out = np.zeros(rows, np.float32)
    linear_token(buf, row, x.numpy(), activation_work(1, cols, row), out, 1)
    xr = int8_activations(x, fmt.group_size)
    exact_part = torch.zeros(rows, cols)  # what meets the exact vector: asymmetric codes' minimum + centre
    if fmt.scheme == "asym" and not fmt.mx:
        q = quantize(w, fmt)
        centre = 2 ** (fmt.bits - 1)
        per_group = unpack_lanes(q["mins"], rows).float() + centre * unpack_lanes(q["scales"], rows).float()
        exact_part = per_group.repeat_interleave(fmt.group_size, 1)[:, :cols]
    want = (deq - exact_part).double() @ xr.double() + exact_part.double() @ x.double()
    torch.testing.assert_close(torch.from_numpy(out).double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(torch.from_numpy(out).double(), deq.double() @ x.double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,group,scheme", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("H", [40, 64])
def test_quantized_experts_equal_dequantised_ones_to_activation_rounding(dtype, group, scheme, bias, H):
    """A decode token's and a window's experts over quantized slots compute what fp32 slots holding the
    dequantised weights compute, within the rounding of their int8 activations (a percent of the output's
    scale here); the two calls agree with each other to fp32 rounding, and on both threads as on one."""
    g = torch.Generator().manual_seed(2)
    S, F, k = 5, 32, 3
    shape = ExpertShape(1, S, (2 * F, H), (H, F), bias)
    fmt = ExpertFormat.parse(dtype, group, scheme or "asym")
    kind = ExpertKind(bias, 7.0 if bias else None)
    blobs = random_blobs(fmt, shape.parts, S, g)
    quantized = CompiledExperts.of_blobs(blobs, decode_plan(shape.parts, fmt), kind)
    deq = [torch.empty(S, *p) for p in shape.parts]
    for s in range(S):
        decode_into(blobs[s], shape.parts, fmt, [d[s] for d in deq])
    ref = CompiledExperts.of_floats(*deq, *([None, None] if not bias else []), kind)
    xs = torch.randn(6, H, generator=g)
    ids = torch.randint(0, S, (6, k), generator=g)
    w = torch.rand(6, k, generator=g)
    want = experts_grouped(xs, ids, w, *deq, *([None, None] if not bias else []), kind)
    window = quantized.window(xs, ids.numpy(), w.numpy())
    tokens = torch.cat([quantized(xs[t:t + 1], ids[t].numpy(), w[t].numpy()) for t in range(6)])
    torch.testing.assert_close(window, tokens, atol=1e-5, rtol=1e-5)
    scale = want.abs().max()
    assert (window - want).abs().max() < 0.03 * scale
    torch.testing.assert_close(torch.cat([ref(xs[t:t + 1], ids[t].numpy(), w[t].numpy()) for t in range(6)]), want,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_slots_equal_dequantised_fp32_slots(tiny, tmp_path, family, dtype):
    """An engine whose slots keep the disk store's int8/int4 blobs gives the logits of fp32 slots
    filled from the same store (windows and decode) to the rounding of its int8 activations, and its slots
    take the encoded bytes only."""
    path = tiny[family][0]
    fmt = ExpertFormat.parse(dtype, 16)
    q = engine(path, store="disk", store_dir=tmp_path, store_format=fmt, slot_dtype=dtype)
    f = engine(path, store="disk", store_dir=tmp_path, store_format=fmt, slot_dtype="fp32")
    assert q.cache.w13 is None and q.cache.blobs.shape[1] == encoded_bytes(q.store.shape.parts, fmt)
    assert q.cache.expert_bytes < f.cache.expert_bytes / 3 and q.budget()["slot_dtype"] == fmt.tag
    got, want = logits_of(q), logits_of(f)
    assert (got - want).abs().max() < 0.02 * want.abs().max() and not torch.equal(got, want)
    assert q.stats.sync_fetches == f.stats.sync_fetches > 0
    with pytest.raises(BadInput, match="cannot take them"):  # lowbit copies need float slots
        q.set_policy("lowbit:tau=0.15")


@pytest.mark.parametrize("family, dtype", [("qwen2_moe", "int4"), ("gpt_oss", "int8")])
def test_quantized_slots_from_the_ram_store_equal_the_disk_stores(tiny, tmp_path, family, dtype):
    """The ram store of an int8/int4 format encodes the blobs the disk store of that format holds:
    quantized slots filled from either give the same logits, fetch for fetch."""
    path, fmt = tiny[family][0], ExpertFormat.parse(dtype, 16)
    ram = engine(path, store="ram", store_format=fmt, slot_dtype=dtype)
    disk = engine(path, store="disk", store_dir=tmp_path, store_format=fmt, slot_dtype=dtype)
    assert ram.cache.blobs.shape == disk.cache.blobs.shape
    assert torch.equal(logits_of(ram), logits_of(disk))
    assert ram.stats.sync_fetches == disk.stats.sync_fetches > 0
    assert ram.stats.sync_fetch_bytes == ram.stats.sync_fetches * encoded_bytes(ram.store.shape.parts, fmt)
    ram.close()
    disk.close()


def test_batched_decode_over_quantized_slots(tiny, tmp_path):
    """A decode batch runs its tokens through the quantized slots' compiled call, one per token: the
    logits of one forward per sequence."""
    from test_batching import check_batched_logits
    e = Engine(tiny["gpt_oss"][0], EngineConfig(store="disk", store_dir=tmp_path, initial="cold", max_seq=64,
                                                store_format=ExpertFormat.parse("int4", 16), slot_dtype="int4"))
    check_batched_logits(e, [2, 6, 11], steps=3)
    assert e.stats.sync_fetches > 0
    e.close()


def test_quantized_slots_refuse_another_store_format(tiny, tmp_path, capsys):
    """int8 slots copy int8 blobs: a store in another format, or a CUDA device, is refused with the
    fix in one line."""
    path = tiny["qwen2_moe"][0]
    with pytest.raises(BadInput, match="add --store-dtype int8"):
        engine(path, store="disk", store_dir=tmp_path / "fp32", slot_dtype="int8")
    with pytest.raises(BadInput, match="add --store-dtype int8"):
        engine(path, store="ram", slot_dtype="int8")
    code = cli.main(["ppl", "--model", str(path), "--text", __file__, "--store", "disk", "--store-dir",
                     str(tmp_path / "int4"), "--store-dtype", "int4", "--slot-dtype", "int8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "--store-dtype int8" in err, err
    with pytest.raises(SystemExit):
        cli.main(["ppl", "--model", str(path), "--slot-dtype", "fp8"])


def _dot_kernel(isa: str, small: bool):
    """A compiled call of kernel.simd._dot_u8s8 on one 64-byte vector of codes and of activations, built for `isa`."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from expertcache.kernel import simd

    @intrinsic
    def dot(typingctx, codes, x, out):
        def codegen(context, builder, signature, args):
            codes_p, x_p, out_p = (context.make_array(t)(context, builder, v).data
                                   for t, v in zip(signature.args, args))
            load = lambda p: builder.load(builder.bitcast(p, simd.V64I8.as_pointer()), align=1)  # noqa: E731
            acc = simd._dot_u8s8(builder, builder.module, isa, ir.Constant(simd.V16I32, [0] * 16), load(codes_p),
                                 load(x_p), small)
            builder.store(acc, builder.bitcast(out_p, simd.V16I32.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.void(codes, x, out), codegen

    @njit
    def run(codes, x, out):
        dot(codes, x, out)
    return run


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512bw", "avx512-vnni"])
@pytest.mark.parametrize("small", [False, True])
def test_each_dot_product_path_sums_each_lanes_own_four_products(isa, small):
    """Every integer dot-product path this CPU can run (the portable one always) gives lane i the sum of codes
    4i..4i+3 times their activations, for 8-bit codes and for codes below 128: no lane takes another row's.
    Without VNNI, 8-bit codes are centred (code - 128) so that VPMADDUBSW's pair sums cannot saturate, for
    activations in [-127, 127] as they are quantized; the extremes are among the codes and activations."""
    from expertcache.kernel.simd import INT8, ISA, centres_codes
    order = ["generic", "avx2", "avx512bw", "avx512-vnni"]  # each CPU runs its own path and those before it
    if order.index(isa) > order.index(ISA):
        pytest.skip(f"this CPU runs {ISA}")
    centred = not small and centres_codes(isa, INT8)
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 128 if small else 256, 64).astype(np.uint8)
    x = rng.integers(-127 if centred else -128, 128, 64).astype(np.int8)
    top = 127 if small else 255
    codes[:8] = (0, 0, top, top, 0, top, 1, top)  # the largest pair sums of either sign, and a zero activation
    x[:8] = (127, 127, -127, -127, -127, 127, 0, 127)
    out = np.zeros(16, np.int32)
    _dot_kernel(isa, small)(codes, x, out)
    np.testing.assert_array_equal(out, ((codes.astype(np.int32) - 128 * centred) * x).reshape(16, 4).sum(1))


@pytest.mark.parametrize("tile", [(4, 4, 16), (4, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_each_float_tile_shape_gives_the_4_by_4_products(tile, dtype, monkeypatch):
    """A window's float tile (simd.ftile) as AVX-512 runs it and as two passes of 2 tokens in 8 lanes (AVX2):
    both are compiled here, whatever this CPU takes, and each gives the 4 rows x 4 tokens of products at their
    strides, columns past the last whole vector included (37 = 2 x 16 + 5 = 4 x 8 + 5)."""
    from numba import njit

    from expertcache.kernel import simd
    monkeypatch.setattr(simd, "FLOAT_TILE", tile)  # read as the intrinsic compiles

    @njit  # not cached: compiled anew under the tile above
    def run(w, stride, cols, x, out):
        simd.ftile(w, stride, stride, cols, x, 3, stride, out, 2, 6)

    g = torch.Generator().manual_seed(5)
    C, stride = 37, 40  # rows and tokens apart by more than their columns; the tile from row 1 of w, offset 3 of x
    w = torch.randn(5 * stride, generator=g).to(dtype)
    x = torch.randn(4 * stride + 3, generator=g)
    bits = {torch.float32: None, torch.float16: np.uint16, torch.bfloat16: np.int16}[dtype]
    w_np = w.numpy() if bits is None else w.view(torch.int16).numpy().view(bits)
    out = np.full(2 + 4 * 6, np.nan, np.float32)
    run(w_np, stride, C, x.numpy(), out)
    W = w.double()[stride:].reshape(4, stride)[:, :C]
    X = x.double()[3:].reshape(4, stride)[:, :C]
    want = np.full_like(out, np.nan)
    for t in range(4):
        want[2 + t * 6: 2 + t * 6 + 4] = (W @ X[t]).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,group,scheme", [("float32", 1, None), ("float16", 1, None), *FORMATS])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("parts", [1, 2])
def test_experts_run_as_they_land_sum_to_the_one_calls_output_bit_for_bit(dtype, group, scheme, bias, parts,
                                                                          monkeypatch):
    """A decode token's experts run in groups as their reads land (`some`, then `total`) give the output of the
    one call over all of them exactly, whatever the groups and their order: the same products over the same
    row ranges, summed in the plan's order, biases (GPT-OSS's) and quantized slots included."""
    from expertcache.engine import threads
    monkeypatch.setattr(threads, "parts", lambda nbytes: parts)
    g = torch.Generator().manual_seed(3)
    S, F, H = 6, 32, 64
    shape = ExpertShape(1, S, (2 * F, H), (H, F), bias)
    kind = ExpertKind(bias, 7.0 if bias else None)
    if group == 1:
        floats = [torch.randn(S, *p, generator=g).to(getattr(torch, dtype)) for p in shape.parts]
        experts = CompiledExperts.of_floats(*floats, *([None, None] if not bias else []), kind)
    else:
        fmt = ExpertFormat.parse(dtype, group, scheme or "asym")
        experts = CompiledExperts.of_blobs(random_blobs(fmt, shape.parts, S, g), decode_plan(shape.parts, fmt), kind)
    x = torch.randn(1, H, generator=g)
    slots, gates = np.array([4, 0, 5, 2]), np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    want = experts(x, slots, gates)
    for groups in ([[0, 1, 2, 3]], [[2], [0, 3], [1]], [[3], [2], [1], [0]]):
        for i, which in enumerate(groups):
            experts.some(x, slots, gates, np.array(which, np.int64), i == 0)
        assert torch.equal(experts.total(slots, gates), want), groups


@pytest.mark.parametrize("model, policy", [("builtin", "fetch-all"), ("builtin", "fetch-all+prefetch/quasi-hidden"),
                                           ("builtin", "quality-first"), ("builtin", "lowbit:tau=0.15"),
                                           ("qwen3_moe", "fetch-all+prefetch/router-ahead")])
def test_a_decode_tokens_experts_run_as_their_reads_land(tiny, tmp_path, monkeypatch, model, policy):
    """On the disk store a decode token whose reads are in flight runs its resident experts before its first
    wait and each read one after its wait (here with the size at which that starts lowered to the models'
    small experts); the logits are those of the one call after the last wait, bit for bit, under prefetches,
    admissions and low-precision copies too. In a cache of few slots (the tiny model's) a load can be logged
    after a wait, into a slot that is the kernel's already but still holds the expert it replaces: run at that
    wait, it gave that expert's output."""
    from expertcache.engine.experts import CompiledExperts as Compiled
    from expertcache.lab.bench import parse_variant
    calls = []
    some = Compiled.some
    monkeypatch.setattr(Compiled, "some", lambda self, x, s, g, which, *rest: calls.append(len(which)) or
                        some(self, x, s, g, which, *rest))
    monkeypatch.setattr(Compiled, "one_by_one", property(lambda self: True))
    path, fraction = (BUILTIN_MODEL, 0.125) if model == "builtin" else (tiny[model][0], 0.25)
    ids = torch.arange(5, 40) if model == "builtin" else \
        torch.randint(0, 96, (96,), generator=torch.Generator().manual_seed(6))
    rule, prefetch = parse_variant(policy)
    top_k = []

    def decode(as_landed: bool) -> torch.Tensor:
        e = Engine(path, EngineConfig(store="disk", store_dir=tmp_path, cache=CacheConfig(fraction=fraction),
                                      policy=rule, prefetch=prefetch))
        e.runner.as_landed = as_landed
        out = torch.cat([e.forward(ids[:8], 0, last=True)] +
                        [e.forward(ids[p:p + 1], p, last=True) for p in range(8, len(ids))])
        assert e.stats.sync_fetches + e.stats.lowbit_fetches > 0
        top_k.append(e.args.top_k)
        e.close()
        return out
    want = decode(False)
    assert not calls
    assert torch.equal(decode(True), want)
    assert len(calls) > len(ids) - 8 and 0 < min(calls) < top_k[0]  # some tokens' experts in groups


@pytest.mark.parametrize("model, policy", [("builtin", "fetch-all"), ("builtin", "quality-first"),
                                           ("qwen3_moe", "fetch-all")])
def test_a_decode_batchs_experts_run_as_their_reads_land(tiny, tmp_path, monkeypatch, model, policy):
    """A decode batch (the server's sequences, one forward a step) runs each token's experts as their reads land,
    each token's in its own scratch: every sequence's logits are those of the calls after the last wait, bit
    for bit, in caches where the batch's tokens share slots and evict each other's experts (flushes)."""
    from expertcache.engine.experts import CompiledExperts as Compiled
    from expertcache.engine.generate import TextGeneration, batch_logits
    from expertcache.engine.sampling import SamplingParams
    tokens = []
    some = Compiled.some
    monkeypatch.setattr(Compiled, "some", lambda self, x, s, g, which, first, token=0: tokens.append(token) or
                        some(self, x, s, g, which, first, token))
    monkeypatch.setattr(Compiled, "one_by_one", property(lambda self: True))
    path, fraction = (BUILTIN_MODEL, 0.125) if model == "builtin" else (tiny[model][0], 0.5)
    ids = torch.randint(5, 90, (160,), generator=torch.Generator().manual_seed(8)).tolist()

    def decode(as_landed: bool) -> list[torch.Tensor]:
        e = Engine(path, EngineConfig(store="disk", store_dir=tmp_path, cache=CacheConfig(fraction=fraction),
                                      policy=policy))
        e.runner.as_landed = as_landed
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        gens = [TextGeneration(e, ids[40 * b:40 * b + 6 + 3 * b], params, own_kv=True) for b in range(4)]
        for g in gens:
            g.step()
        rows = []
        for _ in range(12):
            step = batch_logits(e, gens)
            rows.append(step.clone())
            for g, row in zip(gens, step):
                g.advance(row)
        assert e.stats.sync_fetches > 0
        e.close()
        return rows
    want = decode(False)
    assert not tokens
    got = decode(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert max(tokens) == 3  # every token of the batch ran in its own scratch
