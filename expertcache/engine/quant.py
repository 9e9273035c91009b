"""Storage formats of one expert in the slow tier: a float dtype (fp32, fp16, bf16) stored as
is, or integers (int8, int4 packed two per byte) with group-wise scales along each weight
matrix's input dimension, or MXFP4. Biases stay fp16 (fp32 with MXFP4, so that a checkpoint's bf16
or fp32 biases convert without loss).

MXFP4 (OCP Microscaling, GPT-OSS's released experts): blocks of 32 inputs of one output row share a
power-of-two scale stored as its biased exponent (E8M0, one byte); each weight is an FP4 (E2M1)
code, two per byte, low nibble first: 4.25 bits per weight. Encoding follows HF's GPT-OSS
conversion (triton_kernels' downcast_to_mxfp, scale rounding up): the block's scale is its largest
magnitude / 6 rounded up to a power of two, so no weight clips, and each weight goes to the
nearest FP4 value, ties away from zero. A checkpoint already in MXFP4 is stored as is.

Integer formats are asymmetric by default: each group of G inputs of one output row keeps
an fp16 scale and an fp16 minimum, x ~ min + scale * q with q in [0, 2^bits - 1]. Symmetric
(x ~ scale * q, q in [-2^(bits-1) + 1, 2^(bits-1) - 1]) is an option; on the built-in model
asymmetric int4 reconstructs the weights with ~17% less error than symmetric at the same group size
and ~10% less at the same bits per weight (see
benchmarks/RESULTS.md, "Slot formats and quantized experts"). An input dimension that is not a multiple of G
is padded with zeros to one (the padding is stored and dropped when dequantising).

A blob's layout (`layout`): for each part in the order `ExpertShape.parts`, its segments
(codes, scales, minimums; or the raw values), each starting at a 16-byte boundary. Float
formats keep the plain concatenation of the parts, byte for byte the original layout.

Quantized matrices are stored in the layout the CPU kernel reads (kernel/simd.py), so that a read
lands in its slot as it is: rows in blocks of 16 (the last padded with zero rows), and within a
block each group of G columns as G/4 (int8) or G/8 (4-bit) vectors of 64 bytes, each holding 4
consecutive columns of every one of the 16 rows (4-bit: the low nibbles 4 columns, the high nibbles
the 4 after them); the scales and minimums of a block as 16 values a group. One vector then feeds
one integer dot-product instruction for 16 rows at once. `pack_codes` and `unpack_codes` convert
from and to one code per weight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..choices import DTYPES, MXFP4, SCHEMES  # noqa: F401 (re-exported)
from ..errors import BadInput
from ..kernel import decode_blob as kernel

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
INT_BITS = {"int8": 8, "int4": 4}
MX_BLOCK = 32  # MXFP4: weights per shared scale
# The 16 values of an FP4 (E2M1) code: sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive FP4 magnitudes
SEGMENT_ALIGN = 16
BLOCK = 16  # rows of one packed block (kernel/simd.py's ROWS)


@dataclass(frozen=True)
class ExpertFormat:
    """How one expert is stored: `dtype` (float32, float16, bfloat16, int8, int4, mxfp4), and for the
    integer dtypes the group size along the input dimension and the scheme (asym or sym); mxfp4's
    group is its block of 32."""
    dtype: str = "float16"
    group_size: int = 0
    scheme: str = ""

    @classmethod
    def parse(cls, dtype: str, group_size: int = 32, scheme: str = "asym") -> ExpertFormat:
        """A format from user input (`fp16`, `bf16`, `int8`, `int4`, `mxfp4`, ...); BadInput naming the
        fix. mxfp4 ignores group_size and scheme: its blocks of 32 are fixed by the format."""
        name = ALIASES.get(dtype, dtype)
        if name in FLOAT_DTYPES:
            return cls(name)
        if name == MXFP4:
            return cls(MXFP4, MX_BLOCK)
        if name not in INT_BITS:
            raise BadInput(f"unknown expert dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if not isinstance(group_size, int) or group_size < 8 or group_size % 8:
            raise BadInput(f"group size {group_size!r} must be a multiple of 8 (the kernel reads 8 codes at a "
                           "time); e.g. --group-size 32 or 64")
        if scheme not in SCHEMES:
            raise BadInput(f"unknown quantization scheme {scheme!r}; choose asym or sym")
        return cls(name, group_size, scheme)

    @property
    def flags(self) -> str:
        """The options that name this format on the command line (`--dtype` of convert, `--store-dtype` of a run,
        the group size and scheme where not the defaults)."""
        short = {v: k for k, v in ALIASES.items()}.get(self.dtype, self.dtype)
        integer = self.dtype in INT_BITS
        return short + (f" --group-size {self.group_size}" if integer and self.group_size != 32 else "") + \
            (f" --scheme {self.scheme}" if integer and self.scheme != "asym" else "")

    @classmethod
    def of_dtype(cls, dtype: torch.dtype) -> ExpertFormat:
        """The float format storing `dtype` as is."""
        return cls(str(dtype).removeprefix("torch."))

    @property
    def quantized(self) -> bool:
        """True for the formats a fetch decodes (int8, int4, mxfp4); False for the float dtypes."""
        return self.dtype in INT_BITS or self.mx

    @property
    def mx(self) -> bool:
        """True for MXFP4."""
        return self.dtype == MXFP4

    @property
    def bits(self) -> int:
        """Bits per stored weight, not counting group scales and minimums."""
        if self.mx:
            return 4
        return INT_BITS[self.dtype] if self.quantized else FLOAT_DTYPES[self.dtype].itemsize * 8

    @property
    def tag(self) -> str:
        """A short name for folders and tables: fp16, int4-g64-asym, mxfp4, ..."""
        if self.mx:
            return MXFP4
        if not self.quantized:
            return {v: k for k, v in ALIASES.items()}[self.dtype]
        return f"{self.dtype}-g{self.group_size}-{self.scheme}"

    def meta(self) -> dict:
        """What experts.json records."""
        return {"dtype": self.dtype, "group_size": self.group_size, "scheme": self.scheme}

    @classmethod
    def from_meta(cls, meta: dict) -> ExpertFormat:
        """The format an experts.json records; ValueError when it is not one."""
        dtype = meta.get("dtype")
        if dtype in FLOAT_DTYPES and not meta.get("group_size") and not meta.get("scheme"):
            return cls(dtype)
        if dtype == MXFP4 and meta.get("group_size") == MX_BLOCK and not meta.get("scheme"):
            return cls(MXFP4, MX_BLOCK)
        if dtype in INT_BITS and isinstance(meta.get("group_size"), int) and meta["group_size"] >= 8 \
                and meta["group_size"] % 8 == 0 and meta.get("scheme") in SCHEMES:
            return cls(dtype, meta["group_size"], meta["scheme"])
        raise ValueError(f"dtype {dtype!r}, group size {meta.get('group_size')!r}, scheme {meta.get('scheme')!r} "
                         "is not a known expert format")


def checked_format(value, what: str) -> ExpertFormat:
    """`value`, an ExpertFormat or a dtype's name as `ExpertFormat.parse` reads it ('int4'), as a format the stores
    and kernels know; BadInput naming `what` otherwise: a name failed deep in the load, a format made by hand with an
    unknown dtype or no group size inside the conversion, and None under a lowbit policy fetched full copies."""
    if isinstance(value, ExpertFormat):
        try:
            return ExpertFormat.from_meta(value.meta())
        except ValueError as e:
            raise BadInput(f"{what}: {e}; make it with ExpertFormat.parse, e.g. ExpertFormat.parse('int4', 32)") \
                from None
    if not isinstance(value, str):
        raise BadInput(f"{what}={value!r} must be an ExpertFormat or a dtype's name such as 'int4', not "
                       f"{type(value).__name__}")
    try:
        return ExpertFormat.parse(value)
    except BadInput as e:
        raise BadInput(f"{what}: {e}") from None


@dataclass(frozen=True)
class Segment:
    """One array of a blob: the `role` it plays for part `part`, where it starts (`offset` bytes from
    the blob's start), its dtype and its shape."""
    part: int  # index into ExpertShape.parts
    role: str  # "raw" | "codes" | "scales" | "mins"
    offset: int  # bytes from the blob's start
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the segment's values take, without the alignment padding after it."""
        return math.prod(self.shape) * self.dtype.itemsize


def _groups(cols: int, g: int) -> int:
    return -(-cols // g)


def _blocks(rows: int) -> int:
    return -(-rows // BLOCK)


def pack_codes(q: torch.Tensor, g: int, bits: int) -> torch.Tensor:
    """One code per weight, q [rows, groups * g] (0..2^bits - 1, uint8) -> the packed layout [blocks, bytes]
    (see the module's docstring): rows padded with zeros to whole blocks."""
    rows, cols = q.shape
    blocks, n_groups = _blocks(rows), cols // g
    q = torch.nn.functional.pad(q, (0, 0, 0, blocks * BLOCK - rows))
    if bits == 4:  # [block, lane, group, vector, half, column] -> [block, group, vector, lane, column, half]
        t = q.view(blocks, BLOCK, n_groups, g // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
        packed = t[..., 0] | (t[..., 1] << 4)
    else:
        packed = q.view(blocks, BLOCK, n_groups, g // 4, 4).permute(0, 2, 3, 1, 4)
    return packed.contiguous().view(blocks, -1)


def unpack_codes(packed: torch.Tensor, rows: int, g: int, bits: int) -> torch.Tensor:
    """The inverse of pack_codes: [blocks, bytes] -> q [rows, groups * g] uint8."""
    blocks = packed.shape[0]
    n_groups = packed.shape[1] * 8 // bits // (g * BLOCK)
    if bits == 4:
        t = packed.view(blocks, n_groups, g // 8, BLOCK, 4)
        t = torch.stack((t & 0xF, t >> 4), -1)  # [block, group, vector, lane, column, half]
        q = t.permute(0, 3, 1, 2, 5, 4)
    else:
        q = packed.view(blocks, n_groups, g // 4, BLOCK, 4).permute(0, 3, 1, 2, 4)
    return q.reshape(blocks * BLOCK, n_groups * g)[:rows]


def pack_lanes(v: torch.Tensor) -> torch.Tensor:
    """Per-row group values v [rows, groups] (scales, minimums) -> [blocks, groups * 16]: each group's 16 rows
    together, rows padded with zeros."""
    rows, n_groups = v.shape
    blocks = _blocks(rows)
    v = torch.nn.functional.pad(v, (0, 0, 0, blocks * BLOCK - rows))
    return v.view(blocks, BLOCK, n_groups).transpose(1, 2).contiguous().view(blocks, -1)


def unpack_lanes(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of pack_lanes: [blocks, groups * 16] -> [rows, groups]."""
    blocks = packed.shape[0]
    return packed.view(blocks, -1, BLOCK).transpose(1, 2).reshape(blocks * BLOCK, -1)[:rows]


def layout(parts: list[tuple[int, ...]], fmt: ExpertFormat) -> list[Segment]:
    """The segments of one blob, in order."""
    segs, offset = [], 0
    if not fmt.quantized:
        dtype = FLOAT_DTYPES[fmt.dtype]
        for i, shape in enumerate(parts):
            segs.append(Segment(i, "raw", offset, dtype, shape))
            offset += segs[-1].nbytes
        return segs
    for i, shape in enumerate(parts):
        if fmt.mx:
            roles = mxfp4_segments(shape)
        elif len(shape) == 1:  # biases: fp16
            roles = [("raw", torch.float16, shape)]
        else:
            blocks, n_groups = _blocks(shape[0]), _groups(shape[1], fmt.group_size)
            code_bytes = n_groups * fmt.group_size * BLOCK * fmt.bits // 8
            roles = [("codes", torch.uint8, (blocks, code_bytes)), ("scales", torch.float16, (blocks, n_groups * BLOCK))]
            roles += [("mins", torch.float16, (blocks, n_groups * BLOCK))] if fmt.scheme == "asym" else []
        for role, dtype, seg_shape in roles:
            offset = -(-offset // SEGMENT_ALIGN) * SEGMENT_ALIGN
            segs.append(Segment(i, role, offset, dtype, seg_shape))
            offset += segs[-1].nbytes
    return segs


def encoded_bytes(parts: list[tuple[int, ...]], fmt: ExpertFormat) -> int:
    """Bytes of one expert in `fmt`, before the blob's alignment."""
    last = layout(parts, fmt)[-1]
    return last.offset + last.nbytes


def mxfp4_segments(shape: tuple[int, ...]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(role, dtype, shape) of one part in MXFP4: a matrix [rows, cols] as its FP4 codes packed as 4-bit
    codes are (`pack_codes`, blocks of 32 columns as the groups) and its scales as E8M0 bytes packed as
    `pack_lanes` packs them, cols padded to blocks of 32; a bias as fp32."""
    if len(shape) == 1:
        return [("raw", torch.float32, shape)]
    row_blocks, blocks = _blocks(shape[0]), _groups(shape[1], MX_BLOCK)
    return [("codes", torch.uint8, (row_blocks, blocks * MX_BLOCK * BLOCK // 2)),
            ("scales", torch.uint8, (row_blocks, blocks * BLOCK))]


def float_to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N] float (N a multiple of 32) -> (blocks [..., N / 32, 16] uint8, two FP4 codes per byte, low
    nibble first; scales [..., N / 32] uint8, each block's power-of-two scale as its exponent biased by 127).
    The scale: the block's largest magnitude / 6 rounded up to a power of two (an all-zero block: byte 0);
    codes: the nearest FP4 value of w / scale, ties away from zero."""
    assert w.shape[-1] % MX_BLOCK == 0, f"MXFP4 needs whole blocks of {MX_BLOCK}, got {w.shape[-1]} inputs"
    groups = w.float().reshape(*w.shape[:-1], -1, MX_BLOCK)
    # rounding the float32 bits of amax / 6 up to the next exponent, as triton_kernels does
    scale_bits = ((groups.abs().amax(-1) / 6.0).view(torch.int32) + 0x7FFFFF) & 0x7F800000
    scale = scale_bits.view(torch.float32)
    v = groups / torch.where(scale == 0, 1.0, scale).unsqueeze(-1)
    magnitude = torch.bucketize(v.abs(), torch.tensor(FP4_MIDPOINTS), right=True)  # 0..7, ties go up
    codes = (magnitude | ((v < 0).to(magnitude.dtype) << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (scale_bits >> 23).to(torch.uint8)


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of float_to_mxfp4: blocks [..., G, 16] uint8, scales [..., G] uint8 -> float32 [..., G * 32].
    Vectorised torch ops (which release the GIL), so worker threads decode in parallel."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32]
    return torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1)).flatten(-2)


def _whole_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [rows, cols] as float32 with zero inputs appended up to whole MXFP4 blocks."""
    return torch.nn.functional.pad(w.float(), (0, _groups(w.shape[1], MX_BLOCK) * MX_BLOCK - w.shape[1]))


def pack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 as checkpoints hold it, blocks [rows, blocks, 16] uint8 (two FP4 codes a byte, low nibble first)
    and scales [rows, blocks] -> the segments of `mxfp4_segments` (the same codes and scales, repacked)."""
    rows = blocks.shape[0]
    codes = torch.stack((blocks & 0xF, blocks >> 4), -1).reshape(rows, -1)  # one FP4 code per weight
    return {"codes": pack_codes(codes, MX_BLOCK, 4), "scales": pack_lanes(scales)}


def unpack_mxfp4(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_mxfp4: the segments -> (blocks [rows, blocks, 16], scales [rows, blocks])."""
    q = unpack_codes(codes, rows, MX_BLOCK, 4)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).view(rows, -1, MX_BLOCK // 2), unpack_lanes(scales, rows)


def quantize_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [rows, cols] float -> the MXFP4 segments of `mxfp4_segments`: codes and scales."""
    return pack_mxfp4(*float_to_mxfp4(_whole_blocks(w)))


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """MXFP4 segments (codes, scales) of a [rows, cols] matrix -> float32 [rows, cols]."""
    return mxfp4_to_float(*unpack_mxfp4(codes, scales, rows))[:, :cols]


def mxfp4_error_bound(w: torch.Tensor) -> torch.Tensor:
    """Per element, the most an MXFP4 round trip may move w [rows, cols]: half the FP4 spacing at the
    element's magnitude (0.5, 1, 2 below 2, 4, 6) times its block's scale."""
    _, scales = float_to_mxfp4(_whole_blocks(w))
    scale = torch.exp2(scales.float() - 127).repeat_interleave(MX_BLOCK, -1)[:, :w.shape[1]]
    v = w.float().abs() / scale
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    return half_step * scale * 1.0001 + 1e-30


def _divisor(scale: torch.Tensor) -> torch.Tensor:
    """The stored (fp16) scale as the divisor of its group, 1 for an all-zero group."""
    s = scale.float()
    return torch.where(s == 0, 1.0, s)[..., None]


def quantize(w: torch.Tensor, fmt: ExpertFormat) -> dict[str, torch.Tensor]:
    """w [rows, cols] float -> the segments of `layout`: codes (pack_codes), scales and, asymmetric, mins
    (fp16, pack_lanes)."""
    rows, cols = w.shape
    g, levels = fmt.group_size, 2 ** fmt.bits - 1
    n_groups = _groups(cols, g)
    x = torch.nn.functional.pad(w.float(), (0, n_groups * g - cols)).view(rows, n_groups, g)
    if fmt.scheme == "asym":
        lo, hi = x.amin(-1), x.amax(-1)
        scale = ((hi - lo) / levels).half()
        lo = lo.half()
        s = _divisor(scale)
        q = ((x - lo.float()[..., None]) / s).round().clamp(0, levels)
        out = {"scales": scale, "mins": lo}
    else:
        half = levels // 2  # codes -half..half, stored unsigned as 0..2 * half
        scale = (x.abs().amax(-1) / half).half()
        s = _divisor(scale)
        q = (x / s).round().clamp(-half, half) + half
        out = {"scales": scale}
    out = {role: pack_lanes(v) for role, v in out.items()}
    out["codes"] = pack_codes(q.to(torch.uint8).view(rows, n_groups * g), g, fmt.bits)
    return out


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: ExpertFormat,
               rows: int, cols: int) -> torch.Tensor:
    """The inverse of `quantize` for a [rows, cols] matrix: float32 [rows, cols]. Vectorised torch ops
    (which release the GIL), so worker threads dequantise in parallel."""
    scales = unpack_lanes(scales, rows)
    mins = None if mins is None else unpack_lanes(mins, rows)
    n_groups = scales.shape[1]
    q = unpack_codes(codes, rows, fmt.group_size, fmt.bits).reshape(rows, n_groups, fmt.group_size).float()
    if mins is None:
        q = q - (2 ** fmt.bits - 1) // 2
        w = q * scales.float()[..., None]
    else:
        w = torch.addcmul(mins.float()[..., None], q, scales.float()[..., None])
    return w.reshape(rows, -1)[:, :cols]


def encode(tensors: list, parts: list[tuple[int, ...]], fmt: ExpertFormat, blob: int, finite: bool = True) -> bytes:
    """One expert's parts (w13, w2, then the biases) as a blob of `blob` bytes in `fmt`: each a float
    tensor, or, for a part a checkpoint holds in MXFP4 already, {"codes": [rows, blocks * 16] (two FP4 codes
    a byte), "scales": [rows, blocks]}, whose codes and scales are repacked as they are, not requantised.
    `finite`: BadInput for finite weights that the format's float16 parts cannot hold (written as inf, a store
    was later read as damaged)."""
    out = torch.zeros(blob, dtype=torch.uint8)
    quantized = {}
    for seg in layout(parts, fmt):
        t = tensors[seg.part]
        if isinstance(t, dict):
            if seg.part not in quantized:
                quantized[seg.part] = pack_mxfp4(t["codes"].reshape(t["codes"].shape[0], -1, MX_BLOCK // 2),
                                                 t["scales"])
            src = quantized[seg.part][seg.role]
        elif seg.role == "raw":
            src = t.to(seg.dtype if fmt.quantized else FLOAT_DTYPES[fmt.dtype]).contiguous()
        else:
            if seg.part not in quantized:
                quantized[seg.part] = quantize_mxfp4(t) if fmt.mx else quantize(t, fmt)
            src = quantized[seg.part][seg.role]
        if finite and src.is_floating_point() and not isinstance(t, dict) and not bool(torch.isfinite(src).all()) \
                and bool(torch.isfinite(t).all()):
            raise BadInput(f"an expert's weights reach {float(t.float().abs().amax()):.4g}, past what {fmt.tag} holds "
                           "(float16's 65,504); store them as bf16 or fp32 (convert --dtype bf16, or --store-dtype "
                           "bf16)")
        out[seg.offset:seg.offset + seg.nbytes] = src.flatten().view(torch.uint8)
    return out.numpy().tobytes()


ENCODE_ROWS = 512  # rows of a large matrix quantized at a time: its fp32 temporaries stay that size


def encode_matrix(w: torch.Tensor, fmt: ExpertFormat) -> np.ndarray:
    """One matrix w [rows, cols] in the quantized `fmt` as the bytes of `layout([w.shape], fmt)`, quantized
    ENCODE_ROWS rows at a time (whole blocks of 16: each chunk fills a consecutive range of every segment), so
    that encoding the output matrix of a large vocabulary needs a chunk's fp32 copy, not the matrix's."""
    parts = [tuple(w.shape)]
    out = np.zeros(encoded_bytes(parts, fmt), np.uint8)
    segs = layout(parts, fmt)
    for r0 in range(0, w.shape[0], ENCODE_ROWS):
        chunk = w[r0:r0 + ENCODE_ROWS].float()
        q = quantize_mxfp4(chunk) if fmt.mx else quantize(chunk, fmt)
        for seg in segs:
            per_block = seg.nbytes // seg.shape[0]
            src = q[seg.role].contiguous().view(torch.uint8).view(-1).numpy()
            at = seg.offset + r0 // BLOCK * per_block
            out[at:at + src.size] = src
    return out


def decode_into(buf: torch.Tensor, parts: list[tuple[int, ...]], fmt: ExpertFormat, dsts) -> None:
    """Dequantise one blob (buf: uint8 [blob]) into the destination tensors, one per part
    (fp32 or any float dtype, any device; `None` entries are skipped). torch ops: the reference
    of the compiled kernel.decode_blob, and the disk store's path for slots that are not fp32
    CPU tensors."""
    views: dict[int, dict[str, torch.Tensor]] = {}
    for seg in layout(parts, fmt):
        views.setdefault(seg.part, {})[seg.role] = buf[seg.offset:seg.offset + seg.nbytes].view(seg.dtype) \
            .view(seg.shape)
    for i, (dst, shape) in enumerate(zip(dsts, parts)):
        if dst is None:
            continue
        v = views[i]
        if "raw" in v:
            dst.copy_(v["raw"])
        elif fmt.mx:
            dst.copy_(dequantize_mxfp4(v["codes"], v["scales"], *shape))
        else:
            dst.copy_(dequantize(v["codes"], v["scales"], v.get("mins"), fmt, *shape))


def decode_plan(parts: list[tuple[int, ...]], fmt: ExpertFormat) -> np.ndarray:
    """How the compiled decoder (kernel.decode_blob) reads a blob in `fmt`: int64 [parts,
    PLAN_COLUMNS], one row per part (its encoding, segment offsets, rows, columns, group size)."""
    raw = {torch.float32: kernel.RAW_F32, torch.float16: kernel.RAW_F16, torch.bfloat16: kernel.RAW_BF16}
    plan = np.full((len(parts), kernel.PLAN_COLUMNS), -1, np.int64)
    for seg in layout(parts, fmt):
        row, shape = plan[seg.part], parts[seg.part]
        row[kernel.ROWS], row[kernel.COLS] = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        if seg.role == "raw":
            row[kernel.ENCODING], row[kernel.VALUES] = raw[seg.dtype], seg.offset
        elif seg.role == "codes":
            row[kernel.ENCODING] = kernel.MXFP4 if fmt.mx else kernel.INT4 if fmt.bits == 4 else kernel.INT8
            row[kernel.VALUES], row[kernel.GROUP] = seg.offset, fmt.group_size
        else:
            row[kernel.SCALES if seg.role == "scales" else kernel.MINS] = seg.offset
    return plan


def roundtrip(w: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """w as `fmt` stores it: the weights a store in that format serves (float32 for integer formats,
    as a fetch dequantises them; w's dtype otherwise)."""
    if not fmt.quantized:
        return w.to(FLOAT_DTYPES[fmt.dtype]).to(w.dtype)
    if fmt.mx:
        if w.dim() == 1:
            return w
        q = quantize_mxfp4(w)
        return dequantize_mxfp4(q["codes"], q["scales"], *w.shape)
    if w.dim() == 1:
        return w.half().to(w.dtype)
    q = quantize(w, fmt)
    return dequantize(q["codes"], q["scales"], q.get("mins"), fmt, *w.shape)


def error_bound(w: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """Per element, the most a round trip through `fmt` may move w [rows, cols]: half a
    quantization step of its group (plus fp16 rounding of the scale and minimum)."""
    if not fmt.quantized or w.dim() == 1:
        return w.abs() * 2 ** -8 + 1e-7  # fp16's / bf16's rounding, generously
    if fmt.mx:
        return mxfp4_error_bound(w)
    rows, cols = w.shape
    g, levels = fmt.group_size, 2 ** fmt.bits - 1
    n_groups = _groups(cols, g)
    x = torch.nn.functional.pad(w.float(), (0, n_groups * g - cols)).view(rows, n_groups, g)
    span = x.amax(-1) - x.amin(-1) if fmt.scheme == "asym" else 2 * x.abs().amax(-1)
    step = span / (levels if fmt.scheme == "asym" else levels - 1)
    # fp16 scales and minimums: a relative 2^-11, or a 2^-24 spacing when subnormal, times up to `levels` codes
    bound = 0.5 * step * 1.01 + x.abs().amax(-1) * 2 ** -10 + levels * 2 ** -23 + 1e-7
    return bound[..., None].expand(rows, n_groups, g).reshape(rows, -1)[:, :cols]


SMALL_FORMAT = ExpertFormat.parse("int4", 32)  # the low-precision copies `lowbit` policies fetch
