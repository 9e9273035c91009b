"""Real expert sizes: the engine against llama.cpp in each weight format, every expert resident, decode and
prefill, with the memory-bandwidth floor measured in the same run.

    python benchmarks/realscale.py --llama-cpp LLAMA_CPP_DIR [--model build/qwen3-30b-shape] [--rounds 3]
        [--tokens 32] [--prompt-tokens 256] [--threads N] [--json OUT]

Writes the Qwen3-30B-A3B-shaped checkpoint (benchmarks/make_checkpoint.py, 4 layers) where --model has none,
converts it to GGUF F16, Q8_0 (llama.cpp's converter from LLAMA_CPP_DIR, the llama-cpp-python sdist's
vendor/llama.cpp, through benchmarks/to_gguf.py) and Q4_0 (llama.cpp's quantizer) beside it, then runs, each in
a process of its own and the formats' variants alternated round by round:

- the engine with every expert resident in fast-tier slots of the format (fp16 slots from the checkpoint's
  fp16; bf16, int8, int4 group-32 or mxfp4 slots from a disk store of that format) and its dense weights in
  the same format (`--dense-dtype`; int8 beside mxfp4 experts, as llama.cpp's MXFP4_MOE keeps Q8_0);
- llama.cpp (llama-cpp-python, `pip install llama-cpp-python`; built here from its sdist with AMX off, whose
  native build crashed in this VM) on the GGUF of the same bits per weight: F16, BF16, Q8_0, Q4_0, MXFP4_MOE.

Both decode the same evaluation text token by token (a random model's greedy output loops) and evaluate a
prompt of --prompt-tokens tokens, computing the last position's logits (a prefill). The bandwidth floor
of a format is the bytes of weights one decode token reads (its k experts in every MoE layer, the attention
and output matrices, the router) over the machine's read bandwidth, measured as a sum over a 1 GiB array on
every thread. Medians over the rounds; ratios within this run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from expertcache.cli import run_script

HERE = Path(__file__).resolve().parent
# ours -> (the GGUF type of the same bits per weight, the disk store's format (None: the checkpoint's fp16), the
# engine's dense weights); the slots are the store's format. llama.cpp's MXFP4_MOE keeps its dense tensors in Q8_0.
FORMATS = {"fp16": ("f16", None, "auto"), "bf16": ("bf16", "bf16", "bf16"), "int8": ("q8_0", "int8", "int8"),
           "int4": ("q4_0", "int4", "int4"), "mxfp4": ("mxfp4_moe", "mxfp4", "int8")}
CONVERTED = ("f16", "bf16", "q8_0")  # by llama.cpp's converter; the others by its quantizer from the F16 file
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "mxfp4_moe": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE"}


def text_ids(model: str, n: int) -> list[int]:
    """The first n token ids of the evaluation text, by the checkpoint's tokenizer (every variant reads these)."""
    from tokenizers import Tokenizer

    from expertcache.engine.perplexity import EVAL_TEXT
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return tok.encode(EVAL_TEXT.read_text(encoding="utf-8")[:60000]).ids[:n]


