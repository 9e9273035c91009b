"""The cost model against the engine: replay the timed benchmark's tokens (same tokens, windows
and warm start) and compare each profile's estimate with the measured time per token of each
policy. Teacher-forced: the 1,024 forced tokens in the benchmark's windows, against a
`--mode forced` profile. Decode (with a `--mode decode` profile): the prompt and the tokens
each policy decoded, replayed in decode order; the decode tokens' counts are those of the
whole sequence less those of the prompt.

    python benchmarks/costmodel_check.py BENCH_JSON FORCED_PROFILE_JSON [DECODE_PROFILE_JSON]
"""
import json
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import load_routing_counts
from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.engine.perplexity import EVAL_TEXT
from expertcache.engine.stats import RunStats
from expertcache.lab.bench import FLOOR
from expertcache.lab.calibrate import encode_text
from expertcache.lab.costmodel import HardwareProfile
from expertcache.lab.simulator import replay
from expertcache.lab.trace import record_trace


def describe(profile: HardwareProfile) -> str:
    return (f"profile {profile.name}: dense {1e3 * profile.dense_s:.3f} ms/token, expert run "
            f"{1e6 * profile.expert_run_s:.1f} us, fetch wait {1e6 * profile.fetch_latency_s:.0f} us, per fetch "
            f"{1e6 * profile.transfer_s:.0f} us, admission {1e6 * profile.admission_s:.0f} us, substituting call "
            f"{1e6 * profile.decision_s:.1f} us")


def table(rows: list[tuple[str, float, float, float, float]]) -> None:
    print("| policy | measured ms/token | estimated | error | replay fetches/token | engine fetches/token |")
    print("|---|---:|---:|---:|---:|---:|")
    errors = []
    for policy, measured, est, replay_fetches, engine_fetches in rows:
        err = est / measured - 1
        errors.append(abs(err))
        engine = f"{engine_fetches:.2f}" if engine_fetches == engine_fetches else "-"
        print(f"| `{policy}` | {measured:.2f} | {est:.2f} | {100 * err:+.1f}% | {replay_fetches:.2f} | {engine} |")
    print(f"\nmean absolute error {100 * sum(errors) / len(errors):.1f}%, worst {100 * max(errors):.1f}%\n")


def difference(a: RunStats, b: RunStats) -> RunStats:
    return RunStats(**{f.name: getattr(a, f.name) - getattr(b, f.name) for f in fields(RunStats)})


def main():
    bench = json.loads(Path(sys.argv[1]).read_text())
    forced_profile = HardwareProfile.load(Path(sys.argv[2]))
    decode_profile = HardwareProfile.load(Path(sys.argv[3])) if len(sys.argv) > 3 else None
    cfg = bench["config"]
    cache = CacheConfig(fraction=cfg["cache_fraction"])
    policies = [p for p in bench["summary"] if p != FLOOR and "+" not in p]
    ids = encode_text(BUILTIN_MODEL, EVAL_TEXT.read_text(encoding="utf-8"))
    prompt = ids[:cfg["prompt_tokens"]]
    forced = ids[cfg["prompt_tokens"]:cfg["prompt_tokens"] + cfg["forced_tokens"]]
    counts = load_routing_counts(BUILTIN_MODEL)
    with tempfile.TemporaryDirectory() as d:
        trace = record_trace(BUILTIN_MODEL, forced, Path(d) / "forced.ectrace", cfg["context"], "float32")
        print("Teacher-forced.", describe(forced_profile), "\n")
        rows = []
        for policy in policies:
            r = replay(trace, policy, cache, None, counts)
            rows.append((policy, bench["summary"][policy]["forced_ms"], forced_profile.ms_per_token(r.stats),
                         r.stats.fetches_per_token, bench["summary"][policy]["fetches_per_token"]))
        table(rows)
        if decode_profile is None:
            return
        print("Decode.", describe(decode_profile), "\n")
        head = record_trace(BUILTIN_MODEL, prompt, Path(d) / "prompt.ectrace", len(prompt), "float32")
        rows = []
        for policy in policies:
            seq = prompt + bench["decoded"][policy][:-1]  # the last token decoded is never fed back
            whole = record_trace(BUILTIN_MODEL, seq, Path(d) / "seq.ectrace", len(seq), "float32")
            stats = difference(replay(whole, policy, cache, None, counts, window=1).stats,
                               replay(head, policy, cache, None, counts, window=1).stats)
            rows.append((policy, bench["summary"][policy]["decode_ms"], decode_profile.ms_per_token(stats),
                         stats.fetches_per_token, float("nan")))
        table(rows)


if __name__ == "__main__":
    main()
