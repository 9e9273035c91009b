"""A prompt's prefill through a small cache, in each `prompt_order`: `experts` (each routed expert resident or read
once a layer, run on all its tokens) against `tokens` (decided token by token, as decode and the emulation do).
One engine per order, the orders alternated round by round; reports the medians of prefill ms per prompt token,
the reads per token and the stall, and how far apart the two orders' last logits are.

    python benchmarks/prompt_order.py [--model DIR] [--store disk] [--cache 0.25] [--prompt-tokens 512] \
        [--store-dtype int4 --slot-dtype int4 --dense-dtype int4] [--policy fetch-all] [--rounds 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from expertcache.cli import run_script
from expertcache.commands.options import add_engine_arguments, engine_config
from expertcache.engine.engine import Engine
from expertcache.engine.generate import prefill

EVAL = "expertcache/data/eval.txt"
ORDERS = ("experts", "tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(p, prompts=False)  # the verbs' engine options; the store: disk
    p.add_argument("--prompt-tokens", type=int, default=512, help="the prompt's tokens (from the eval text)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each order")
    p.add_argument("--json", default=None, help="write the figures to this file")
    a = p.parse_args()
    config = replace(engine_config(a), max_seq=a.prompt_tokens + 8)
    engines = {order: Engine(a.model, replace(config, prompt_order=order))
        for order in ORDERS}
    prompt = engines["experts"].encode(open(EVAL).read()[:20 * a.prompt_tokens])[:a.prompt_tokens]
    for engine in engines.values():  # warm-up: compiling
        prefill(engine, prompt[:32])
    runs, logits = {order: [] for order in ORDERS}, {}
    for r in range(a.rounds):
        for order in ORDERS if r % 2 == 0 else ORDERS[::-1]:
            engine = engines[order]
            engine.reset()  # the same warm cache at the prompt's start
            start = time.perf_counter()
            logits[order] = prefill(engine, prompt)
            s = engine.stats
            runs[order].append({"ms_per_token": (time.perf_counter() - start) * 1e3 / len(prompt),
                                "reads_per_token": (s.sync_fetches + s.prefetch_fetches) / s.tokens,
                                "stall_s": s.stall_s, "hit_rate": s.hit_rate})
            print(f"round {r + 1}, {order}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[order][-1].items()),
                  flush=True)
    for engine in engines.values():
        engine.close()
    table = {o: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for o, rs in runs.items()}
    gap = float((logits["experts"] - logits["tokens"]).abs().max())
    print(f"\n| prompt order | prefill ms/token | reads/token | stall s | vs tokens |  ({len(prompt)}-token prompt, "
          f"policy {a.policy}, medians of {a.rounds})\n|---|---:|---:|---:|---:|")
    for o, m in table.items():
        print(f"| {o} | {m['ms_per_token']:.2f} | {m['reads_per_token']:.2f} | {m['stall_s']:.2f} | "
              f"{table['tokens']['ms_per_token'] / m['ms_per_token']:.2f}x |")
    print(f"largest difference of the last logits between the orders: {gap:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "medians": table, "rounds": runs, "logit_gap": gap}, f, indent=1)


if __name__ == "__main__":
    run_script(main)
