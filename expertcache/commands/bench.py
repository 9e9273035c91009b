"""expertcache bench: time every policy on the real engine against fetch-every-miss and the floor."""
from __future__ import annotations

import sys

from ..choices import BENCH_POLICIES
from .options import (
    add_json_argument,
    add_model_argument,
    add_store_arguments,
    announce_compile,
    bounded,
    byte_size,
    format_from_args,
    fraction,
    positive_int,
    write_json,
)

_at_least_two = bounded(int, 2, what="give at least 2 tokens")

HELP = "time the policies on the real engine (disk store by default) with warm-up and repetitions"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    add_store_arguments(p)
    p.add_argument("--cache", type=fraction, default=None,
                   help="cache size as a fraction of each layer's experts (default: 0.25, or what --memory-budget "
                        "leaves)")
    p.add_argument("--memory-budget", type=byte_size, default=None,
                   help="bytes of the whole fast tier (dense weights, KV cache, buffers, expert slots), e.g. 2G; "
                        "sizes the cache instead of --cache, and skips the all-resident floor, which would exceed it")
    p.add_argument("--policies", nargs="+", default=list(BENCH_POLICIES),
                   help="policy specs to time (fetch-all always runs)")
    p.add_argument("--decode-tokens", type=_at_least_two, default=64,
                   help="greedy tokens decoded after the prompt")
    p.add_argument("--forced-tokens", type=positive_int, default=1024,
                   help="tokens scored teacher-forced")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed repetitions")
    p.add_argument("--markdown", action="store_true",
                   help="print the full 14-column Markdown table (wide) instead of the headline columns")
    add_json_argument(p)


def run(a) -> int:
    """Run the verb; returns the exit code."""
    announce_compile()
    from ..lab.bench import BenchConfig, markdown, run_bench, table
    policies = tuple(dict.fromkeys(["fetch-all", *a.policies]))
    cfg = BenchConfig(store=a.store, device=a.device, store_dir=a.store_dir, cache_fraction=a.cache, policies=policies,
                      store_format=format_from_args(a, a.store_dtype), read_mode=a.read_mode, io=a.io,
                      slot_dtype=a.slot_dtype, dense_dtype=a.dense_dtype,
                      memory_budget=a.memory_budget, decode_tokens=a.decode_tokens, forced_tokens=a.forced_tokens,
                      repeats=a.repeats)
    res = run_bench(a.model, cfg, progress=lambda s: print(s, file=sys.stderr), partial_on_interrupt=True)
    setup, _, full = markdown(res).split("\n", 2)
    if not a.markdown:  # the setup line names the full table's columns; the headline table has fewer
        setup += " The ratios to the floor, same-token decode and stalls: --markdown, or --json."
    print(f"{setup}\n\n{full if a.markdown else table(res)}")
    write_json(a.json, res.to_dict())
    if "repeats_done" in res.config:  # Ctrl-C after a whole repetition: its figures, and the exit code of an interrupt
        print(f"interrupted: the table holds {res.config['repeats_done']} of {a.repeats} repetitions",
              file=sys.stderr)
        return 130
    return 0
