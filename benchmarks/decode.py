"""Decode speed, fetch latency and peak memory: the engine against HF transformers and llama.cpp.

Each variant runs in its own process (so peak memory is its own), decodes the same greedy
tokens after the same prompt, warms up, repeats, and reports the median time per decoded
token; ratios are computed within this one run.

    python benchmarks/decode.py [--model DIR] [--gguf FILE ...] [--llama-threads 1 2] [--tokens 64]
        [--prompt-tokens 256] [--trials 5] [--json OUT]

Besides decoding, each variant that can evaluates a prompt of --prompt-tokens tokens of the
evaluation text in one call, twice: as a prefill, which needs the last position's logits only
(the engine: `forward(..., last=True)`; llama.cpp: `eval`), and as scoring, which needs every
position's (the engine: one teacher-forced window; llama.cpp: `eval` with `logits_all`, as its
perplexity tool runs). Both are reported in ms per prompt token.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from expertcache.cli import run_script

PROMPT = "KING HENRY.\nNow, lords, for France; the enterprise whereof\nShall be to you, as us, like glorious."


def window_ids(a) -> list[int]:
    """--prompt-tokens token ids of the evaluation text, by the checkpoint's tokenizer (every variant gets the same)."""
    from tokenizers import Tokenizer

    from expertcache.engine.perplexity import EVAL_TEXT
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    return tok.encode(EVAL_TEXT.read_text(encoding="utf-8")[:20000]).ids[:a.prompt_tokens]


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_engine(a, store: str, fraction: float) -> dict:
    import torch

    from expertcache.engine.cache import CacheConfig
    from expertcache.engine.engine import Engine, EngineConfig
    base = rss_peak()
    engine = Engine(a.model, EngineConfig(store=store, cache=CacheConfig(fraction=fraction)))
    prompt = engine.encode(PROMPT)
    times = []
    for trial in range(a.trials + 1):  # trial 0 warms up
        engine.reset()
        logits = engine.forward(torch.tensor(prompt), 0)
        tok, pos = int(logits[-1].argmax()), len(prompt)
        fetches0, stall0 = engine.stats.sync_fetches, engine.stats.stall_s
        out = [tok]
        start = time.perf_counter()
        for _ in range(a.tokens):
            logits = engine.forward(torch.tensor([tok]), pos)
            tok, pos = int(logits[-1].argmax()), pos + 1
            out.append(tok)
        if trial:
            times.append((time.perf_counter() - start) / a.tokens)
    s = engine.stats  # the last decode trial's counters, before the prompt timing adds its own
    decode_counts = {"fetches_per_decode_token": (s.sync_fetches - fetches0) / a.tokens,
                     "stall_ms_per_token": 1000 * (s.stall_s - stall0) / a.tokens, "hit_rate": s.hit_rate}
    window, prompt_ms = torch.tensor(window_ids(a)), {}
    for last in (True, False):
        prompt_times = []
        for trial in range(a.trials + 1):
            engine.reset()
            start = time.perf_counter()
            engine.forward(window, 0, last=last)
            if trial:
                prompt_times.append((time.perf_counter() - start) / len(window))
        prompt_ms["prefill_ms_per_token" if last else "scoring_ms_per_token"] = 1000 * statistics.median(prompt_times)
    return {"ms_per_token": 1000 * statistics.median(times), "trials_ms": [1000 * t for t in times], **prompt_ms,
            **decode_counts, "peak_rss": rss_peak(), "rss_before_load": base, "greedy": out, **engine.budget()}


def run_hf(a) -> dict:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    base = rss_peak()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    prompt = torch.tensor([Tokenizer.from_file(str(Path(a.model) / "tokenizer.json")).encode(PROMPT).ids])
    times = []
    for trial in range(a.trials + 1):
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            gen = model.generate(prompt, max_new_tokens=a.tokens + 1, min_new_tokens=a.tokens + 1, do_sample=False)
            t2 = time.perf_counter()
        if trial:
            times.append(((t2 - t1) - (t1 - t0)) / a.tokens)
    return {"ms_per_token": 1000 * statistics.median(times), "trials_ms": [1000 * t for t in times],
            "peak_rss": rss_peak(), "rss_before_load": base, "greedy": gen[0, prompt.shape[1]:].tolist()}


def run_llama(a) -> dict:
    import numpy as np
    from llama_cpp import Llama
    base = rss_peak()
    llm = Llama(model_path=str(a.gguf[0]), n_ctx=512, n_threads=a.llama_threads[0], n_threads_batch=a.llama_threads[0],
                n_batch=512, verbose=False)
    vocab = llm.n_vocab()
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False)
    times = []
    for trial in range(a.trials + 1):
        llm.reset()
        llm.eval(prompt)
        out = []
        start = time.perf_counter()
        for _ in range(a.tokens):
            # without logits_all, Llama.eval keeps no scores: read the last token's logits directly
            tok = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())
            out.append(tok)
            llm.eval([tok])
        if trial:
            times.append((time.perf_counter() - start) / a.tokens)
    window, prompt_ms = window_ids(a), {}
    for every in (False, True):  # llama.cpp computes every position's logits only when built to keep them all
        if every:
            del llm
            llm = Llama(model_path=str(a.gguf[0]), n_ctx=512, n_threads=a.llama_threads[0],
                        n_threads_batch=a.llama_threads[0], n_batch=512, logits_all=True, verbose=False)
        prompt_times = []
        for trial in range(a.trials + 1):
            llm.reset()
            start = time.perf_counter()
            llm.eval(window)
            if trial:
                prompt_times.append((time.perf_counter() - start) / len(window))
        prompt_ms["scoring_ms_per_token" if every else "prefill_ms_per_token"] = 1000 * statistics.median(prompt_times)
    return {"ms_per_token": 1000 * statistics.median(times), "trials_ms": [1000 * t for t in times], **prompt_ms,
            "peak_rss": rss_peak(), "rss_before_load": base, "greedy": out}


