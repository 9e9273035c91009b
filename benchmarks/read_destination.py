"""Whether the memory a disk read lands in changes its speed: O_DIRECT reads of a disk store's blobs into
several page-aligned regions of this process, each made and touched in turn, the regions taking turns.

On a bare machine every region reads alike. In a VM the host copies each read into guest memory, and the
cost of that can differ by region (measured here: see benchmarks/RESULTS.md, "Where a read lands").

    python benchmarks/read_destination.py --store ~/.cache/expertcache/stores/STORE [--regions 6 --rows 32]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np

from expertcache.cli import run_script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, required=True, help="a disk store folder (experts.json, experts.bin)")
    p.add_argument("--regions", type=int, default=6)
    p.add_argument("--rows", type=int, default=32, help="blob-sized rows a region holds")
    p.add_argument("--reads", type=int, default=16, help="reads into a region per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    meta = json.loads((a.store / "experts.json").read_text())
    blob, n = meta["blob_bytes"], meta["num_layers"] * meta["num_experts"]
    fd = os.open(a.store / "experts.bin", os.O_RDONLY | os.O_DIRECT)
    regions = []
    for _ in range(a.regions):  # made one after another, each touched at once, as a cache's slots are filled
        m = mmap.mmap(-1, blob * a.rows)
        np.frombuffer(m, np.uint8)[::4096] = 1
        regions.append([memoryview(m)[i * blob:(i + 1) * blob] for i in range(a.rows)])
    rng = random.Random(0)
    times: list[list[float]] = [[] for _ in regions]
    for _ in range(a.rounds):
        for r, rows in enumerate(regions):
            start = time.perf_counter()
            for _ in range(a.reads):
                if os.preadv(fd, [rows[rng.randrange(a.rows)]], rng.randrange(n) * blob) != blob:
                    raise SystemExit(f"{a.store}: a short read; is the store whole?")
            times[r].append((time.perf_counter() - start) / a.reads)
    os.close(fd)
    medians = [statistics.median(t) for t in times]
    print(f"{a.store.name}: {blob} bytes a read, {a.regions} regions of {a.rows} rows, medians of {a.rounds} rounds")
    print("| region (in the order made) | ms/read | GB/s |\n|---:|---:|---:|")
    for r, m in enumerate(medians):
        print(f"| {r} | {1e3 * m:.2f} | {blob / m / 1e9:.2f} |")
    print(f"slowest / fastest region: {max(medians) / min(medians):.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"blob_bytes": blob, "ms_per_read": [1e3 * m for m in medians],
                                      "rounds_ms": [[1e3 * x for x in t] for t in times]}, indent=1))


if __name__ == "__main__":
    run_script(main)
