"""Cost of the disk store's integrity check and of its read modes, per expert fetch.

Reads random (layer, expert) blobs of the built-in model's disk store into a fast-tier slot,
one at a time on one thread, as a fetch does: O_DIRECT without and with the CRC32C check,
and buffered reads that drop each blob from the page cache afterwards (the fallback where
O_DIRECT is refused). The variants take turns fetch by fetch, so they share the machine's
state; reports the median microseconds per fetch of each.

    python benchmarks/store_integrity.py [--model DIR] [--reads 2000] [--rounds 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import crc32c
import numpy as np
import torch

from expertcache.cli import run_script
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.engine.stores import DiskStore, convert_to_disk
from expertcache.models import model_args

VARIANTS = {"o_direct": dict(read_mode="direct", verify=False),
            "o_direct+crc32c": dict(read_mode="direct", verify=True),
            "buffered-dontneed+crc32c": dict(read_mode="buffered", verify=True)}


def fetch_times(stores: dict[str, DiskStore], pairs: np.ndarray) -> dict[str, list[float]]:
    """Seconds per fetch of each store; the stores take turns fetch by fetch, so a busy moment
    of the machine falls on all of them alike."""
    first = next(iter(stores.values()))
    w13, w2 = torch.empty(first.shape.w13), torch.empty(first.shape.w2)
    names = list(stores)
    times = {name: [] for name in names}
    for i, (layer, e) in enumerate(pairs.tolist()):
        name = names[i % len(names)]
        start = time.perf_counter()
        stores[name].read_into(layer, e, w13, w2)
        times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUILTIN_MODEL)
    p.add_argument("--reads", type=int, default=2000, help="fetches per variant and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    ckpt = open_checkpoint(a.model)
    args = model_args(ckpt.config)
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:  # on the work disk, not a tmpfs
        store_dir = convert_to_disk(ckpt, args, Path(tmp))
        stores = {name: DiskStore(store_dir, args, **kw) for name, kw in VARIANTS.items()}
        blob = stores["o_direct"].blob
        rng = np.random.default_rng(0)
        times = {name: [] for name in VARIANTS}
        for r in range(a.rounds + 1):  # round 0 warms up
            n = a.reads * len(stores)
            pairs = np.stack([rng.integers(0, args.num_moe_layers, n), rng.integers(0, args.num_experts, n)], 1)
            for name, t in fetch_times(stores, pairs).items():
                if r:
                    times[name] += t
        data = bytes(blob)
        crc = []
        for _ in range(a.reads):
            start = time.perf_counter()
            crc32c.crc32c(data)
            crc.append(time.perf_counter() - start)
    median_us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    median_us["crc32c alone"] = 1e6 * statistics.median(crc)
    out = {"model": str(a.model), "blob_bytes": blob, "reads_per_variant": a.reads * a.rounds,
           "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}",
           "crc32c_hardware": crc32c.hardware_based, "median_us": median_us,
           "verify_overhead": median_us["o_direct+crc32c"] / median_us["o_direct"] - 1}
    print(f"blob {blob} bytes, {a.reads * a.rounds} fetches per variant, median us per fetch:")
    for name, us in median_us.items():
        print(f"  {name:26s} {us:8.1f}")
    print(f"check overhead on an O_DIRECT fetch: {out['verify_overhead']:+.1%}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_script(main)
