"""Batched decode against one forward per sequence, in the engine (no server): B greedy sequences
with prompts of different lengths from the evaluation text, each with its own KV cache, decode
`--steps` tokens each, either as one batched forward per step (Engine.forward_batch, what
`serve --schedule batch` runs) or as B one-token forwards per step (`--schedule interleave`).
The variants run in alternating trials on the same engine and cache; medians of trials.
`--one-call` adds the batched step with each token's experts run in one call after the layer's last
wait, against as their reads land (the disk store at real expert sizes).

    PYTHONPATH=. python benchmarks/batch_decode.py [--batch 1,4,16] [--steps 16] [--trials 3] [--json OUT]
    PYTHONPATH=. python benchmarks/batch_decode.py --model build/q30b16 --store disk --store-dtype int4 \
        --slot-dtype int4 --dense-dtype int4 --batch 1,4 --one-call
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from expertcache.cli import run_script
from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.generate import TextGeneration, batch_logits
from expertcache.engine.quant import ExpertFormat
from expertcache.engine.sampling import SamplingParams


def sequences(engine: Engine, ids: list[int], B: int, steps: int) -> list[TextGeneration]:
    """B prefilled greedy generations over prompts of 16.. tokens from different places in `ids`."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    gens = [TextGeneration(engine, ids[97 * b:97 * b + 16 + 5 * b], params, own_kv=True) for b in range(B)]
    for g in gens:
        g.step()
    return gens


def timed(engine: Engine, gens: list[TextGeneration], steps: int, batched: bool) -> tuple[float, int]:
    """(seconds, synchronous fetches) of `steps` decode steps of every generation."""
    start, fetches = time.perf_counter(), engine.stats.sync_fetches
    for _ in range(steps):
        if batched:
            for g, row in zip(gens, batch_logits(engine, gens)):
                g.advance(row)
        else:
            for g in gens:
                g.step()
    return time.perf_counter() - start, engine.stats.sync_fetches - fetches


def batch_sizes(text: str) -> list[int]:
    """--batch: comma-separated whole numbers >= 1."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of sequence counts >= 1, e.g. 1,4,16")
    return sizes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=None, help="a checkpoint folder (default: the built-in model)")
    p.add_argument("--store", choices=("ram", "disk"), default="ram")
    p.add_argument("--cache", type=float, default=0.25)
    p.add_argument("--store-dtype", default=None, help="the disk store's format (default: the checkpoint's)")
    p.add_argument("--slot-dtype", default="auto")
    p.add_argument("--dense-dtype", default="auto")
    p.add_argument("--batch", type=batch_sizes, default=[1, 4, 16], help="comma-separated sequence counts")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--one-call", action="store_true",
                   help="also the batched step with each token's experts in one call after the last wait")
    p.add_argument("--json", type=Path, default=None, help="write every batch size's medians and trials as JSON")
    a = p.parse_args()
    if a.steps < 1 or a.trials < 1:
        p.error("--steps and --trials must be at least 1")
    torch.set_num_threads(1)
    fmt = ExpertFormat.parse(a.store_dtype, 32) if a.store_dtype else None
    engine = Engine(a.model, EngineConfig(store=a.store, cache=CacheConfig(fraction=a.cache), store_format=fmt,
                                          slot_dtype=a.slot_dtype, dense_dtype=a.dense_dtype))
    ids = engine.encode(open("expertcache/data/eval.txt").read()[:20000])
    variants = ["batched"] + (["batched, one call"] if a.one_call else []) + ["one by one"]
    print("| B | " + " | ".join(f"{v} ms/step" for v in variants) + " | batched vs one by one | " +
          ("as landed vs one call | " if a.one_call else "") + "batched tokens/s | fetches/token batched | "
          "fetches/token one by one |")
    print("|---" * (len(variants) + 5 + a.one_call) + "|")
    results = []
    for B in a.batch:
        runs: dict[str, list[tuple[float, int]]] = {v: [] for v in variants}
        for trial in range(a.trials + 1):  # trial 0 warms up
            for v in variants if trial % 2 else variants[::-1]:
                engine.runner.as_landed = v != "batched, one call"
                r = timed(engine, sequences(engine, ids, B, a.steps), a.steps, v != "one by one")
                if trial:
                    runs[v].append(r)
        engine.runner.as_landed = True
        ms = {v: statistics.median(s for s, _ in r) * 1000 / a.steps for v, r in runs.items()}
        fetches = {v: sum(f for _, f in r) / (B * a.steps * a.trials) for v, r in runs.items()}
        landed = f"{ms['batched, one call'] / ms['batched']:.3f}x | " if a.one_call else ""
        print(f"| {B} | " + " | ".join(f"{ms[v]:.1f}" for v in variants) +
              f" | {ms['one by one'] / ms['batched']:.2f}x | {landed}{B * 1000 / ms['batched']:.0f} | "
              f"{fetches['batched']:.2f} | {fetches['one by one']:.2f} |", flush=True)
        results.append({"batch": B, "ms_per_step": ms, "fetches_per_token": fetches,
                        "trials_s": {v: [s for s, _ in r] for v, r in runs.items()}})
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    run_script(main)
