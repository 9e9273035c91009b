"""Whether each verb stays inside `--memory-budget`: its peak charge (resident memory and page cache, measured by a
memory cgroup) against its baseline plus the budget plus 5%, on a checkpoint, from its fp16 and int4 disk stores.

    sudo python benchmarks/verb_memory.py [--model build/qwen3-30b-shape] [--budget 600M] [--json OUT]

A baseline is the process's peak before any weight: its imports and a forward of the built-in model (the compiled
kernels loaded), measured the same way. The page cache is dropped before each run, so a run is charged for every
file it reads (the checkpoint's dense weights; the disk store's reads bypass the cache with O_DIRECT). `serve`
answers one completion request and exits. Needs root (cgroups, drop_caches); `expertcache.lab.cgroup`.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertcache.cli import run_script
from expertcache.commands.options import byte_size  # noqa: E402
from expertcache.lab.cgroup import drop_page_cache, run_capped, unavailable  # noqa: E402

SERVE_ONCE = """
import json, sys, threading, urllib.error, urllib.request
from expertcache import cli
port = int(sys.argv[1])
def ask():
    import time
    for _ in range(600):
        try:
            body = json.dumps({"model": "m", "prompt": "KING HENRY.", "max_tokens": 16}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            print(urllib.request.urlopen(req, timeout=600).read()[:200].decode())
            break
        except urllib.error.HTTPError as e:  # the server answered: a refusal is a result, not a wait
            print(e.code, e.read()[:200].decode())
            break
        except OSError:
            time.sleep(0.5)
    import os, signal
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=ask, daemon=True).start()
sys.exit(cli.main(["serve", "--port", str(port), "--served-model-name", "m"] + sys.argv[2:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verbs(model: str | None, budget: int, store: list[str]) -> dict[str, list[str]]:
    """Each verb's command line under the budget (model None: the built-in model)."""
    cli = [sys.executable, "-m", "expertcache.cli"]
    chosen = ["--model", model] if model else []
    common = [*chosen, "--memory-budget", str(budget), *store]
    seq = ["--max-seq", "256"]  # bench sizes its own sequence
    return {"generate": cli + ["generate", "-p", "KING HENRY.", "-n", "16", *common, *seq],
            "ppl": cli + ["ppl", "--max-tokens", "512", "--context", "256", *common, *seq],
            "bench": cli + ["bench", "--policies", "threshold:tau=0.15", "--decode-tokens", "8", "--forced-tokens",
                            "64", "--repeats", "1", *common],
            "calibrate": cli + ["calibrate", *chosen, "--max-tokens", "512", "--memory-budget", str(budget)],
            "serve": [sys.executable, "-c", SERVE_ONCE, str(free_port()), *common, *seq]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/qwen3-30b-shape")
    p.add_argument("--budget", type=byte_size, default=600 * 2**20)
    p.add_argument("--builtin-budget", type=byte_size, default=160 * 2**20, help="the budget on the built-in model")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if reason := unavailable():
        sys.exit(f"no memory cgroup can be made here: {reason}")
    drop_page_cache()
    warm = [sys.executable, "-c", "from expertcache import Engine, EngineConfig, generate; "
                                  "list(generate(Engine(None, EngineConfig(store='disk', max_seq=16)), [1, 2], 2))"]
    base = run_capped(warm, None, timeout=900).peak_bytes
    stores = {"fp16": [], "int4": ["--store-dtype", "int4", "--slot-dtype", "int4", "--dense-dtype", "int4"]}
    rows = []
    runs = [(a.model, a.budget, fmt, store) for fmt, store in stores.items()] + \
        [(None, a.builtin_budget, fmt, store) for fmt, store in stores.items()]
    for model, budget, fmt, store in runs:
        for verb, cmd in verbs(model, budget, store).items():
            if verb == "calibrate" and (fmt != "fp16" or model is None):
                continue  # calibration reads the checkpoint, whatever the store; it would rewrite the shipped model's
            drop_page_cache()
            r = run_capped(cmd, None, timeout=3600)
            limit = (base + budget) * 1.05
            row = {"model": model or "built-in", "budget": budget, "verb": verb, "store": fmt, "returncode": r.returncode, "peak_bytes": r.peak_bytes,
                   "limit_bytes": limit, "within": r.peak_bytes <= limit, "seconds": r.seconds,
                   "error": r.stderr.strip().splitlines()[-1:] if r.returncode else []}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print(f"\nbaseline {base / 2**20:.0f} MiB (imports and kernels, measured the same way); a verb's limit is "
          f"baseline + budget + 5%\n")
    print("| model | budget MiB | verb | store | exit | peak MiB | limit MiB | within the limit | seconds |")
    print("|---|---:|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['budget'] / 2**20:.0f} | {r['verb']} | {r['store']} | {r['returncode']} | "
              f"{r['peak_bytes'] / 2**20:.0f} | {r['limit_bytes'] / 2**20:.0f} | {'yes' if r['within'] else 'no'} | "
              f"{r['seconds']:.0f} |")
    if a.json:
        a.json.write_text(json.dumps({"baseline_bytes": base, "budget": a.budget, "rows": rows}, indent=1))


if __name__ == "__main__":
    run_script(main)
