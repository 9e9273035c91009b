"""The disk's raw O_DIRECT read rate for expert-sized blocks (like fio's randread), against
the engine's own fetch path (DiskStore.read_into: O_DIRECT read into a per-thread buffer, the
CRC32C check, then one compiled pass decoding the blob into the fp32 slot), at the queue
depths the engine uses, for each store format.

    python benchmarks/io_probe.py [--model DIR] [--formats fp16 int8 int4] [--reads 512]
                                  [--depths 1 2 4 8] [--repeats 3]

Raw: `depth` threads each read random blocks of the format's store file (one expert each,
aligned) into their own page-aligned buffer, `reads` in all; the store: the same with
read_into into real slots. Per read: latency (submit to completion within its thread) and
CPU time (time.thread_time: the syscall's kernel time and, for the store, the check and the
decode). Round robin across variants, `repeats` times; medians.
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
    from expertcache.engine.quant import ExpertFormat
    from expertcache.engine.stores import open_store
    from expertcache.models import model_args
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUILTIN_MODEL)
    p.add_argument("--formats", nargs="+", default=["fp16", "int8", "int4"], help="store formats (quant.DTYPES)")
    p.add_argument("--reads", type=int, default=512)
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    ckpt = open_checkpoint(a.model)
    args = model_args(ckpt.config)
    stores = {f: open_store("disk", ckpt, args, fmt=ExpertFormat.parse(f)) for f in a.formats}
    local = threading.local()

    def reader(store, raw: bool):
        n_experts = store.shape.num_experts
        slots = torch.zeros((max(a.depths), *store.shape.w13)), torch.zeros((max(a.depths), *store.shape.w2))

        def read(block: int) -> int:
            if raw:
                if getattr(local, "buf", None) is None or len(local.buf) != store.blob:
                    local.buf = mmap.mmap(-1, store.blob)  # page-aligned, as O_DIRECT needs
                return os.preadv(store.fd, [local.buf], block * store.blob)
            s = slot_of.setdefault(threading.get_ident(), len(slot_of))
            layer, expert = divmod(block, n_experts)
            return store.read_into(layer, expert, slots[0][s], slots[1][s])
        return read

    slot_of = {}  # thread -> its own slot, as the engine's transfers write distinct slots
    variants = [(f"{path} {f}", store, reader(store, path == "raw O_DIRECT"))
                for f, store in stores.items() for path in ("raw O_DIRECT", "store.read_into")]
    rng = np.random.default_rng(0)
    results = {}
    for rep in range(a.repeats + 1):  # repetition 0 warms up
        for depth in a.depths:
            for name, store, read in variants:
                slot_of.clear()
                n_blocks = store.shape.num_layers * store.shape.num_experts
                r = run_reads(depth, rng.integers(0, n_blocks, a.reads), read)
                if rep:
                    results.setdefault((name, depth), (store, []))[1].append(r)
    print(f"{a.reads} random reads per run, median of {a.repeats} interleaved runs; blob bytes: "
          + ", ".join(f"{f} {s.blob}" for f, s in stores.items()) + "\n")
    print("| path | queue depth | MB/s | experts/s | median latency us | p90 latency us | CPU us per read |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (name, depth), (store, rs) in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0].split()[-1])):
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        rate = med["reads"] / med["wall_s"]
        print(f"| {name} | {depth} | {store.blob * rate / 1e6:.0f} | {rate:.0f} | {med['median_latency_us']:.0f} | "
              f"{med['p90_latency_us']:.0f} | {med['cpu_us_per_read']:.0f} |")
    for store in stores.values():
        store.close()


if __name__ == "__main__":
    main()
