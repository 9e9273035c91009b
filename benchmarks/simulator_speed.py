"""Simulator replay speed: (token, layer, selected expert) events per second on one core.

A synthetic trace shaped like Qwen3-Next-80B-A3B (48 layers, 512 experts, top-10) with skewed,
slowly drifting router logits; each policy is replayed after one warm-up, median of 3.

    python benchmarks/simulator_speed.py [--tokens 2000]
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from expertcache.cache import CacheConfig
from expertcache.simulator import replay
from expertcache.trace import read_trace, write_trace


def synthetic_trace(path: Path, tokens: int, layers=48, experts=512, top_k=10, seed=0):
    rng = np.random.default_rng(seed)
    popularity = rng.normal(0, 1.5, (layers, experts))  # some experts are routed far more often
    drift = np.zeros((layers, experts))
    logits = np.empty((tokens, layers, experts), dtype=np.float16)
    for t in range(tokens):
        drift = 0.98 * drift + 0.2 * rng.normal(0, 1, (layers, experts))  # topics drift slowly
        logits[t] = popularity + drift + rng.normal(0, 1, (layers, experts))
    header = {"model": "synthetic", "family": "qwen3_next", "num_layers": layers, "num_experts": experts,
              "top_k": top_k, "norm_topk_prob": True, "hidden_size": 2048, "expert_params": 3 * 2048 * 512,
              "context": 512, "documents": []}
    write_trace(path, header, np.zeros(tokens, dtype=np.int32), logits)
    return read_trace(path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2000)
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        trace = synthetic_trace(Path(d) / "synthetic.ectrace", a.tokens)
        print(f"{a.tokens} tokens x 48 layers x top-10 = {a.tokens * 480:,} events, one thread")
        print("| policy | events/s (median of 3) | hit rate |")
        print("|---|---:|---:|")
        for policy in ["fetch-all", "threshold:tau=0.15", "quality-first"]:
            replay(trace, policy, CacheConfig(fraction=0.25))
            runs = [replay(trace, policy, CacheConfig(fraction=0.25)) for _ in range(3)]
            eps = statistics.median(r.events_per_second for r in runs)
            print(f"| `{policy}` | {eps / 1e6:.3f}M | {runs[0].stats.hit_rate:.1%} |")


if __name__ == "__main__":
    main()
