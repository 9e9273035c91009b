"""The disk's raw O_DIRECT read rate for expert-sized blocks (like fio's randread), against
the engine's own fetch path (DiskStore.read_into: O_DIRECT read into a per-thread buffer,
then an fp16 -> fp32 copy into the slot), at the queue depths the engine uses.

    python benchmarks/io_probe.py [--model DIR] [--reads 512] [--depths 1 2 4 8] [--repeats 3]

Raw: `depth` threads each read random blocks of the disk store's file (one expert each,
aligned) into their own page-aligned buffer, `reads` in all; the store: the same with
read_into into real slots. Per read: latency (submit to completion within its thread) and
CPU time (time.thread_time: the syscall's kernel time and, for the store, the copy). Round
robin across variants, `repeats` times; medians.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


def run_reads(depth: int, blocks: np.ndarray, read) -> dict:
    """`read(block)` over `blocks` by `depth` threads, each its share in order; MB/s over the
    whole run, median latency and CPU time per read."""
    lat, cpu = [], []
    lock = threading.Lock()

    def worker(share: np.ndarray) -> None:
        mine_lat, mine_cpu = [], []
        for b in share.tolist():
            t, c = time.perf_counter(), time.thread_time()
            nbytes = read(b)
            mine_cpu.append(time.thread_time() - c)
            mine_lat.append(time.perf_counter() - t)
        assert nbytes > 0
        with lock:
            lat.extend(mine_lat)
            cpu.extend(mine_cpu)

    with ThreadPoolExecutor(depth) as pool:
        t0 = time.perf_counter()
        list(pool.map(worker, np.array_split(blocks, depth)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "median_latency_us": 1e6 * statistics.median(lat),
            "p90_latency_us": 1e6 * float(np.percentile(lat, 90)), "cpu_us_per_read": 1e6 * statistics.mean(cpu),
            "reads": len(lat)}


def main() -> None:
    from expertcache.engine.checkpoint import open_checkpoint
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.engine.stores import open_store
    from expertcache.models import model_args
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUILTIN_MODEL)
    p.add_argument("--reads", type=int, default=512)
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    args = model_args(open_checkpoint(a.model).config)
    store = open_store("disk", open_checkpoint(a.model), args)
    n_blocks, blob = store.shape.num_layers * store.shape.num_experts, store.blob
    local = threading.local()

    def raw(block: int) -> int:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, blob)  # page-aligned, as O_DIRECT needs
        return os.preadv(store.fd, [local.buf], block * blob)

    slots = torch.zeros((max(a.depths), *store.shape.w13)), torch.zeros((max(a.depths), *store.shape.w2))
    slot_of = {}  # thread -> its own slot, as the engine's transfers write distinct slots

    def via_store(block: int) -> int:
        s = slot_of.setdefault(threading.get_ident(), len(slot_of))
        layer, expert = divmod(block, store.shape.num_experts)
        return store.read_into(layer, expert, slots[0][s], slots[1][s])

    rng = np.random.default_rng(0)
    results = {}
    for rep in range(a.repeats + 1):  # repetition 0 warms up
        for depth in a.depths:
            for name, read in (("raw O_DIRECT", raw), ("store.read_into", via_store)):
                slot_of.clear()
                r = run_reads(depth, rng.integers(0, n_blocks, a.reads), read)
                if rep:
                    results.setdefault((name, depth), []).append(r)
    print(f"blocks of {blob} bytes ({store.dtype}), {n_blocks} blocks in the store file, "
          f"{a.reads} random reads per run, median of {a.repeats} interleaved runs\n")
    print("| path | queue depth | MB/s | median latency us | p90 latency us | CPU us per read |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, depth), rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {name} | {depth} | {blob * med['reads'] / med['wall_s'] / 1e6:.0f} | "
              f"{med['median_latency_us']:.0f} | {med['p90_latency_us']:.0f} | {med['cpu_us_per_read']:.0f} |")
    store.close()


if __name__ == "__main__":
    main()
