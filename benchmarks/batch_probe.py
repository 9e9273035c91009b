"""What would batching decode steps across requests buy? The time of one forward over B tokens
(a window, decided in order, the union of experts per layer) against B one-token forwards,
same engine and warm cache; median of trials. An upper bound on the compute side of
continuous batching (attention over B separate KV caches would cost more than one window).

    PYTHONPATH=. python benchmarks/batch_probe.py [--batch 1,4,16] [--trials 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from expertcache.cli import run_script
from expertcache.engine.engine import Engine, EngineConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="4,16")
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args()
    engine = Engine(None, EngineConfig(store="ram"))
    ids = torch.tensor(engine.encode(open("expertcache/data/eval.txt").read()[:4000]))
    print("| batch B | one B-token forward ms | B one-token forwards ms | ratio | fetches/token batched | "
          "fetches/token one by one |")
    print("|---|---|---|---|---|---|")
    for B in map(int, a.batch.split(",")):
        window, single, fw, fs = [], [], 0, 0
        for trial in range(a.trials + 1):  # trial 0 warms up
            start, f0 = time.perf_counter(), engine.stats.sync_fetches
            engine.forward(ids[100:100 + B], 100)
            if trial:
                window.append(time.perf_counter() - start)
                fw += engine.stats.sync_fetches - f0
            start, f0 = time.perf_counter(), engine.stats.sync_fetches
            for t in range(B):
                engine.forward(ids[200 + t:201 + t], 200 + t)
            if trial:
                single.append(time.perf_counter() - start)
                fs += engine.stats.sync_fetches - f0
        w, s = statistics.median(window) * 1000, statistics.median(single) * 1000
        print(f"| {B} | {w:.1f} | {s:.1f} | {s / w:.2f}x | {fw / (B * a.trials):.2f} | {fs / (B * a.trials):.2f} |")


if __name__ == "__main__":
    run_script(main)
