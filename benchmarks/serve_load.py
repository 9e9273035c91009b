"""Load test of `expertcache serve` over loopback: a fixed number of streamed completion
requests at each concurrency level (closed loop: every client sends its next request when the
last one ends), for each schedule. Reports throughput and p50/p99 latency and time to first
token. Bounded: --requests per level and --duration seconds at most per level.

    PYTHONPATH=. python benchmarks/serve_load.py [--clients 1,4,16] [--requests 32] [--max-tokens 32]
        [--schedules batch,interleave,serial] [--duration 300] [-- extra serve options]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from expertcache.cli import run_script

PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo", "HAMLET.\nTo be, or not", "KING HENRY.\nNow, lords, for France",
           "MACBETH.\nIs this a dagger", "PORTIA.\nThe quality of mercy"]
MODEL = "expertcache-builtin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(schedule: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "expertcache.cli", "serve", "--store", "ram", "--port", str(port),
           "--schedule", schedule, *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up")


def hit_rate(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("expertcache_cache_hit_rate ")))


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """-> (latency s, time to first token s, chunks)"""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    start, first, chunks = time.perf_counter(), None, 0
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data: {"):
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(line.decode())
                first = first or time.perf_counter()
                chunks += 1
    return time.perf_counter() - start, (first or start) - start, chunks


def load(url: str, clients: int, requests: int, max_tokens: int, duration: float) -> dict:
    lock, latencies, ttfts, sent = threading.Lock(), [], [], [0]
    begin = time.perf_counter()

    def client(i: int) -> None:
        while True:
            with lock:
                if sent[0] >= requests or time.perf_counter() - begin > duration:
                    return
                n = sent[0]
                sent[0] += 1
            lat, ttft, _ = one_request(url, PROMPTS[n % len(PROMPTS)], max_tokens)
            with lock:
                latencies.append(lat)
                ttfts.append(ttft)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begin
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"clients": clients, "requests": len(latencies), "wall_s": wall,
            "tokens_per_s": len(latencies) * max_tokens / wall, "requests_per_s": len(latencies) / wall,
            "p50_s": q[49], "p99_s": q[98], "ttft_p50_s": statistics.median(ttfts)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--schedules", default="batch,interleave,serial")
    p.add_argument("--duration", type=float, default=300, help="seconds at most per level")
    p.add_argument("extra", nargs="*", help="serve options after --")
    a = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
          f"{a.requests} requests x {a.max_tokens} tokens per level, greedy, --store ram {' '.join(a.extra)}\n")
    print("| schedule | clients | requests | tokens/s | requests/s | p50 latency s | p99 latency s | "
          "p50 first token s | hit rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for schedule in a.schedules.split(","):
        proc, url = start_server(schedule, a.extra)
        try:
            one_request(url, PROMPTS[0], 4)  # warm-up
            for clients in map(int, a.clients.split(",")):
                r = load(url, clients, a.requests, a.max_tokens, a.duration)
                print(f"| {schedule} | {clients} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                      f"{r['requests_per_s']:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['ttft_p50_s']:.2f} | "
                      f"{hit_rate(url):.1%} |", flush=True)
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    run_script(main)