def timed_decode(step, ids: list[int], warmup: int) -> list[float]:
    """Seconds of each decode step after `warmup` untimed ones."""
    times = []
    for i, tok in enumerate(ids):
        t = time.perf_counter()
        step(tok, i)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def run_engine(a, fmt: str) -> dict:
    import numba
    import numpy as np
    import torch

    from expertcache.engine.cache import CacheConfig
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.quant import ExpertFormat
    from expertcache.engine.threads import describe
    _, stored, dense = FORMATS[fmt]
    numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))  # as llama.cpp's n_threads
    engine = Engine(a.model, EngineConfig(store="disk", cache=CacheConfig(fraction=1.0), initial="cold",
                                          store_format=ExpertFormat.parse(stored, 32) if stored else None,
                                          slot_dtype=stored or "auto", dense_dtype=dense,
                                          max_seq=a.prompt_tokens + a.tokens + 8))
    L, E = engine.args.num_moe_layers, engine.args.num_experts
    engine.cache.warm(np.ones((L, E)))  # every expert resident: the floor of the format
    ids = text_ids(a.model, a.prompt_tokens + a.tokens + 8)
    prompt = torch.tensor(ids[:a.prompt_tokens])
    prefill = []
    for _ in range(3):  # the first warms up
        t = time.perf_counter()
        engine.forward(prompt, 0, last=True)
        prefill.append((time.perf_counter() - t) / len(prompt))
    engine.forward(torch.tensor(ids[:4]), 0)
    times = timed_decode(lambda tok, i: engine.forward(torch.tensor([tok]), 4 + i), ids[4:4 + a.tokens + 4], 4)
    b = engine.budget()
    k = engine.args.top_k
    embed = engine.model.embed.nbytes
    read = L * k * b["expert_bytes_fast"] + b["dense_bytes"] - embed  # one token: its experts, every dense matrix
    return {"decode_ms": 1000 * statistics.median(times), "prefill_ms": 1000 * statistics.median(prefill[1:]),
            "weight_bytes_per_token": read, "kernels": describe(), "fetches": engine.stats.sync_fetches}


def run_llama(a, fmt: str) -> dict:
    import numpy as np
    from llama_cpp import Llama
    gguf = Path(a.model).with_name(f"{Path(a.model).name}-{FORMATS[fmt][0]}.gguf")
    llm = Llama(model_path=str(gguf), n_ctx=a.prompt_tokens + a.tokens + 16, n_threads=a.threads,
                n_threads_batch=a.threads, n_batch=512, verbose=False)
    ids = text_ids(a.model, a.prompt_tokens + a.tokens + 8)
    prefill = []
    for _ in range(3):  # the first warms up (and brings every weight into the page cache)
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids[:a.prompt_tokens])
        prefill.append((time.perf_counter() - t) / a.prompt_tokens)
    llm.reset()
    llm.eval(ids[:4])
    vocab = llm.n_vocab()

    def step(tok, i):
        llm.eval([tok])
        np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax()  # as the engine, read the logits
    times = timed_decode(step, ids[4:4 + a.tokens + 4], 4)
    return {"decode_ms": 1000 * statistics.median(times), "prefill_ms": 1000 * statistics.median(prefill[1:]),
            "gguf_bytes": gguf.stat().st_size}


