"""The engine against llama.cpp at equal memory: each runs in a memory cgroup capped at its own baseline plus the
same extra bytes (the dense weights and 10%, 25% or 50% of the experts, in 4 bits), its experts on the disk,
prefills the same prompt (`--prompt-tokens`, one batch) and decodes the same text token by token.

    sudo python benchmarks/memory_cap.py [--model build/qwen3-30b-shape] [--fractions 0.1 0.25 0.5]
        [--policies fetch-all threshold:tau=0.15] [--quota layer] [--prompt-tokens 256] [--tokens 32]
        [--context N] [--rounds 2] [--json OUT]

The extra bytes are those of llama.cpp's Q4_0 file: its dense tensors plus the fraction of its experts (18
bytes a block of 32 weights). llama.cpp maps the file (mmap), so that the page cache is its expert cache, with
the disk's read-ahead set to Linux's default of 128 KiB for its runs (reported; restored after), and without
its repacking of Q4_0 into its AVX-512 layout (`use_extra_bufts` off), which copies every weight out of the
mapped file into the process's own memory: under any of these caps that run is killed; the engine
reads its int4 disk store with O_DIRECT into int4 slots, its dense weights int4 too, its cache sized by
`--memory-budget` set to the extra bytes. A baseline is the process's peak before any weight: llama.cpp's
after importing its bindings, the engine's after its imports and a forward of the built-in model (its compiled
kernels loaded), each measured in a cgroup of its own. The page cache is dropped before every run. Reported per
cap: the prompt's prefill time per token, ms/token (median of the decode steps, rounds alternated), the cgroup's
peak charge (resident memory and page
cache), whether the OOM killer ended the run, the engine's hit rate, and bytes read from the disk per token
(the process's read_bytes). Needs root (cgroups, drop_caches, read-ahead); `expertcache.lab.cgroup`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from expertcache.cli import run_script

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from expertcache.lab.cgroup import drop_page_cache, read_ahead_kb, run_capped, unavailable  # noqa: E402


def read_bytes() -> int:
    """Bytes this process has read from storage so far (page-cache misses included, mmap faults too)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def text_ids(model: str, n: int) -> list[int]:
    from tokenizers import Tokenizer

    from expertcache.engine.perplexity import EVAL_TEXT
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return tok.encode(EVAL_TEXT.read_text(encoding="utf-8")[:40000]).ids[:n]


def context(a) -> int:
    """Positions of keys and values both runtimes are made for: llama.cpp's n_ctx, the engine's max_seq."""
    return a.context or max(a.tokens, a.prompt_tokens) + 16


def child_engine(a) -> dict:
    import torch

    from expertcache.engine.cache import CacheConfig
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.generate import prefill
    from expertcache.engine.quant import ExpertFormat
    ids = text_ids(a.model, max(a.tokens + 8, a.prompt_tokens))
    cache = CacheConfig(quota=a.quota)  # sized by --memory-budget
    engine = Engine(a.model, EngineConfig(store="disk", cache=cache, policy=a.policy,
                                          store_format=ExpertFormat.parse("int4", 32), slot_dtype="int4",
                                          dense_dtype="int4", memory_budget=a.budget,
                                          max_seq=context(a)))
    prompt = {}
    if a.prompt_tokens:  # the prompt, then decode from a fresh start
        start = time.perf_counter()
        prefill(engine, ids[:a.prompt_tokens])
        prompt = {"prefill_ms_per_token": 1000 * (time.perf_counter() - start) / a.prompt_tokens}
        engine.reset()
    before = read_bytes()
    times = []
    for pos, tok in enumerate(ids[:a.tokens + 4]):
        t = time.perf_counter()
        engine.forward(torch.tensor([tok]), pos)
        if pos >= 4:
            times.append(time.perf_counter() - t)
    s = engine.stats
    return {**prompt, "ms_per_token": 1000 * statistics.median(times), "hit_rate": s.hit_rate,
            "disk_bytes_per_token": (read_bytes() - before) / len(ids[:a.tokens + 4]),
            "fetched_bytes_per_token": s.fetched_bytes_per_token, "slots_per_layer": engine.cache.per_layer,
            "experts": engine.args.num_experts}


