"""Simulator replay speed: (token, layer, selected expert) events per second on one core.

A synthetic trace shaped like Qwen3-Next-80B-A3B (48 layers, 512 experts, top-10, float16
logits) with skewed, slowly drifting router logits. The trace is routed once (top-k and gate
weights, shared by every replay of the trace); each policy is then replayed after one warm-up,
median of 3, at a 25% cache with a warm start.

    python benchmarks/simulator_speed.py [--tokens 4000] [--policies ...] [--window 1]
"""
import argparse
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from expertcache.cli import run_script
from expertcache.engine.cache import CacheConfig
from expertcache.lab.simulator import replay, route_trace
from expertcache.lab.trace import read_trace, write_trace

POLICIES = ["fetch-all", "threshold:tau=0.15", "first-choice", "quality-first", "speed-first", "moe-infinity",
            "llama.cpp", "conditional:j=2,m=16"]


def synthetic_trace(path: Path, tokens: int, layers=48, experts=512, top_k=10, seed=0):
    """Skew and drift set so that a 25% LRU cache hits about half of the time, as the built-in
    model's eval trace does (45%)."""
    rng = np.random.default_rng(seed)
    popularity = rng.normal(0, 0.3, (layers, experts))  # some experts are routed more often
    drift = np.zeros((layers, experts))
    logits = np.empty((tokens, layers, experts), dtype=np.float16)
    for t in range(tokens):
        drift = 0.98 * drift + 0.1 * rng.normal(0, 1, (layers, experts))  # topics drift slowly
        logits[t] = popularity + drift + rng.normal(0, 1, (layers, experts))
    header = {"model": "synthetic", "family": "qwen3_next", "num_layers": layers, "num_experts": experts,
              "top_k": top_k, "norm_topk_prob": True, "hidden_size": 2048, "expert_params": 3 * 2048 * 512,
              "context": 512, "documents": []}
    write_trace(path, header, np.zeros(tokens, dtype=np.int32), logits)
    return read_trace(path), popularity


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--policies", nargs="*", default=POLICIES)
    p.add_argument("--ranks", type=int, default=32, help="experts ranked per token and layer when routing")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per layer call (default: the trace's 512; 1: decode order)")
    a = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    with tempfile.TemporaryDirectory() as d:
        trace, popularity = synthetic_trace(Path(d) / "synthetic.ectrace", a.tokens)
        events = a.tokens * 48 * 10
        route_trace(trace, a.ranks)  # compile
        routing = statistics.median(route_trace(trace, a.ranks).seconds for _ in range(3))
        routes = route_trace(trace, a.ranks)
        counts = np.exp(popularity)  # warm start: the most popular experts
        print(f"{a.tokens} tokens x 48 layers x top-10 = {events:,} events, one core, windows of {a.window or 512}")
        print(f"routing the trace (once per trace): {events / routing / 1e6:.1f}M events/s")
        print("| policy | replay events/s (median of 3) | with routing | 100k tokens would take | hit rate |")
        print("|---|---:|---:|---:|---:|")
        for policy in a.policies:
            run = lambda: replay(trace, policy, CacheConfig(fraction=0.25), counts=counts, routes=routes,  # noqa: E731
                                 window=a.window)
            run()
            runs = [run() for _ in range(3)]
            seconds = statistics.median(r.seconds for r in runs)
            print(f"| `{policy}` | {events / seconds / 1e6:.1f}M | {events / (seconds + routing) / 1e6:.1f}M | "
                  f"{seconds * 100_000 / a.tokens:.1f} s | {runs[0].stats.hit_rate:.1%} |")


if __name__ == "__main__":
    run_script(main)
