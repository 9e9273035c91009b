"""A decode token's k experts at Qwen3-30B-A3B's expert shape (hidden 2048, experts of 768, top-8): the engine's
compiled kernel in each fast-tier format against what PyTorch itself offers on this CPU for the same product
(F.linear over fp16 / bf16 weights through oneDNN, and its int8 and int4 weight-only kernels,
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`), each against the bytes it streams over the machine's
read bandwidth.

    python benchmarks/expert_kernels.py [--slots 64] [--tokens 64] [--rounds 3] [--threads N] [--json OUT]

Every variant holds `--slots` experts (more than the last-level cache) and each token picks k of them at
random, the same picks for every variant; medians of the per-token times over the rounds, variants alternated.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from expertcache.cli import run_script

H, FF, K = 2048, 768, 8
UNIQUE = 4  # encoding is slow in Python: 4 distinct experts, copied over the slots (every slot's bytes streamed)


def ours(fmt_name: str, w13: torch.Tensor, w2: torch.Tensor):
    """The engine's compiled experts over slots in `fmt_name`; returns (call, bytes per expert)."""
    from expertcache.engine.experts import SWIGLU, CompiledExperts
    from expertcache.engine.quant import ExpertFormat, decode_plan, encode, encoded_bytes
    if fmt_name in ("fp16", "bf16"):
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt_name]
        a, b = w13.to(dt), w2.to(dt)
        run = CompiledExperts.of_floats(a, b, None, None, SWIGLU)
        return run, run.expert_bytes
    fmt = ExpertFormat.parse(fmt_name, 32)
    parts = [(2 * FF, H), (H, FF)]
    size = encoded_bytes(parts, fmt)
    blobs = [np.frombuffer(encode([w13[s], w2[s]], parts, fmt, size), np.uint8) for s in range(UNIQUE)]
    held = torch.from_numpy(np.stack([blobs[s % UNIQUE] for s in range(w13.shape[0])]))
    run = CompiledExperts.of_blobs(held, decode_plan(parts, fmt), SWIGLU)
    return run, size


def torch_float(dtype: torch.dtype, w13: torch.Tensor, w2: torch.Tensor):
    a, b = w13.to(dtype), w2.to(dtype)

    def run(x, slots, gates):
        xd, out = x.to(dtype), torch.zeros_like(x)
        for s, g in zip(slots.tolist(), gates.tolist()):
            gu = F.linear(xd, a[s])
            out += g * F.linear(F.silu(gu[:, :FF]) * gu[:, FF:], b[s]).float()
        return out
    return run, (a[0].numel() + b[0].numel()) * a.element_size()


def torch_int8(w13: torch.Tensor, w2: torch.Tensor):
    def pack(w):
        scale = w.abs().amax(dim=1) / 127
        return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(torch.bfloat16)
    a = [pack(w) for w in w13]
    b = [pack(w) for w in w2]
    mm = torch.ops.aten._weight_int8pack_mm

    def run(x, slots, gates):
        xd, out = x.to(torch.bfloat16), torch.zeros_like(x)
        for s, g in zip(slots.tolist(), gates.tolist()):
            gu = mm(xd, *a[s])
            out += g * mm(F.silu(gu[:, :FF]) * gu[:, FF:], *b[s]).float()
        return out
    return run, a[0][0].numel() + b[0][0].numel() + 2 * (a[0][1].numel() + b[0][1].numel())


def torch_int4(w13: torch.Tensor, w2: torch.Tensor, group: int = 32):
    def pack(w):
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [k/g, n, 2]
        return packed, sz
    a = [pack(w) for w in w13]
    b = [pack(w) for w in w2]
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu

    def run(x, slots, gates):
        xd, out = x.to(torch.bfloat16), torch.zeros_like(x)
        for s, g in zip(slots.tolist(), gates.tolist()):
            gu = mm(xd, a[s][0], group, a[s][1])
            out += g * mm(F.silu(gu[:, :FF]) * gu[:, FF:], b[s][0], group, b[s][1]).float()
        return out
    return run, (a[0][0].numel() + b[0][0].numel()) * a[0][0].element_size() + \
        2 * (a[0][1].numel() + b[0][1].numel())


def bandwidth(threads: int) -> float:
    """GB/s of a float32 sum over a 1 GiB array split over the threads, best of 5 (realscale.py's measure)."""
    import subprocess
    import sys
    here = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, str(here / "realscale.py"), "--variant", "bandwidth:-", "--threads",
                          str(threads)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["GB_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gbps = bandwidth(a.threads)
    g = torch.Generator().manual_seed(0)
    copies = torch.arange(a.slots) % UNIQUE
    w13 = (torch.randn(UNIQUE, 2 * FF, H, generator=g) * 0.02)[copies]
    w2 = (torch.randn(UNIQUE, H, FF, generator=g) * 0.02)[copies]
    variants = {f"engine {f}": lambda f=f: ours(f, w13, w2) for f in ("fp16", "bf16", "int8", "int4", "mxfp4")}
    variants |= {"torch fp16 (F.linear)": lambda: torch_float(torch.float16, w13, w2),
                 "torch bf16 (F.linear)": lambda: torch_float(torch.bfloat16, w13, w2),
                 "torch int8 (_weight_int8pack_mm)": lambda: torch_int8(w13, w2),
                 "torch int4 g32 (_weight_int4pack_mm_for_cpu)": lambda: torch_int4(w13, w2)}
    ref, _ = torch_float(torch.float32, w13, w2)
    built, failed = {}, {}
    for name, make in variants.items():
        try:
            built[name] = make()
        except Exception as e:  # noqa: BLE001 -- an operator this torch build lacks is reported, not fatal
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"

    rng = np.random.default_rng(1)
    picks = [rng.choice(a.slots, K, replace=False).astype(np.int64) for _ in range(a.tokens + 4)]
    gates = np.full(K, 1 / K, np.float32)
    x = torch.randn(1, H, generator=g)
    want = ref(x, picks[0], gates)
    error = {name: ((run(x, picks[0], gates) - want).abs().max() / want.abs().max()).item()
             for name, (run, _) in built.items()}  # a variant that computes something else shows here
    times: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, (run, _) in built.items():
            for i, slots in enumerate(picks):
                t = time.perf_counter()
                run(x, slots, gates)
                if i >= 4:
                    times.setdefault(name, []).append(time.perf_counter() - t)
    rows = {}
    print(f"a decode token's {K} experts of {H}x{FF} (SwiGLU), {a.slots} experts held, {a.threads} threads; "
          f"read bandwidth {gbps:.1f} GB/s; medians of {a.rounds} x {a.tokens} tokens\n")
    print("| variant | MB per token | ms per token | GB/s streamed | vs floor | max error / max output |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (run, per_expert) in built.items():
        ms = 1000 * statistics.median(times[name])
        mb = K * per_expert / 1e6
        floor = mb / 1e3 / gbps * 1000
        rows[name] = {"ms": ms, "mb_per_token": mb, "floor_ms": floor, "error": error[name]}
        print(f"| {name} | {mb:.1f} | {ms:.3f} | {mb / ms:.1f} | {ms / floor:.2f}x | {error[name]:.1e} |")
    for name, why in failed.items():
        print(f"| {name} | - | not available: {why} | | | |")
    if a.json:
        a.json.write_text(json.dumps({"GB_per_s": gbps, "rows": rows, "failed": failed, "threads": a.threads},
                                     indent=1))


if __name__ == "__main__":
    run_script(main)
