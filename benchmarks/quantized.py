"""Quantized experts on the built-in model: per format, bytes per expert, fetch latency (O_DIRECT
read + dequantisation into an fp32 slot), perplexity against fp16 with a paired bootstrap CI,
greedy agreement with fp16, and decode / teacher-forced ms/token on the disk store at 25% and
100% cache; and torch's weight-only int8/int4 kernels at batch 1 against fp32 GEMV.

    python benchmarks/quantized.py [--tokens 4096] [--context 512] [--skip-timing] [--json out.json]

--slots: the fast tier's slot formats at equal bytes (a 25% cache of fp16 slots): fp32, fp16, int8 and
int4 slots (the store fp16 for the float slots, int8 / int4 g32 for the quantized ones), fetch-all,
and each format's all-resident floor; --slot-policies adds policies timed on the int4 slots. --model and
--cache run it on another checkpoint; --slot-variants picks the formats; --rounds repeats them, in reverse
order every other round, for medians over rounds where the disk drifts between formats.

    python benchmarks/quantized.py --slots [--repeats 3] [--slot-policies threshold:tau=0.05] [--json out.json]
    python benchmarks/quantized.py --slots --model build/q30b --slot-variants fp16 int4 --rounds 3 \
        --slot-policies "threshold:tau=0.15,beta=0.5,eviction=demand"
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from expertcache.cli import run_script
from expertcache.choices import BUILTIN_MODEL
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.experts import SWIGLU, CompiledExperts
from expertcache.engine.generate import generate
from expertcache.engine.perplexity import EVAL_TEXT, perplexity
from expertcache.engine.quant import ExpertFormat, decode_plan, encode, encoded_bytes
from expertcache.engine.stores import (
    DiskStore,
    ExpertShape,
    convert_to_disk,
    format_store_dir,
)
from expertcache.lab.bench import FLOOR, BenchConfig, run_bench
from expertcache.lab.study import paired_increase
from expertcache.models import model_args

FORMATS = {"fp16": None, "bf16": ExpertFormat.parse("bf16"), "int8-g32": ExpertFormat.parse("int8", 32),
           "int4-g32": ExpertFormat.parse("int4", 32), "int4-g32-sym": ExpertFormat.parse("int4", 32, "sym"),
           "int4-g64": ExpertFormat.parse("int4", 64)}


def block_means(token_nll: np.ndarray, block: int = 64) -> list[float]:
    n = len(token_nll) // block * block
    return token_nll[:n].reshape(-1, block).mean(1).tolist()


def fetch_latency(engine: Engine, fmt, reads: int = 300) -> dict:
    """Median microseconds of one read_into (O_DIRECT read + dequantisation) into fp32 slot tensors."""
    ckpt, args = engine.checkpoint, engine.args
    path = format_store_dir(ckpt, fmt)
    if not (path / "experts.json").exists():
        convert_to_disk(ckpt, args, path, fmt=fmt)
    store = DiskStore(path, args)
    slot = [torch.empty(p) for p in store.shape.parts]
    rng = random.Random(0)
    times = []
    for _ in range(reads):
        layer, e = rng.randrange(args.num_layers), rng.randrange(args.num_experts)
        t0 = time.perf_counter()
        store.read_into(layer, e, *slot)
        times.append(time.perf_counter() - t0)
    read_only = []
    for _ in range(reads):
        layer, e = rng.randrange(args.num_layers), rng.randrange(args.num_experts)
        t0 = time.perf_counter()
        store._read(layer, e)
        read_only.append(time.perf_counter() - t0)
    store.close()
    return {"bytes": store.blob, "fetch_us": 1e6 * statistics.median(times),
            "read_us": 1e6 * statistics.median(read_only)}


def packed_kernels(rows: int, cols: int, repeats: int = 200) -> dict:
    """Median ms of y = x W^T at batch 1: fp32 GEMV, `_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`."""
    w, x = torch.randn(rows, cols), torch.randn(1, cols)
    scales = w.abs().amax(1) / 127
    w8 = (w / scales[:, None]).round().to(torch.int8)
    out = {}

    def timed(name, f):
        f()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(ts)

    timed("fp32", lambda: torch.nn.functional.linear(x, w))
    timed("int8pack", lambda: torch._weight_int8pack_mm(x, w8, scales))
    try:
        q = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.randn(cols // 32, rows, 2)
        timed("int4pack", lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz))
    except (RuntimeError, AttributeError) as e:
        out["int4pack"] = f"unavailable: {e}"
    return out


LOWBIT_POLICIES = ("fetch-all", "threshold:tau=0.15", "first-choice", "substitute-all", "lowbit:tau=0.15",
                   "lowbit:tau=0.15,lo=0.03", "lowbit:tau=0.5,lo=0.05", "lowbit:tau=1", "lowbit:tau=0.15,upgrade=1",
                   "lowbit:tau=1,upgrade=1")


def lowbit_quality(tokens: int, context: int, cache: float = 0.25) -> dict:
    """Per policy at `cache` on the disk store (fp16 full copies, int4 small ones): perplexity increase
    over fetch-all with a paired bootstrap CI over 64-token blocks, and KiB fetched per token."""
    eng = Engine(None, EngineConfig(store="disk", cache=CacheConfig(fraction=cache)))
    ids = eng.encode(EVAL_TEXT.read_text(encoding="utf-8"))[:tokens + 1]
    out, base = {}, None
    for spec in LOWBIT_POLICIES:
        eng.set_policy(spec)
        r = perplexity(eng, ids, context)
        s = eng.stats
        base = base or r
        out[spec] = {"ppl": r.ppl, "increase": paired_increase(block_means(base.token_nll),
                                                              block_means(r.token_nll), 2000, 0),
                     "kib_per_token": s.fetched_bytes_per_token / 1024,
                     "full_fetches_per_token": s.sync_fetches / s.tokens,
                     "lowbit_fetches_per_token": s.lowbit_fetches / s.tokens,
                     "substituted_per_token": s.substitutions / s.tokens}
    eng.close()
    return out


SLOT_VARIANTS = {"fp32": None, "fp16": None, "int8": ExpertFormat.parse("int8", 32),
                 "int4": ExpertFormat.parse("int4", 32)}  # slot dtype -> the store's format (None: fp16)


def slot_kernel_us(calls: int = 3000) -> dict:
    """Median microseconds of decode's compiled expert call (one token, k=8) per slot format, over slots
    of every expert of the built-in model's shape (768 experts: 90 MiB at fp32, so each call streams
    its experts from memory), random distinct slots per call, random weights."""
    S, F, H, k = 768, 64, 160, 8
    shape = ExpertShape(1, S, (2 * F, H), (H, F))
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(S, 2 * F, H, generator=g) * 0.1, torch.randn(S, H, F, generator=g) * 0.1
    x, gates = torch.randn(1, H, generator=g), np.full(k, 1 / k, np.float32)
    kernels = {"fp32": CompiledExperts.of_floats(w13, w2, None, None, SWIGLU),
               "fp16": CompiledExperts.of_floats(w13.half(), w2.half(), None, None, SWIGLU)}
    for name, fmt in SLOT_VARIANTS.items():
        if fmt is not None:
            n = encoded_bytes(shape.parts, fmt)
            blobs = torch.stack([torch.frombuffer(bytearray(encode([w13[s], w2[s]], shape.parts, fmt, n)),
                                                  dtype=torch.uint8) for s in range(S)])
            kernels[name] = CompiledExperts.of_blobs(blobs, decode_plan(shape.parts, fmt), SWIGLU)
    rng, times = np.random.default_rng(0), {name: [] for name in kernels}
    for f in kernels.values():
        f(x, np.arange(k, dtype=np.int64), gates)  # compiled before timing
    for _ in range(calls):  # formats interleaved, so load from other jobs falls on all of them alike
        slots = rng.choice(S, k, replace=False).astype(np.int64)
        for name, f in kernels.items():
            t0 = time.perf_counter()
            f(x, slots, gates)
            times[name].append(time.perf_counter() - t0)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def slot_formats(repeats: int, forced: int, decode: int, policies: tuple[str, ...] = (), model: Path | None = None,
                 fraction: float = 0.25, variants: tuple[str, ...] = tuple(SLOT_VARIANTS), rounds: int = 1) -> dict:
    """Per slot dtype at the bytes of a `fraction` cache of fp16 slots: experts per layer, hit rate, fetch-all's
    decode and teacher-forced ms/token and perplexity, and the all-resident floor's ms/token (None where it does
    not fit in memory); `policies` (besides fetch-all) timed on the int4 slots too, in the same bench run, as
    "int4 POLICY" rows. Over `rounds`, medians of each round's medians, and each round's figures."""
    args = model_args(open_checkpoint(model or BUILTIN_MODEL).config)
    shape = ExpertShape.of(args)
    size = int(round(fraction * shape.num_experts)) * shape.num_layers * shape.numel * 2  # fp16 slots' bytes
    routed = args.top_k * shape.num_layers
    out = {"cache_bytes": size, "rounds": []}
    if model is None:
        out["kernel_us"] = slot_kernel_us()
        print(f"kernel us per token and layer {out['kernel_us']}", file=sys.stderr, flush=True)
    for r in range(rounds):
        row = {}
        for slot in (variants if r % 2 == 0 else variants[::-1]):
            extra = policies if slot == "int4" else ()
            b = run_bench(model, BenchConfig(store="disk", store_format=SLOT_VARIANTS[slot], slot_dtype=slot,
                                             cache_bytes=size, policies=("fetch-all", *extra), decode_tokens=decode,
                                             forced_tokens=forced, repeats=repeats))
            s = b.summary()
            for policy in extra:
                row[f"int4 {policy}"] = {"ppl": s[policy]["ppl"], "decode_ms": s[policy]["decode_ms"],
                                         "forced_ms": s[policy]["forced_ms"],
                                         "fetches_per_token": s[policy]["fetches_per_token"]}
                print(f"round {r} int4 {policy} {row[f'int4 {policy}']}", file=sys.stderr, flush=True)
            floor = s.get(FLOOR, {})
            row[slot] = {"experts_per_layer": b.config["slots_per_layer"],
                         "hit_rate": 1 - s["fetch-all"]["fetches_per_token"] / routed, "ppl": s["fetch-all"]["ppl"],
                         "decode_ms": s["fetch-all"]["decode_ms"], "forced_ms": s["fetch-all"]["forced_ms"],
                         "floor_decode_ms": floor.get("decode_ms"), "floor_forced_ms": floor.get("forced_ms")}
            print(f"round {r} {slot} {row[slot]}", file=sys.stderr, flush=True)
        out["rounds"].append(row)
    for name in out["rounds"][0]:
        rows = [row[name] for row in out["rounds"]]
        out[name] = {k: statistics.median(v) if all(isinstance(x, (int, float)) for x in v) else v[0]
                     for k in rows[0] for v in [[row[k] for row in rows]]}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--greedy", type=int, default=64)
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--lowbit-only", action="store_true", help="only the lowbit policies' quality and bytes")
    p.add_argument("--slots", action="store_true", help="only the slot formats at equal fast-tier bytes")
    p.add_argument("--slot-policies", nargs="*", default=[], help="--slots: policies timed on int4 slots too")
    p.add_argument("--model", type=Path, default=None, help="--slots: a checkpoint folder (default: the built-in)")
    p.add_argument("--cache", type=float, default=0.25, help="--slots: the cache, as a fraction of fp16 experts")
    p.add_argument("--slot-variants", nargs="+", choices=list(SLOT_VARIANTS), default=list(SLOT_VARIANTS))
    p.add_argument("--rounds", type=int, default=1, help="--slots: the formats' runs, alternating their order")
    p.add_argument("--forced-tokens", type=int, default=1024, help="--slots: teacher-forced tokens a run")
    a = p.parse_args()
    if a.slots:
        res = slot_formats(a.repeats, a.forced_tokens, 32, tuple(a.slot_policies), a.model, a.cache,
                           tuple(a.slot_variants), a.rounds)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1))
        return 0
    if a.lowbit_only:
        res = lowbit_quality(a.tokens, a.context)
        print(json.dumps(res, indent=1))
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    res = {"kernels": {f"{r}x{c}": packed_kernels(r, c) for r, c in ((128, 160), (160, 64), (2048, 1536))}}
    log(f"kernels {res['kernels']}")
    rows, base, base_gen = {}, None, None
    for name, fmt in FORMATS.items():
        eng = Engine(None, EngineConfig(store="ram", store_format=fmt, cache=CacheConfig(fraction=1.0)))
        ids = eng.encode(EVAL_TEXT.read_text(encoding="utf-8"))[:a.tokens + 1]
        r = perplexity(eng, ids, a.context)
        gen = list(generate(eng, ids[:32], a.greedy))
        row = {"ppl": r.ppl, **fetch_latency(eng, fmt)}
        if base is None:
            base, base_gen = r, gen
        else:
            row["increase"] = paired_increase(block_means(base.token_nll), block_means(r.token_nll), 2000, 0)
        first_diff = next((i for i, (x, y) in enumerate(zip(gen, base_gen)) if x != y), len(gen))
        row["greedy_match"] = sum(x == y for x, y in zip(gen, base_gen)) / len(gen)
        row["greedy_prefix"] = first_diff
        eng.close()
        if not a.skip_timing:
            b = run_bench(None, BenchConfig(store="disk", store_format=fmt, policies=("fetch-all",),
                                            decode_tokens=32, forced_tokens=512, repeats=a.repeats))
            s = b.summary()
            row |= {"decode_ms_25": s["fetch-all"]["decode_ms"], "forced_ms_25": s["fetch-all"]["forced_ms"],
                    "decode_ms_100": s[FLOOR]["decode_ms"], "forced_ms_100": s[FLOOR]["forced_ms"]}
        rows[name] = row
        log(f"{name} {row}")
    res["formats"] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    run_script(main)