def child_llama(a) -> dict:
    import llama_cpp.llama_cpp as bindings
    import numpy as np
    from llama_cpp import Llama
    default = bindings.llama_model_default_params

    def params():  # no repacking into llama.cpp's AVX-512 layout: it copies every weight out of the mapped file
        p = default()
        p.use_extra_bufts = False
        return p
    bindings.llama_model_default_params = params
    gguf = Path(a.model).with_name(f"{Path(a.model).name}-q4_0.gguf")
    llm = Llama(model_path=str(gguf), n_ctx=context(a), n_batch=max(a.prompt_tokens, 8),
                n_threads=os.cpu_count(), n_threads_batch=os.cpu_count(), use_mmap=True, verbose=False)
    ids = text_ids(a.model, max(a.tokens + 8, a.prompt_tokens))
    vocab = llm.n_vocab()
    prompt = {}
    if a.prompt_tokens:
        start = time.perf_counter()
        llm.eval(ids[:a.prompt_tokens])
        prompt = {"prefill_ms_per_token": 1000 * (time.perf_counter() - start) / a.prompt_tokens}
        llm.reset()
    before = read_bytes()
    times = []
    for pos, tok in enumerate(ids[:a.tokens + 4]):
        t = time.perf_counter()
        llm.eval([tok])
        np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax()
        if pos >= 4:
            times.append(time.perf_counter() - t)
    return {**prompt, "ms_per_token": 1000 * statistics.median(times),
            "disk_bytes_per_token": (read_bytes() - before) / len(ids[:a.tokens + 4])}


def child_baseline(a) -> dict:
    """A runtime's process before any weight of the model (see the module's docstring)."""
    if a.runtime == "llama.cpp":
        import llama_cpp  # noqa: F401
    else:
        from expertcache import Engine, EngineConfig, generate
        list(generate(Engine(None, EngineConfig(store="disk", max_seq=16)), [1, 2, 3], 2))
    return {}