def fetch_latency(a) -> dict:
    """Single O_DIRECT reads of random experts from the disk store, one at a time."""
    import numpy as np
    import torch

    from expertcache.engine.checkpoint import open_checkpoint
    from expertcache.engine.stores import open_store
    from expertcache.models import model_args
    ckpt = open_checkpoint(a.model)
    args = model_args(ckpt.config)
    store = open_store("disk", ckpt, args)
    rng = np.random.default_rng(0)
    w13, w2 = torch.empty(store.shape.w13), torch.empty(store.shape.w2)
    us = []
    for i in range(600):
        layer, e = int(rng.integers(args.num_moe_layers)), int(rng.integers(args.num_experts))
        t = time.perf_counter()
        store.read_into(layer, e, w13, w2)
        if i >= 100:
            us.append(1e6 * (time.perf_counter() - t))
    us.sort()
    return {"bytes": store.blob, "median_us": us[len(us) // 2], "p90_us": us[int(0.9 * len(us))],
            "GB_per_s": store.blob / (us[len(us) // 2] * 1e3)}


VARIANTS = {
    "engine ram 100%": lambda a: run_engine(a, "ram", 1.0),
    "engine disk 100%": lambda a: run_engine(a, "disk", 1.0),
    "engine disk 25% fetch-all": lambda a: run_engine(a, "disk", 0.25),
    "HF transformers": run_hf,
    "llama.cpp": run_llama,
    "fetch latency": fetch_latency,
}


def main() -> None:
    from expertcache.engine.engine import BUILTIN_MODEL
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(BUILTIN_MODEL))
    p.add_argument("--gguf", type=Path, nargs="+", default=[], help="the same model as GGUF for llama.cpp "
                   "(one variant per file, e.g. f32 and f16)")
    p.add_argument("--llama-threads", type=int, nargs="+", default=[os.cpu_count()],
                   help="llama.cpp's threads (one variant per count)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # child process
    a = p.parse_args()
    if a.variant:
        print(json.dumps(VARIANTS[a.variant](a)))
        return
    results = {}
    runs = [(name, []) for name in VARIANTS if name != "llama.cpp"]
    runs[-1:-1] = [(f"llama.cpp {g.stem} {n} thread{'s' * (n > 1)}", ["--gguf", str(g), "--llama-threads", str(n)])
                   for g in a.gguf for n in a.llama_threads]  # before the fetch-latency probe
    for name, extra in runs:
        variant = "llama.cpp" if name.startswith("llama.cpp") else name
        cmd = [sys.executable, __file__, "--variant", variant, "--model", a.model, "--tokens", str(a.tokens),
               "--prompt-tokens", str(a.prompt_tokens), "--trials", str(a.trials)] + extra
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: {results[name]}", file=sys.stderr)
    floor = results.get("engine ram 100%", {}).get("ms_per_token")
    print(f"decode {a.tokens} tokens after a {len(PROMPT)}-char prompt, median of {a.trials} trials, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    ref = results.get("engine ram 100%", {}).get("greedy", [])
    engine_ram = results.get("engine ram 100%", {})
    print("| variant | decode ms/token | vs engine ram 100% | prefill ms/token (last logits) | vs engine ram 100% "
          "| scoring ms/token (every logit) | vs engine ram 100% | peak RSS MiB "
          "| greedy tokens equal to the engine's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if "ms_per_token" in r:
            n = min(len(ref), len(r["greedy"]))
            same = sum(x == y for x, y in zip(ref, r["greedy"]))
            cells = []
            for key in ("prefill_ms_per_token", "scoring_ms_per_token"):
                v, base = r.get(key), engine_ram.get(key)
                cells.append(f"{v:.3f} | {v / base:.2f}x" if v and base else "- | -")
            print(f"| {name} | {r['ms_per_token']:.2f} | {r['ms_per_token'] / floor:.2f}x | {' | '.join(cells)} | "
                  f"{r['peak_rss'] / 2**20:.0f} | {same}/{n} |")
    if "fetch latency" in results:
        f = results["fetch latency"]
        print(f"\nO_DIRECT fetch of one expert ({f['bytes']} B): median {f['median_us']:.0f} us, "
              f"p90 {f['p90_us']:.0f} us ({f['GB_per_s']:.2f} GB/s)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_script(main)
