"""Prefill protection: does a long prompt's prefill flush the experts that decoding uses?

One engine and cache, as in the server: short requests decode (the working set settles), then a
long prompt is prefilled under the prefill policy, then that request and a short one decode.
Reports the decode hit rate after the long prompt, the prefill's time and fetches, and how many
of the long request's greedy tokens agree with the exact (fetch-all prefill) run.

    python benchmarks/prefill_protection.py [--cache 0.25] [--prompt-tokens 1500] [--tokens 48]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from expertcache.cli import run_script
from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.generate import TextGeneration
from expertcache.engine.sampling import SamplingParams
from expertcache.engine.stats import RunStats
from expertcache.policies import make_policy

SHORT = ["ROMEO.\n", "JULIET.\nO", "HAMLET.\nTo be", "KING.\nWhat say you"]
EVAL = "expertcache/data/eval.txt"


def delta(after: RunStats, before: RunStats) -> dict:
    routed, hits = after.routed - before.routed, after.hits - before.hits
    tokens = after.tokens - before.tokens
    return {"hit_rate": hits / routed if routed else 0.0, "tokens": tokens,
            "fetches_per_token": (after.sync_fetches - before.sync_fetches) / tokens if tokens else 0.0,
            "wall_s": after.wall_s - before.wall_s}


def run(a, prefill_spec: str) -> dict:
    engine = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=a.cache), max_seq=a.prompt_tokens + 256))
    prefill_policy = None if prefill_spec == "same" else make_policy(prefill_spec)
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)

    def decode(prompt_ids, policy=None):
        gen = TextGeneration(engine, prompt_ids, params, own_kv=True, prefill_policy=policy)
        gen.step()  # prefill + first token
        before = replace(engine.stats)
        list(gen)
        return gen.tokens, delta(engine.stats, before)

    for text in SHORT:  # the decode working set settles
        decode(engine.encode(text), prefill_policy)
    long_ids = engine.encode(open(EVAL).read()[:20 * a.prompt_tokens])[:a.prompt_tokens]
    before = replace(engine.stats)
    gen = TextGeneration(engine, long_ids, params, own_kv=True, prefill_policy=prefill_policy)
    gen.step()
    prefill = delta(engine.stats, before)
    before = replace(engine.stats)
    list(gen)
    long_decode = delta(engine.stats, before)
    _, short_decode = decode(engine.encode(SHORT[0]), prefill_policy)
    engine.close()
    return {"prefill": prefill, "long_decode": long_decode, "short_decode": short_decode, "tokens": gen.tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=float, default=0.25)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--policies", default="same,substitute-all,threshold:tau=0.15")
    a = p.parse_args()
    results = {spec: run(a, spec) for spec in a.policies.split(",")}
    exact = results["same"]["tokens"] if "same" in results else None
    print(f"cache {a.cache}, prompt {a.prompt_tokens} tokens, {a.tokens} decoded; decode policy fetch-all\n")
    print("| prefill policy | prefill s | prefill fetches/token | decode hit rate, long request | "
          "decode hit rate, next short request | long request's tokens equal to exact |")
    print("|---|---|---|---|---|---|")
    for spec, r in results.items():
        same = sum(x == y for x, y in zip(r["tokens"], exact)) if exact else 0
        print(f"| {spec} | {r['prefill']['wall_s']:.2f} | {r['prefill']['fetches_per_token']:.2f} | "
              f"{r['long_decode']['hit_rate']:.1%} | {r['short_decode']['hit_rate']:.1%} | "
              f"{same}/{len(r['tokens'])} |")


if __name__ == "__main__":
    run_script(main)
