"""SIMD micro-kernels written in LLVM IR, callable from numba code: the inner loops that decide
whether a token streams its weights at the memory's speed. numba's own loops vectorise dot
products of floats, but not integer dot products with per-group scales, so these are spelled out
with the CPU's instructions, chosen once for the CPU numba compiles for (`ISA`):

- `avx512-vnni`: VPDPBUSD, 64 unsigned-byte x signed-byte products a 512-bit instruction;
- `avx512bw` and `avx2`: VPMADDUBSW then VPMADDWD, the same products in two steps (512 or 256 bits);
- `generic`: LLVM's portable partial reductions (any CPU, e.g. arm64 with its dot-product unit).

`qblock` multiplies one block of 16 rows of a packed quantized matrix (`quant.py`'s row-block
layout: each 64-byte vector holds 16 rows x 4 columns of int8 codes, or 16 rows x 8 columns of
4-bit codes, low nibbles the first 4) with 1 or 4 tokens' activations quantized to int8 per group
(`kernel.matvec.quantize_activations`), without dequantising a weight: per group, the integer dot
product of codes and activations, then the group's weight scale times the activations' scale,
and the minimum times the activations' sum. `fdot4` is a float matrix's 4-row dot product with
one fp32 vector, its weights in fp32, fp16 or bf16 widened in registers.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

ROWS = 16  # rows of one packed block: the 32-bit lanes of a 512-bit vector
VEC = 64  # bytes of one packed code vector
# software prefetches of the weights go to L2, not L1 (llvm.prefetch locality 2): a token's quantized experts streamed
# 8-12% faster from memory on two threads here, float rows ~2%
PREFETCH_LOCALITY = 2

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


V64I8, V16I32, V16F32, V16I16, V16I8, V32I16 = (_vec(I8, 64), _vec(I32, 16), _vec(F32, 16), _vec(I16, 16),
                                                _vec(I8, 16), _vec(I16, 32))


def _features() -> set[str]:
    """The CPU features numba compiles for (its NUMBA_CPU_FEATURES when set, else the host's)."""
    return {f[1:] for f in get_host_cpu_features().split(",") if f.startswith("+")}


def isa_of(features: set[str]) -> str:
    """The integer dot-product path for a CPU with `features` (see the module's docstring)."""
    if {"avx512vnni", "avx512bw", "avx512f"} <= features:
        return "avx512-vnni"
    if {"avx512bw", "avx512f"} <= features:
        return "avx512bw"
    if "avx2" in features:
        return "avx2"
    return "generic"


ISA = isa_of(_features())

# codes of each encoding (ENCODING values of kernel.decode_blob, which this module must not import: numba
# caches a kernel per version of this folder's sources, and the encodings are part of the layout)
INT8, INT4, MXFP4 = 3, 4, 5
# MXFP4: the FP4 codes as unsigned bytes 12 + 2 * value (0..24), so that one unsigned x signed product serves;
# the offset's contribution, 12 * sum(xq), comes off per group
MX_BYTES = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)
MX_OFFSET = 12


def _const_vec(t, n, value):
    return ir.Constant(_vec(t, n), [value] * n)


def _broadcast(b: ir.IRBuilder, value, n):
    """A vector of n copies of a scalar."""
    vt = _vec(value.type, n)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(_vec(I32, n), [0] * n))


def _intrinsic_fn(module, name, ret, args):
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


