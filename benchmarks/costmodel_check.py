"""The cost model against the engine: replay the timed benchmark's teacher-forced tokens
(same tokens, windows and warm start) and compare the profile's estimate with the measured
time per token of each policy.

    python benchmarks/costmodel_check.py BENCH_JSON PROFILE_JSON
"""
import json
import sys
import tempfile
from pathlib import Path

from expertcache.bench import FLOOR
from expertcache.cache import CacheConfig
from expertcache.calibrate import encode_text
from expertcache.costmodel import HardwareProfile
from expertcache.engine import BUILTIN_MODEL
from expertcache.perplexity import EVAL_TEXT
from expertcache.calibrate import load_routing_counts
from expertcache.simulator import replay
from expertcache.trace import record_trace


def main():
    bench = json.loads(Path(sys.argv[1]).read_text())
    profile = HardwareProfile.load(Path(sys.argv[2]))
    cfg = bench["config"]
    ids = encode_text(BUILTIN_MODEL, EVAL_TEXT.read_text(encoding="utf-8"))
    forced = ids[cfg["prompt_tokens"]:cfg["prompt_tokens"] + cfg["forced_tokens"]]
    with tempfile.TemporaryDirectory() as d:
        trace = record_trace(BUILTIN_MODEL, forced, Path(d) / "forced.ectrace", cfg["context"], "float32")
        counts = load_routing_counts(BUILTIN_MODEL)
        print(f"profile {profile.name}: dense {1e3 * profile.dense_s:.3f} ms/token, expert run "
              f"{1e6 * profile.expert_run_s:.1f} us, fetch {1e6 * profile.fetch_s:.0f} us, admission "
              f"{1e6 * profile.admission_s:.0f} us, substituting call {1e6 * profile.decision_s:.1f} us\n")
        print("| policy | measured forced ms/token | estimated | error | replay fetches/token | engine fetches/token |")
        print("|---|---:|---:|---:|---:|---:|")
        errors = []
        for policy, row in bench["summary"].items():
            if policy == FLOOR or "+" in policy:
                continue
            r = replay(trace, policy, CacheConfig(fraction=cfg["cache_fraction"]), None, counts)
            est = profile.ms_per_token(r.stats)
            err = est / row["forced_ms"] - 1
            errors.append(abs(err))
            print(f"| `{policy}` | {row['forced_ms']:.2f} | {est:.2f} | {100 * err:+.1f}% | "
                  f"{r.stats.fetches_per_token:.2f} | {row['fetches_per_token']:.2f} |")
        print(f"\nmean absolute error {100 * sum(errors) / len(errors):.1f}%, worst {100 * max(errors):.1f}%")


if __name__ == "__main__":
    main()