def bandwidth(a) -> dict:
    """Read bandwidth of this machine: a float32 sum over a 1 GiB array split over every thread, best of 5."""
    import numpy as np
    from numba import njit, prange

    @njit(fastmath=True)
    def part_sum(x):  # a loop of its own: inside a prange body numba left it unvectorised (11 GB/s, not 31)
        s = np.float32(0)
        for i in range(x.shape[0]):
            s += x[i]
        return s

    @njit(parallel=True)
    def total(x, parts, out):
        n = x.shape[0]
        for p in prange(parts):
            out[p] = part_sum(x[n * p // parts:n * (p + 1) // parts])
    x = np.ones(2 ** 28, np.float32)
    out = np.zeros(a.threads, np.float32)
    total(x, a.threads, out)
    best = min(_seconds(lambda: total(x, a.threads, out)) for _ in range(5))
    return {"GB_per_s": x.nbytes / best / 1e9}


def _seconds(run) -> float:
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def prepare(a) -> None:
    """The checkpoint and its GGUF files, made where missing."""
    model = Path(a.model)
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_checkpoint.py"), "--out", str(model), "--layers", "4"],
                       check=True)
    for fmt in a.formats + ["fp16"]:  # the quantizer starts from the F16 file
        gguf_type = FORMATS[fmt][0]
        gguf = model.with_name(f"{model.name}-{gguf_type}.gguf")
        if gguf.exists():
            continue
        if gguf_type in CONVERTED:
            if a.llama_cpp is None:
                sys.exit(f"{gguf} is missing: give --llama-cpp (the llama-cpp-python sdist's vendor/llama.cpp)")
            subprocess.run([sys.executable, str(HERE / "to_gguf.py"), str(a.llama_cpp), str(model), str(gguf),
                            "--outtype", gguf_type], check=True)
        else:  # llama.cpp's quantizer, from the F16 file
            import ctypes

            import llama_cpp
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = getattr(llama_cpp, QUANTIZED[gguf_type]), a.threads
            f16 = model.with_name(f"{model.name}-f16.gguf")
            if llama_cpp.llama_model_quantize(str(f16).encode(), str(gguf).encode(), ctypes.byref(params)):
                sys.exit(f"llama.cpp could not quantize {f16} to {gguf_type.upper()}")


VARIANTS = {"engine": run_engine, "llama.cpp": run_llama}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/qwen3-30b-shape")
    p.add_argument("--llama-cpp", type=Path, default=None, help="the llama-cpp-python sdist's vendor/llama.cpp")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS),
                   help="formats compared (default: all); F16 GGUF is written whatever is asked, the quantizer's source")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child process: runtime:format
    a = p.parse_args()
    if a.variant:
        name, fmt = a.variant.split(":")
        print(json.dumps(bandwidth(a) if name == "bandwidth" else VARIANTS[name](a, fmt)))
        return
    prepare(a)
    runs: dict[str, list[dict]] = {}
    order = ["bandwidth:-"] + [f"{r}:{f}" for f in a.formats for r in VARIANTS]
    for round_ in range(a.rounds):
        for variant in order:
            cmd = [sys.executable, __file__, "--variant", variant, "--model", a.model, "--tokens", str(a.tokens),
                   "--prompt-tokens", str(a.prompt_tokens), "--threads", str(a.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(f"{variant}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
                continue
            runs.setdefault(variant, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)

    def med(variant: str, key: str) -> float:
        values = [r[key] for r in runs.get(variant, []) if key in r]
        return statistics.median(values) if values else float("nan")
    gbps = med("bandwidth:-", "GB_per_s")
    print(f"every expert resident, {a.threads} threads, {platform.processor() or platform.machine()}; medians of "
          f"{a.rounds} rounds; decode of {a.tokens} text tokens, prefill of {a.prompt_tokens}; read bandwidth "
          f"{gbps:.1f} GB/s\n")
    print("| format (engine / llama.cpp) | engine decode ms/token | llama.cpp | engine / llama.cpp | "
          "bandwidth floor ms | engine / floor | llama.cpp / floor | engine prefill ms/token | llama.cpp | "
          "engine / llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    table = {}
    for fmt in a.formats:
        e, ll = f"engine:{fmt}", f"llama.cpp:{fmt}"
        floor = med(e, "weight_bytes_per_token") / (gbps * 1e9) * 1000
        row = {"engine_decode_ms": med(e, "decode_ms"), "llama_decode_ms": med(ll, "decode_ms"), "floor_ms": floor,
               "engine_prefill_ms": med(e, "prefill_ms"), "llama_prefill_ms": med(ll, "prefill_ms")}
        table[fmt] = row
        dense = FORMATS[fmt][2]
        parts = "slots and dense" if dense in (fmt, "auto") else f"slots, {dense} dense"
        print(f"| {fmt} {parts} / {FORMATS[fmt][0].upper()} | {row['engine_decode_ms']:.2f} | "
              f"{row['llama_decode_ms']:.2f} | {row['engine_decode_ms'] / row['llama_decode_ms']:.2f}x | {floor:.2f} | "
              f"{row['engine_decode_ms'] / floor:.2f}x | {row['llama_decode_ms'] / floor:.2f}x | "
              f"{row['engine_prefill_ms']:.3f} | {row['llama_prefill_ms']:.3f} | "
              f"{row['engine_prefill_ms'] / row['llama_prefill_ms']:.2f}x |")
    kernels = next((r["kernels"] for v in runs for r in runs[v] if "kernels" in r), "")
    print(f"\nengine kernels: {kernels}")
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "table": table, "GB_per_s": gbps, "threads": a.threads,
                                      "kernels": kernels}, indent=1))


if __name__ == "__main__":
    run_script(main)