def _halves(b, v, n):
    """The two halves of vector v of n lanes."""
    lo = b.shuffle_vector(v, v, ir.Constant(_vec(I32, n // 2), list(range(n // 2))))
    hi = b.shuffle_vector(v, v, ir.Constant(_vec(I32, n // 2), list(range(n // 2, n))))
    return lo, hi


def _join(b, lo, hi, n):
    return b.shuffle_vector(lo, hi, ir.Constant(_vec(I32, n), list(range(n))))


def _dot_u8s8(b: ir.IRBuilder, module, isa: str, acc, codes, x, small: bool):
    """acc <16 x i32> + the sums of each 32-bit lane's four unsigned codes (<64 x i8>) times the four
    signed bytes of x (<64 x i8>) beside them. `small`: every code is below 128 (4-bit codes), so that
    VPMADDUBSW's 16-bit pair sums cannot saturate; 8-bit codes on such a CPU are centred instead
    (`centres_codes`: the lanes then hold (code - 128) x x)."""
    if isa == "avx512-vnni":
        fn = _intrinsic_fn(module, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
        return b.call(fn, [acc, b.bitcast(codes, V16I32), b.bitcast(x, V16I32)])
    if small and isa == "avx512bw":
        mad = _intrinsic_fn(module, "llvm.x86.avx512.pmaddubs.w.512", V32I16, [V64I8, V64I8])
        wd = _intrinsic_fn(module, "llvm.x86.avx512.pmaddw.d.512", V16I32, [V32I16, V32I16])
        return b.add(acc, b.call(wd, [b.call(mad, [codes, x]), _const_vec(I16, 32, 1)]))
    if small and isa == "avx2":
        return _madd_avx2(b, module, acc, zip(_halves(b, codes, 64), _halves(b, x, 64)))
    if not small and centres_codes(isa, INT8):
        return _dot_centred_avx2(b, module, acc, codes, x)
    # the portable form: each lane adds its own four products. (llvm.vector.partial.reduce.add defines only the
    # whole vector's sum, not which products meet in which lane: on an AVX2 target it put other rows' products
    # in a row's lane)
    prod = b.mul(b.zext(codes, _vec(I32, 64)), b.sext(x, _vec(I32, 64)))
    for j in range(4):
        acc = b.add(acc, b.shuffle_vector(prod, prod, ir.Constant(_vec(I32, 16), [4 * i + j for i in range(16)])))
    return acc


def centres_codes(isa: str, encoding: int) -> bool:
    """Whether `_dot_u8s8` sums (code - 128) x activation for this encoding on this ISA, not code x activation:
    8-bit codes without VNNI, whose unsigned products VPMADDUBSW's 16-bit pair sums would saturate."""
    return encoding == INT8 and isa in ("avx512bw", "avx2")


def _madd_avx2(b: ir.IRBuilder, module, acc, halves):
    """acc <16 x i32> + AVX2's VPMADDUBSW then VPMADDWD of two (unsigned bytes, signed bytes) pairs of 256-bit
    halves: each 32-bit lane the sum of its four products."""
    mad = _intrinsic_fn(module, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [_vec(I8, 32), _vec(I8, 32)])
    wd = _intrinsic_fn(module, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [_vec(I16, 16), _vec(I16, 16)])
    ones = _const_vec(I16, 16, 1)
    return b.add(acc, _join(b, *(b.call(wd, [b.call(mad, [u, v]), ones]) for u, v in halves), 16))


def _dot_centred_avx2(b: ir.IRBuilder, module, acc, codes, x):
    """acc <16 x i32> + each 32-bit lane's four (code - 128) x (signed byte of x) products, through AVX2's
    VPMADDUBSW as llama.cpp multiplies its 8-bit blocks: |code - 128| (at most 128, unsigned) times x with the
    sign of code - 128 (at most 127: activations are quantized to [-127, 127]), so that a pair's sum is at most
    2 x 128 x 127 < 2^15 and never saturates. 256-bit halves: every CPU with AVX-512BW runs them too."""
    v32i8 = _vec(I8, 32)
    sign = _intrinsic_fn(module, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8])
    absolute = _intrinsic_fn(module, "llvm.abs.v32i8", v32i8, [v32i8, I1])
    centred = b.xor(codes, _const_vec(I8, 64, 0x80))  # code - 128, as a signed byte
    # -128's magnitude reads as 128 unsigned
    halves = [(b.call(absolute, [w, ir.Constant(I1, 0)]), b.call(sign, [xh, w]))
              for w, xh in zip(_halves(b, centred, 64), _halves(b, x, 64))]
    return _madd_avx2(b, module, acc, halves)


def _mx_bytes(b: ir.IRBuilder, module, isa: str, nibbles):
    """<64 x i8> of FP4 codes (0..15) -> their MX_BYTES: a byte shuffle where the CPU has one, else selects."""
    table = ir.Constant(V64I8, list(MX_BYTES) * 4)
    if isa in ("avx512-vnni", "avx512bw"):
        fn = _intrinsic_fn(module, "llvm.x86.avx512.pshuf.b.512", V64I8, [V64I8, V64I8])
        return b.call(fn, [table, nibbles])
    if isa == "avx2":
        fn = _intrinsic_fn(module, "llvm.x86.avx2.pshuf.b", _vec(I8, 32), [_vec(I8, 32), _vec(I8, 32)])
        t0, _ = _halves(b, table, 64)
        n0, n1 = _halves(b, nibbles, 64)
        return _join(b, b.call(fn, [t0, n0]), b.call(fn, [t0, n1]), 64)
    out = _const_vec(I8, 64, MX_BYTES[0])
    for code in range(1, 16):
        out = b.select(b.icmp_unsigned("==", nibbles, _const_vec(I8, 64, code)), _const_vec(I8, 64, MX_BYTES[code]),
                       out)
    return out


def _gep(b, ptr, index):
    return b.gep(ptr, [index])


def _load_vec(b, ptr, vt):
    """An unaligned vector load of type vt at the byte pointer ptr."""
    return b.load(b.bitcast(ptr, vt.as_pointer()), align=1)


def _qblock_function(module, isa: str, encoding: int, asym: bool, tokens: int):
    """The IR function of one packed 16-row block times `tokens` tokens (see `qblock`), defined once
    per module."""
    name = f"expertcache.qblock.{isa}.{encoding}.{int(asym)}.{tokens}"
    p8, p32f, p32i = I8.as_pointer(), F32.as_pointer(), I32.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [p8, p8, p8, I64, I64, p8, I64, p32f, p32f, p32i, I64, p32f, I64, I64])
    fn = cgutils.get_or_insert_function(module, fnty, name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    codes, scales, mins, groups, gvecs, xq, tstride, xd, xs, xqs, gstride, out, ostride, lanes = fn.args
    entry, loop, inner, inner_end, done = (fn.append_basic_block(n) for n in ("entry", "group", "vec", "vec_end",
                                                                             "done"))
    b = ir.IRBuilder(entry)
    four = encoding in (INT4, MXFP4)
    cols = b.mul(gvecs, ir.Constant(I64, 8 if four else 4))  # columns of one group
    # each code vector is prefetched a block ahead: the same place in the next block of 16 rows, which a matrix's
    # next call reads (the hardware prefetcher alone left a thread well short of the memory's rate), into L2 only
    # (PREFETCH_LOCALITY)
    block_bytes = b.mul(b.mul(groups, gvecs), ir.Constant(I64, VEC))
    zero_f = ir.Constant(V16F32, [0.0] * 16)
    zero_i = ir.Constant(V16I32, [0] * 16)
    b.branch(loop)

    b.position_at_end(loop)
    g = b.phi(I64)
    g.add_incoming(ir.Constant(I64, 0), entry)
    facc = []
    for _ in range(tokens):
        f = b.phi(V16F32)
        f.add_incoming(zero_f, entry)
        facc.append(f)
    b.branch(inner)

    b.position_at_end(inner)
    v = b.phi(I64)
    v.add_incoming(ir.Constant(I64, 0), loop)
    # a 4-bit vector's low and high nibbles add into sums of their own: two chains of VPDPBUSD's latency, not one
    nparts = 2 if four else 1
    iacc = []
    for _ in range(tokens * nparts):
        a = b.phi(V16I32)
        a.add_incoming(zero_i, loop)
        iacc.append(a)
    vec_index = b.add(b.mul(g, gvecs), v)
    at = b.mul(vec_index, ir.Constant(I64, VEC))
    pf = _intrinsic_fn(module, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    b.call(pf, [_gep(b, codes, b.add(at, block_bytes)), ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY),
                ir.Constant(I32, 1)])
    w = _load_vec(b, _gep(b, codes, at), V64I8)
    col = b.add(b.mul(g, cols), b.mul(v, ir.Constant(I64, 8 if four else 4)))  # the vector's first column
    if four:
        low = b.and_(w, _const_vec(I8, 64, 0x0F))
        high = b.and_(b.lshr(w, _const_vec(I8, 64, 4)), _const_vec(I8, 64, 0x0F))
        parts = [(low, 0), (high, 4)]
        if encoding == MXFP4:
            parts = [(_mx_bytes(b, module, isa, p), off) for p, off in parts]
    else:
        parts = [(w, 0)]
    step_iacc = []
    for t in range(tokens):
        base = b.add(b.mul(ir.Constant(I64, t), tstride), col)
        for pi, (part, off) in enumerate(parts):
            quad = b.load(b.bitcast(_gep(b, xq, b.add(base, ir.Constant(I64, off))), p32i), align=1)
            step_iacc.append(_dot_u8s8(b, module, isa, iacc[t * nparts + pi], part,
                                       b.bitcast(_broadcast(b, quad, 16), V64I8), encoding != INT8))
    v_next = b.add(v, ir.Constant(I64, 1))
    for a, n in zip(iacc, step_iacc):
        a.add_incoming(n, inner)
    v.add_incoming(v_next, inner)
    b.cbranch(b.icmp_signed("<", v_next, gvecs), inner, inner_end)

    b.position_at_end(inner_end)
    new_iacc = []  # each token's group sum
    for t in range(tokens):
        total = step_iacc[t * nparts]
        for pi in range(1, nparts):
            total = b.add(total, step_iacc[t * nparts + pi])
        new_iacc.append(total)
    first_lane = b.mul(g, ir.Constant(I64, ROWS))  # the group's 16 per-row scales (and minimums)
    if encoding == MXFP4:  # E8M0: 2^(byte - 127), times the 1/2 of the bytes' doubled values
        e = b.zext(_load_vec(b, _gep(b, scales, first_lane), V16I8), V16I32)
        scale = b.fmul(b.bitcast(b.shl(e, _const_vec(I32, 16, 23)), V16F32), _const_vec(F32, 16, 0.5))
        zero_point = float(MX_OFFSET)
    else:
        two = b.mul(first_lane, ir.Constant(I64, 2))
        scale = b.fpext(b.bitcast(_load_vec(b, _gep(b, scales, two), V16I16), _vec(F16, 16)), V16F32)
        # codes centred on their middle, so that the activations' rounding meets weights the size of the
        # matrix's own, not of their distance to the group's minimum; asymmetric: (q - zp) with the minimum
        # moved by zp * scale, symmetric: the codes' zero
        zero_point = float(2 ** (3 if encoding == INT4 else 7) if asym else 7 if encoding == INT4 else 127)
        if asym:
            minimum = b.fpext(b.bitcast(_load_vec(b, _gep(b, mins, two), V16I16), _vec(F16, 16)), V16F32)
            minimum = b.call(_intrinsic_fn(module, "llvm.fma.v16f32", V16F32, [V16F32, V16F32, V16F32]),
                             [scale, _const_vec(F32, 16, zero_point), minimum])
    fma = _intrinsic_fn(module, "llvm.fma.v16f32", V16F32, [V16F32, V16F32, V16F32])
    new_facc = []
    for t in range(tokens):
        at = b.add(b.mul(ir.Constant(I64, t), gstride), g)
        s = b.sitofp(new_iacc[t], V16F32)
        qsum = b.sitofp(b.load(_gep(b, xqs, at)), F32)
        # the codes' zero point comes off with the activations' sum (less the 128 that centred codes took off)
        offset = zero_point - (128 if centres_codes(isa, encoding) else 0)
        s = b.fsub(s, _broadcast(b, b.fmul(qsum, ir.Constant(F32, offset)), 16))
        f = b.call(fma, [s, b.fmul(scale, _broadcast(b, b.load(_gep(b, xd, at)), 16)), facc[t]])
        if encoding != MXFP4 and asym:
            f = b.call(fma, [minimum, _broadcast(b, b.load(_gep(b, xs, at)), 16), f])
        new_facc.append(f)
    g_next = b.add(g, ir.Constant(I64, 1))
    for t in range(tokens):
        facc[t].add_incoming(new_facc[t], inner_end)
    g.add_incoming(g_next, inner_end)
    b.cbranch(b.icmp_signed("<", g_next, groups), loop, done)

    b.position_at_end(done)  # the block's first `lanes` rows: a last block of a matrix may hold fewer than 16
    whole, partial, end = (fn.append_basic_block(n) for n in ("whole", "partial", "end"))
    b.cbranch(b.icmp_signed(">=", lanes, ir.Constant(I64, ROWS)), whole, partial)
    b.position_at_end(whole)
    for t in range(tokens):
        b.store(new_facc[t], b.bitcast(_gep(b, out, b.mul(ir.Constant(I64, t), ostride)), V16F32.as_pointer()),
                align=4)
    b.branch(end)
    b.position_at_end(partial)  # lane by lane, each store guarded
    for t in range(tokens):
        row0 = b.mul(ir.Constant(I64, t), ostride)
        for lane in range(ROWS):
            with b.if_then(b.icmp_signed("<", ir.Constant(I64, lane), lanes)):
                b.store(b.extract_element(new_facc[t], ir.Constant(I32, lane)),
                        _gep(b, out, b.add(row0, ir.Constant(I64, lane))))
    b.branch(end)
    b.position_at_end(end)
    b.ret_void()
    return fn


VARIANTS = ((INT8, False), (INT8, True), (INT4, False), (INT4, True), (MXFP4, False))


def _qblock_dispatch(module, isa: str, tokens: int):
    """One function taking the encoding and the scheme at run time (i64, i1) before `_qblock_function`'s
    arguments, branching once to the variant compiled for them."""
    inner = {v: _qblock_function(module, isa, *v, tokens) for v in VARIANTS}
    argtys = list(inner[VARIANTS[0]].function_type.args)
    fnty = ir.FunctionType(ir.VoidType(), [I64, I1] + argtys)
    fn = cgutils.get_or_insert_function(module, fnty, f"expertcache.qblock.{isa}.{tokens}")
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    encoding, asym, *rest = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    for (enc, sym_asym), f in inner.items():
        hit = b.and_(b.icmp_signed("==", encoding, ir.Constant(I64, enc)),
                     b.icmp_unsigned("==", asym, ir.Constant(I1, int(sym_asym))))
        if enc == MXFP4:  # its scheme is fixed by the format
            hit = b.icmp_signed("==", encoding, ir.Constant(I64, enc))
        with b.if_then(hit):
            b.call(f, rest)
            b.ret_void()
    b.ret_void()
    return fn


def _pointer(context, builder, arrty, arr, offset):
    """A byte pointer to element `offset` of a numba array."""
    a = context.make_array(arrty)(context, builder, arr)
    ptr = builder.gep(a.data, [offset])
    return builder.bitcast(ptr, I8.as_pointer())


def _qblock_intrinsic(tokens: int):
    def typer(typingctx, encoding, asym, codes, code_at, scales, scale_at, mins, min_at, groups, gvecs, xq, xq_at,
              tstride, xd, xs, xqs, stat_at, gstride, out, out_at, ostride, lanes):
        def codegen(context, builder, signature, args):
            (enc_v, asym_v, codes_v, code_at_v, scales_v, scale_at_v, mins_v, min_at_v, groups_v, gvecs_v, xq_v,
             xq_at_v, tstride_v, xd_v, xs_v, xqs_v, stat_at_v, gstride_v, out_v, out_at_v, ostride_v, lanes_v) = args
            sig = signature.args
            fn = _qblock_dispatch(builder.module, ISA, tokens)

            def arr(i, v, at):
                return _pointer(context, builder, sig[i], v, at)

            def stat(i, v, ptr_type):
                a = context.make_array(sig[i])(context, builder, v)
                return builder.bitcast(builder.gep(a.data, [stat_at_v]), ptr_type)
            out_a = context.make_array(sig[18])(context, builder, out_v)
            builder.call(fn, [enc_v, builder.trunc(asym_v, I1) if asym_v.type != I1 else asym_v,
                              arr(2, codes_v, code_at_v), arr(4, scales_v, scale_at_v), arr(6, mins_v, min_at_v),
                              groups_v, gvecs_v, arr(10, xq_v, xq_at_v), tstride_v, stat(13, xd_v, F32.as_pointer()),
                              stat(14, xs_v, F32.as_pointer()), stat(15, xqs_v, I32.as_pointer()), gstride_v,
                              builder.gep(out_a.data, [out_at_v]), ostride_v, lanes_v])
            return context.get_dummy_value()
        i = types.intp
        return types.void(i, types.boolean, codes, i, scales, i, mins, i, i, i, xq, i, i, xd, xs, xqs, i, i, out, i,
                          i, i), codegen
    typer.__name__ = f"qblock{tokens}"
    return intrinsic(typer)


qblock1 = _qblock_intrinsic(1)
qblock1.__doc__ = """out[out_at + l] = row l of one packed block . one token's activations, for its 16 rows l: the
block's codes from codes[code_at] (uint8; `groups` groups of `gvecs` 64-byte vectors) in `encoding` (INT8,
INT4, MXFP4; `asym`: with minimums), its scales and minimums from scales[scale_at] and mins[min_at] (uint8
views: 16 fp16, or 16 E8M0 bytes, a group), the token's int8 activations from xq[xq_at] and its per-group
activation scales, sums and code sums from xd, xs (float32) and xqs (int32) at stat_at. Only the first `lanes`
rows (up to 16) are stored: the last block of a matrix may have fewer."""
qblock4 = _qblock_intrinsic(4)
qblock4.__doc__ = """qblock1 for four tokens: token t's activations at xq[xq_at + t * tstride], its statistics at
stat_at + t * gstride, its 16 results at out[out_at + t * ostride]."""


# -- float rows ----------------------------------------------------------------------------
F32_ROWS, F16_ROWS, BF16_ROWS = 0, 1, 2  # how a float matrix's weights are stored
FLOAT_UNROLL = 2  # 16-lane chunks per row and step: two independent sums per row hide the FMA latency
# ftile's 4 x 4 tile as the passes its sums fit the registers in: (rows, tokens, lanes) a pass. AVX2 has 16 vector
# registers of 8 floats, and a 4 x 4 tile of 16 lanes needs 32 for its sums alone: spilled, fp16 windows ran at
# 50 GFLOP/s on two Zen 3 cores, and as two passes of 4 rows x 2 tokens x 8 lanes at 114-139 (bf16 and fp32 1.9x)
FLOAT_TILE = (4, 4, 16) if ISA.startswith("avx512") else (4, 2, 8)


def _widen(b, raw, kind, lanes):
    """<lanes x i16> weights as <lanes x float>: fp16 converted, bf16 as the top half of an fp32."""
    if kind == F16_ROWS:
        return b.fpext(b.bitcast(raw, _vec(F16, lanes)), _vec(F32, lanes))
    return b.bitcast(b.shl(b.zext(raw, _vec(I32, lanes)), _const_vec(I32, lanes, 16)), _vec(F32, lanes))


def _fdot_function(module, kind: int, rows: int):
    """The IR function of `fdot`: `rows` rows of a float matrix times one fp32 vector."""
    name = f"expertcache.fdot.{kind}.{rows}"
    p8, pf = I8.as_pointer(), F32.as_pointer()
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [p8, I64, I64, pf, pf]), name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    w, stride, cols, x, out = fn.args
    entry, loop, tail_head, tail, done = (fn.append_basic_block(n) for n in ("entry", "loop", "tail_head", "tail",
                                                                           "done"))
    b = ir.IRBuilder(entry)
    size = 4 if kind == F32_ROWS else 2
    step = 16 * FLOAT_UNROLL
    chunks = b.sdiv(cols, ir.Constant(I64, step))
    zero = ir.Constant(V16F32, [0.0] * 16)
    fma = _intrinsic_fn(module, "llvm.fma.v16f32", V16F32, [V16F32, V16F32, V16F32])
    b.cbranch(b.icmp_signed(">", chunks, ir.Constant(I64, 0)), loop, tail_head)

    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    accs = [[b.phi(V16F32) for _ in range(FLOAT_UNROLL)] for _ in range(rows)]
    for row in accs:
        for a in row:
            a.add_incoming(zero, entry)
    c0 = b.mul(i, ir.Constant(I64, step))
    new = []
    for r in range(rows):
        base = b.mul(ir.Constant(I64, r), stride)
        row_new = []
        for u in range(FLOAT_UNROLL):
            c = b.add(c0, ir.Constant(I64, 16 * u))
            xv = _load_vec(b, b.bitcast(_gep(b, x, c), I8.as_pointer()), V16F32)
            at = _gep(b, w, b.add(base, b.mul(c, ir.Constant(I64, size))))
            if u == 0:  # the same columns of the next call's rows (a matrix's rows are read in order)
                pf = _intrinsic_fn(module, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
                b.call(pf, [_gep(b, at, b.mul(stride, ir.Constant(I64, rows))), ir.Constant(I32, 0),
                            ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])
            wv = _load_vec(b, at, V16F32) if kind == F32_ROWS else _widen(b, _load_vec(b, at, V16I16), kind, 16)
            row_new.append(b.call(fma, [wv, xv, accs[r][u]]))
        new.append(row_new)
    totals = []  # each row's unrolled sums added, for the exit
    for row_new in new:
        total = row_new[0]
        for u in range(1, FLOAT_UNROLL):
            total = b.fadd(total, row_new[u])
        totals.append(total)
    i_next = b.add(i, ir.Constant(I64, 1))
    for r in range(rows):
        for u in range(FLOAT_UNROLL):
            accs[r][u].add_incoming(new[r][u], loop)
    i.add_incoming(i_next, loop)
    b.cbranch(b.icmp_signed("<", i_next, chunks), loop, tail_head)

    b.position_at_end(tail_head)  # the sums so far, each row's lanes added up
    reduce = _intrinsic_fn(module, "llvm.vector.reduce.fadd.v16f32", F32, [F32, V16F32])
    vs = [b.phi(V16F32) for _ in range(rows)]
    for v, total in zip(vs, totals):
        v.add_incoming(zero, entry)
        v.add_incoming(total, loop)
    sums = [b.call(reduce, [ir.Constant(F32, 0.0), v], fastmath=("reassoc",)) for v in vs]  # a tree of lanes
    first = b.mul(chunks, ir.Constant(I64, step))
    b.cbranch(b.icmp_signed("<", first, cols), tail, done)

    b.position_at_end(tail)  # the last cols % step columns one by one (fused: the same rounding whatever LLVM contracts)
    fma1 = _intrinsic_fn(module, "llvm.fma.f32", F32, [F32, F32, F32])
    j = b.phi(I64)
    j.add_incoming(first, tail_head)
    part = [b.phi(F32) for _ in range(rows)]
    for p, s in zip(part, sums):
        p.add_incoming(s, tail_head)
    xs = b.load(_gep(b, x, j))
    nxt = []
    for r in range(rows):
        at = _gep(b, w, b.add(b.mul(ir.Constant(I64, r), stride), b.mul(j, ir.Constant(I64, size))))
        if kind == F32_ROWS:
            wv = b.load(b.bitcast(at, F32.as_pointer()), align=1)
        else:
            raw = b.load(b.bitcast(at, I16.as_pointer()), align=1)
            wv = b.fpext(b.bitcast(raw, F16), F32) if kind == F16_ROWS else \
                b.bitcast(b.shl(b.zext(raw, I32), ir.Constant(I32, 16)), F32)
        nxt.append(b.call(fma1, [wv, xs, part[r]]))
    j_next = b.add(j, ir.Constant(I64, 1))
    for p, n in zip(part, nxt):
        p.add_incoming(n, tail)
    j.add_incoming(j_next, tail)
    b.cbranch(b.icmp_signed("<", j_next, cols), tail, done)

    b.position_at_end(done)
    results = [b.phi(F32) for _ in range(rows)]
    for r, v in enumerate(results):
        v.add_incoming(sums[r], tail_head)
        v.add_incoming(nxt[r], tail)
    for r, v in enumerate(results):
        b.store(v, _gep(b, out, ir.Constant(I64, r)))
    b.ret_void()
    return fn


def _fdot_intrinsic(rows: int):
    def typer(typingctx, w, w_at, stride, cols, x, x_at, out, out_at):
        kind = {types.float32: F32_ROWS, types.uint16: F16_ROWS, types.int16: BF16_ROWS}.get(w.dtype)
        if kind is None:
            return None

        def codegen(context, builder, signature, args):
            w_v, w_at_v, stride_v, cols_v, x_v, x_at_v, out_v, out_at_v = args
            sig = signature.args
            fn = _fdot_function(builder.module, kind, rows)
            xa = context.make_array(sig[4])(context, builder, x_v)
            oa = context.make_array(sig[6])(context, builder, out_v)
            size = ir.Constant(I64, 4 if kind == F32_ROWS else 2)
            builder.call(fn, [_pointer(context, builder, sig[0], w_v, w_at_v), builder.mul(stride_v, size), cols_v,
                              builder.gep(xa.data, [x_at_v]), builder.gep(oa.data, [out_at_v])])
            return context.get_dummy_value()
        i = types.intp
        return types.void(w, i, i, i, x, i, out, i), codegen
    typer.__name__ = f"fdot{rows}"
    return intrinsic(typer)


fdot4 = _fdot_intrinsic(4)
fdot4.__doc__ = """out[out_at + r] = w[w_at + r * stride: + cols] . x[x_at: x_at + cols] for r < 4: four rows of a
float matrix (flat float32, or uint16 / int16 holding fp16 / bf16 bits, row stride `stride` elements) times
one float32 vector, the weights widened in registers."""
fdot1 = _fdot_intrinsic(1)
fdot1.__doc__ = """fdot4 for one row."""


def _fgemm_function(module, kind: int, rows: int, tokens: int, lanes: int):
    """The IR function of one pass of `ftile`: `rows` rows of a float matrix times `tokens` tokens' fp32 vectors, in
    vectors of `lanes` floats (FLOAT_TILE)."""
    name = f"expertcache.ftile.{kind}.{rows}.{tokens}.{lanes}"
    p8, pf = I8.as_pointer(), F32.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [p8, I64, I64, pf, I64, pf, I64])
    fn = cgutils.get_or_insert_function(module, fnty, name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    w, stride, cols, x, xstride, out, ostride = fn.args
    entry, loop, tail_head, tail, done = (fn.append_basic_block(n) for n in ("entry", "loop", "tail_head", "tail",
                                                                           "done"))
    b = ir.IRBuilder(entry)
    size = 4 if kind == F32_ROWS else 2
    VF = _vec(F32, lanes)
    chunks = b.sdiv(cols, ir.Constant(I64, lanes))
    zero = ir.Constant(VF, [0.0] * lanes)
    fma = _intrinsic_fn(module, f"llvm.fma.v{lanes}f32", VF, [VF, VF, VF])
    b.cbranch(b.icmp_signed(">", chunks, ir.Constant(I64, 0)), loop, tail_head)

    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    acc = [[b.phi(VF) for _ in range(tokens)] for _ in range(rows)]  # [row][token]
    for row in acc:
        for a in row:
            a.add_incoming(zero, entry)
    c = b.mul(i, ir.Constant(I64, lanes))
    ws = []
    for r in range(rows):
        at = _gep(b, w, b.add(b.mul(ir.Constant(I64, r), stride), b.mul(c, ir.Constant(I64, size))))
        ws.append(_load_vec(b, at, VF) if kind == F32_ROWS else _widen(b, _load_vec(b, at, _vec(I16, lanes)), kind,
                                                                         lanes))
    xs = [_load_vec(b, b.bitcast(_gep(b, x, b.add(b.mul(ir.Constant(I64, t), xstride), c)), p8), VF)
          for t in range(tokens)]
    new = [[b.call(fma, [ws[r], xs[t], acc[r][t]]) for t in range(tokens)] for r in range(rows)]
    i_next = b.add(i, ir.Constant(I64, 1))
    for r in range(rows):
        for t in range(tokens):
            acc[r][t].add_incoming(new[r][t], loop)
    i.add_incoming(i_next, loop)
    b.cbranch(b.icmp_signed("<", i_next, chunks), loop, tail_head)

    b.position_at_end(tail_head)
    reduce = _intrinsic_fn(module, f"llvm.vector.reduce.fadd.v{lanes}f32", F32, [F32, VF])
    vs = [[b.phi(VF) for _ in range(tokens)] for _ in range(rows)]
    for r in range(rows):
        for t in range(tokens):
            vs[r][t].add_incoming(zero, entry)
            vs[r][t].add_incoming(new[r][t], loop)
    sums = [[b.call(reduce, [ir.Constant(F32, 0.0), vs[r][t]], fastmath=("reassoc",)) for t in range(tokens)]
            for r in range(rows)]
    first = b.mul(chunks, ir.Constant(I64, lanes))
    b.cbranch(b.icmp_signed("<", first, cols), tail, done)

    b.position_at_end(tail)
    fma1 = _intrinsic_fn(module, "llvm.fma.f32", F32, [F32, F32, F32])
    j = b.phi(I64)
    j.add_incoming(first, tail_head)
    part = [[b.phi(F32) for _ in range(tokens)] for _ in range(rows)]
    for r in range(rows):
        for t in range(tokens):
            part[r][t].add_incoming(sums[r][t], tail_head)
    nxt = [[None] * tokens for _ in range(rows)]
    for r in range(rows):
        at = _gep(b, w, b.add(b.mul(ir.Constant(I64, r), stride), b.mul(j, ir.Constant(I64, size))))
        if kind == F32_ROWS:
            wv = b.load(b.bitcast(at, F32.as_pointer()), align=1)
        else:
            raw = b.load(b.bitcast(at, I16.as_pointer()), align=1)
            wv = b.fpext(b.bitcast(raw, F16), F32) if kind == F16_ROWS else \
                b.bitcast(b.shl(b.zext(raw, I32), ir.Constant(I32, 16)), F32)
        for t in range(tokens):
            xv = b.load(_gep(b, x, b.add(b.mul(ir.Constant(I64, t), xstride), j)))
            nxt[r][t] = b.call(fma1, [wv, xv, part[r][t]])
    j_next = b.add(j, ir.Constant(I64, 1))
    for r in range(rows):
        for t in range(tokens):
            part[r][t].add_incoming(nxt[r][t], tail)
    j.add_incoming(j_next, tail)
    b.cbranch(b.icmp_signed("<", j_next, cols), tail, done)

    b.position_at_end(done)
    results = [[b.phi(F32) for _ in range(tokens)] for _ in range(rows)]
    for r in range(rows):
        for t in range(tokens):
            results[r][t].add_incoming(sums[r][t], tail_head)
            results[r][t].add_incoming(nxt[r][t], tail)
    for r in range(rows):
        for t in range(tokens):
            b.store(results[r][t], _gep(b, out, b.add(b.mul(ir.Constant(I64, t), ostride), ir.Constant(I64, r))))
    b.ret_void()
    return fn


@intrinsic
def ftile(typingctx, w, w_at, stride, cols, x, x_at, xstride, out, out_at, ostride):
    """out[out_at + t * ostride + r] = w[w_at + r * stride: + cols] . x[x_at + t * xstride: + cols] for r, t < 4:
    a 4-row by 4-token tile of a float matrix (as fdot4 takes it) times float32 activations, each weight
    load serving the tokens of a pass (FLOAT_TILE: four, or two where AVX2's registers hold two)."""
    kind = {types.float32: F32_ROWS, types.uint16: F16_ROWS, types.int16: BF16_ROWS}.get(w.dtype)
    if kind is None:
        return None

    def codegen(context, builder, signature, args):
        w_v, w_at_v, stride_v, cols_v, x_v, x_at_v, xstride_v, out_v, out_at_v, ostride_v = args
        sig = signature.args
        rows, tokens, lanes = FLOAT_TILE
        fn = _fgemm_function(builder.module, kind, rows, tokens, lanes)
        xa = context.make_array(sig[4])(context, builder, x_v)
        oa = context.make_array(sig[7])(context, builder, out_v)
        size = ir.Constant(I64, 4 if kind == F32_ROWS else 2)
        wp, wstride = _pointer(context, builder, sig[0], w_v, w_at_v), builder.mul(stride_v, size)
        for r in range(0, 4, rows):  # each pass: rows r.. of the weights, tokens t.. of the activations and outputs
            for t in range(0, 4, tokens):
                rc, tc = ir.Constant(I64, r), ir.Constant(I64, t)
                builder.call(fn, [builder.gep(wp, [builder.mul(wstride, rc)]), wstride, cols_v,
                                  builder.gep(xa.data, [builder.add(x_at_v, builder.mul(xstride_v, tc))]), xstride_v,
                                  builder.gep(oa.data, [builder.add(out_at_v, builder.add(builder.mul(ostride_v, tc),
                                                                                           rc))]), ostride_v])
        return context.get_dummy_value()
    i = types.intp
    return types.void(w, i, i, i, x, i, i, out, i, i), codegen