def q4_0_sizes(model: str) -> tuple[int, int]:
    """(dense bytes, expert bytes) of the model's Q4_0 GGUF: experts at 18 bytes a block of 32 weights, the rest of
    the file dense."""
    config = json.loads((Path(model) / "config.json").read_text())
    experts = config["num_hidden_layers"] * config["num_experts"] * 3 * config["hidden_size"] * \
        config["moe_intermediate_size"] * 18 // 32
    gguf = Path(model).with_name(f"{Path(model).name}-q4_0.gguf")
    return gguf.stat().st_size - experts, experts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/qwen3-30b-shape")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--policies", nargs="+", default=["fetch-all", "threshold:tau=0.15"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prompt prefilled before decode (0: none)")
    p.add_argument("--context", type=int, default=None,
                   help="positions each runtime holds keys and values for (default: the prompt or the decode, + 16)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quota", default="layer", choices=["layer", "global"],
                   help="the engine's slots each layer's own, or shared by the layers (needs only top-k in all)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--runtime", default=None, help=argparse.SUPPRESS)
    p.add_argument("--policy", default="fetch-all", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps({"engine": child_engine, "llama.cpp": child_llama, "baseline": child_baseline}[a.child](a)))
        return
    if reason := unavailable():
        sys.exit(f"no memory cap can be set here: {reason}")
    dense, experts = q4_0_sizes(a.model)
    model_dir = Path(a.model)
    readahead = read_ahead_kb(model_dir)

    def run(child: str, limit: int | None, extra: list[str]) -> tuple[dict | None, dict]:
        drop_page_cache()
        cmd = [sys.executable, __file__, "--child", child, "--model", a.model, "--tokens", str(a.tokens),
               "--prompt-tokens", str(a.prompt_tokens), "--context", str(context(a)), *extra]
        r = run_capped(cmd, limit, timeout=3600)
        out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
        info = {"peak_bytes": r.peak_bytes, "oom_killed": r.oom_killed, "returncode": r.returncode,
                "error": "" if out is not None else r.stderr.strip().splitlines()[-1:]}
        return out, info
    base = {rt: run("baseline", None, ["--runtime", rt])[1]["peak_bytes"] for rt in ("llama.cpp", "engine")}
    print(f"baselines: llama.cpp {base['llama.cpp'] / 2**20:.0f} MiB, engine {base['engine'] / 2**20:.0f} MiB; "
          f"Q4_0 dense {dense / 2**20:.0f} MiB, experts {experts / 2**20:.0f} MiB; read-ahead was {readahead} KiB",
          file=sys.stderr)
    results: dict[str, list] = {}
    for round_ in range(a.rounds):
        for f in a.fractions:
            extra = int(dense + f * experts)
            variants = [("llama.cpp", "llama.cpp", [])] + [
                (f"engine {pol}", "engine", ["--policy", pol, "--budget", str(extra), "--quota", a.quota])
                for pol in a.policies]
            for name, child, args in variants:
                if child == "llama.cpp" and readahead is not None:
                    read_ahead_kb(model_dir, 128)
                try:
                    out, info = run(child, base[child] + extra, args)
                finally:
                    if child == "llama.cpp" and readahead is not None:
                        read_ahead_kb(model_dir, readahead)
                row = {"fraction": f, "extra_bytes": extra, "cap_bytes": base[child] + extra, **info, **(out or {})}
                results.setdefault(f"{name} @ {f}", []).append(row)
                print(f"round {round_ + 1} {name} at {f:.0%}: {row}", file=sys.stderr, flush=True)
    slots = "shared by the layers (--quota global)" if a.quota == "global" else "each layer its own"
    print(f"\nengine slots: {slots}; "
          f"caps: each runtime's baseline (llama.cpp {base['llama.cpp'] / 2**20:.0f} MiB, engine "
          f"{base['engine'] / 2**20:.0f} MiB) + the Q4_0 dense weights and the share of Q4_0 experts; a prefill of "
          f"{a.prompt_tokens} text tokens, then decode of {a.tokens}, in a context of {context(a)} positions; medians "
          f"of {a.rounds} rounds; llama.cpp at "
          f"read-ahead 128 KiB (the disk's was {readahead} KiB)\n")
    print("| experts in the extra | extra MiB | runtime | prefill ms/token | vs llama.cpp | ms/token | vs llama.cpp | "
          "peak MiB (cap) | OOM-killed | hit rate | MiB read from disk per token |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for f in a.fractions:
        ref = [r["ms_per_token"] for r in results.get(f"llama.cpp @ {f}", []) if "ms_per_token" in r]
        llama_ms = statistics.median(ref) if ref else float("nan")
        ref = [r["prefill_ms_per_token"] for r in results.get(f"llama.cpp @ {f}", []) if "prefill_ms_per_token" in r]
        llama_pp = statistics.median(ref) if ref else float("nan")
        for name in ["llama.cpp"] + [f"engine {pol}" for pol in a.policies]:
            rows = results.get(f"{name} @ {f}", [])
            done = [r for r in rows if "ms_per_token" in r]
            ms = statistics.median(r["ms_per_token"] for r in done) if done else float("nan")
            peak = max((r["peak_bytes"] for r in rows), default=0)
            cap = rows[0]["cap_bytes"] if rows else 0
            hit = statistics.median(r["hit_rate"] for r in done) if done and "hit_rate" in done[0] else None
            disk = statistics.median(r["disk_bytes_per_token"] for r in done) if done else float("nan")
            killed = sum(r["oom_killed"] for r in rows)
            if rows and not done and not killed:  # refused in every round: its one line, not a row of nan
                print(f"| {f:.0%} | {rows[0]['extra_bytes'] / 2**20:.0f} | {name} | refused (exit "
                      f"{rows[-1]['returncode']}): {' '.join(rows[-1]['error'])} |||||||| ")
                continue
            pp = statistics.median(r["prefill_ms_per_token"] for r in done) if done and a.prompt_tokens else \
                float("nan")
            print(f"| {f:.0%} | {rows[0]['extra_bytes'] / 2**20:.0f} | {name} | {pp:.1f} | {llama_pp / pp:.2f}x | "
                  f"{ms:.1f} | "
                  f"{llama_ms / ms if done else float('nan'):.2f}x | {peak / 2**20:.0f} ({cap / 2**20:.0f}) | "
                  f"{killed}/{len(rows)} | {'' if hit is None else f'{hit:.1%}'} | {disk / 2**20:.1f} |")
    if a.json:
        a.json.write_text(json.dumps({"baselines": base, "readahead_kb": readahead, "q4_0_dense_bytes": dense,
                                      "q4_0_expert_bytes": experts, "runs": results}, indent=1))


if __name__ == "__main__":
    run_script(main)
