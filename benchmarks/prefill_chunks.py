"""A long prompt arriving while another request decodes: how long the decoding stream waits between tokens, with
the prompt prefilled whole and in parts of `--prefill-chunk` tokens (the server's scheduler, its rounds run here
in-process, without HTTP). Reports, per chunk size, the medians over the rounds of the stream's longest gap and
its median gap while the prompt runs, and the time to the long prompt's first token; the sizes alternate their
order every round.

    python benchmarks/prefill_chunks.py [--model DIR] [--store disk] [--cache 0.25] [--prompt-tokens 1800] \
        [--store-dtype int4 --slot-dtype int4 --dense-dtype int4] [--chunks 0,256,512] [--rounds 3] [--json FILE]
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
from expertcache.engine.sampling import SamplingParams
from expertcache.serve.scheduler import Request, Scheduler, SchedulerConfig

EVAL = "expertcache/data/eval.txt"


def one_round(engine: Engine, prompt: list[int], chunk: int) -> dict:
    """A request decodes; the long prompt arrives; rounds run until its first token, and a few more."""
    scheduler = Scheduler(engine, SchedulerConfig(max_active=2, prefill_chunk=chunk))
    times, first = [], []
    greedy = dict(temperature=0, ignore_eos=True)
    # past the prompt's parts (a round each), and leaving the long prompt room in the keys and values held
    stream = Request([1, 2, 3], SamplingParams(max_tokens=len(prompt) // max(chunk, 1) + 16, **greedy),
                     lambda item: times.append(time.perf_counter()))
    scheduler.submit(stream)
    scheduler._admit()
    for _ in range(4):  # the stream decodes
        scheduler._round()
    long = Request(prompt, SamplingParams(max_tokens=1, **greedy), lambda item: first.append(time.perf_counter()))
    start = time.perf_counter()
    scheduler.submit(long)
    scheduler._admit()
    assert scheduler.active[-1] is long, "the long prompt was not admitted beside the stream"
    while not first:
        scheduler._round()
    during = [b - a for a, b in zip(times, times[1:]) if b > start]
    stream.cancel()
    scheduler._round()
    return {"longest_gap_ms": max(during) * 1e3, "median_gap_ms": statistics.median(during) * 1e3,
            "first_token_ms": (first[0] - start) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(p)  # the verbs' engine options; the store: disk
    p.add_argument("--prompt-tokens", type=int, default=1800, help="the long prompt's tokens (from the eval text)")
    p.add_argument("--chunks", default="0,256,512", help="prefill_chunk values to compare (0: the prompt whole)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every chunk size")
    p.add_argument("--json", default=None, help="write the figures to this file")
    a = p.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    max_seq = a.prompt_tokens + 64  # the stream's keys and values beside the prompt's
    engine = Engine(a.model, replace(engine_config(a), max_seq=max_seq, kv_positions=2 * max_seq))
    prompt = engine.encode(open(EVAL).read()[:20 * a.prompt_tokens])[:a.prompt_tokens]
    one_round(engine, prompt[:64], chunks[0])  # warm-up: compiling, the cache's working set
    runs = {c: [] for c in chunks}
    for r in range(a.rounds):
        for c in chunks if r % 2 == 0 else chunks[::-1]:
            runs[c].append(one_round(engine, prompt, c))
            print(f"round {r + 1}, chunk {c}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[c][-1].items()),
                  flush=True)
    engine.close()
    table = {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for c, rs in runs.items()}
    print(f"\n| prefill chunk | longest gap ms | median gap ms | long prompt's first token ms |  "
          f"({len(prompt)}-token prompt, medians of {a.rounds})\n|---:|---:|---:|---:|")
    for c, m in table.items():
        print(f"| {c or 'whole'} | {m['longest_gap_ms']:.0f} | {m['median_gap_ms']:.1f} | {m['first_token_ms']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "medians": table, "rounds": runs}, f, indent=1)


if __name__ == "__main__":
    run_script(main)
