"""Batched decode against one forward per sequence, in the engine (no server): B greedy sequences
with prompts of different lengths from the evaluation text, each with its own KV cache, decode
`--steps` tokens each, either as one batched forward per step (Engine.forward_batch, what
`serve --schedule batch` runs) or as B one-token forwards per step (`--schedule interleave`).
The two run in alternating trials on the same engine and cache; medians of trials.

    PYTHONPATH=. python benchmarks/batch_decode.py [--batch 1,4,16] [--steps 16] [--trials 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from expertcache.cli import run_script
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.generate import TextGeneration, batch_logits
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--trials", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    engine = Engine(None, EngineConfig(store="ram"))
    ids = engine.encode(open("expertcache/data/eval.txt").read()[:20000])
    print("| B | batched ms/step | one-by-one ms/step | speed-up | batched tokens/s | one-by-one tokens/s | "
          "fetches/token batched | fetches/token one by one |")
    print("|---|---|---|---|---|---|---|---|")
    for B in map(int, a.batch.split(",")):
        runs: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
        for trial in range(a.trials + 1):  # trial 0 warms up
            for batched in (True, False):
                r = timed(engine, sequences(engine, ids, B, a.steps), a.steps, batched)
                if trial:
                    runs[batched].append(r)
        ms = {k: statistics.median(s for s, _ in v) * 1000 / a.steps for k, v in runs.items()}
        fetches = {k: sum(f for _, f in v) / (B * a.steps * a.trials) for k, v in runs.items()}
        print(f"| {B} | {ms[True]:.1f} | {ms[False]:.1f} | {ms[False] / ms[True]:.2f}x | "
              f"{B * 1000 / ms[True]:.0f} | {B * 1000 / ms[False]:.0f} | {fetches[True]:.2f} | {fetches[False]:.2f} |")


if __name__ == "__main__":
    run_script(main)
