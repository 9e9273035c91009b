"""The disk's raw O_DIRECT read rate for expert-sized blocks (like fio's randread), against
the engine's own fetch path (DiskStore.read_into: O_DIRECT read into a per-thread buffer, the
CRC32C check, then one compiled pass decoding the blob into the fp32 slot), at the queue
depths the engine uses, for each store format.

    python benchmarks/io_probe.py [--model DIR] [--formats fp16 int8 int4] [--reads 512]
                                  [--depths 1 2 4 8] [--repeats 3]
    python benchmarks/io_probe.py --fork-join [--batches 300] [--depths 1 2 4 8]

Raw: `depth` threads each read random blocks of the format's store file (one expert each,
aligned) into their own page-aligned buffer, `reads` in all; the store: the same with
read_into into real slots. Per read: latency (submit to completion within its thread) and
CPU time (time.thread_time: the syscall's kernel time and, for the store, the check and the
decode). Round robin across variants, `repeats` times; medians.

--fork-join: what a layer's synchronous fetches are, a batch of `depth` random reads issued
together and all waited for, of the fp16 store into page-aligned fp16 slots. Raw reads (a pool of
`depth` threads, or one io_uring) against the engine's TransferEngine (submit, then wait for each,
through its worker threads or its io_uring), batches interleaved across variants; median
microseconds per batch and CPU time of the calling thread per batch.
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

from expertcache.cli import run_script


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


def fork_join(store, depths: list[int], batches: int) -> None:
    """The --fork-join table (module docstring) for the fp16 disk store `store`."""
    from expertcache.engine.slots import page_aligned_zeros
    from expertcache.engine.transfer import TransferEngine
    from expertcache.engine.uring import RingReads
    S, n_experts = max(depths), store.shape.num_experts
    w13 = page_aligned_zeros((S, *store.shape.w13), torch.float16)
    w2 = page_aligned_zeros((S, *store.shape.w2), torch.float16)
    targets = [store.direct_targets([w13[s], w2[s]]) for s in range(S)]
    pool, ring = ThreadPoolExecutor(S), RingReads.open()
    iovecs = [RingReads.iovec(t) for t in targets] if ring else None
    engines = {io: TransferEngine(store, w13, w2, S, io=io) for io in ("threads", "uring") if io == "threads" or ring}

    def raw_threads(blocks):
        for n in pool.map(lambda sb: os.preadv(store.fd, targets[sb[0]], sb[1] * store.blob), enumerate(blocks)):
            assert n == store.blob

    def raw_uring(blocks):
        for s, b in enumerate(blocks):
            ring.read(store.fd, iovecs[s], b * store.blob, s + 1)
        done = 0
        while done < len(blocks):
            got = ring.completions(block=True)
            assert all(n == store.blob for _, n in got)
            done += len(got)

    def engine(io):
        def run(blocks):
            transfers = [engines[io].submit(*divmod(b, n_experts), s, "fetch") for s, b in enumerate(blocks)]
            engines[io].flush()
            for t in transfers:
                engines[io].wait(t)
        return run
    variants = {"raw, threads": raw_threads, "engine, threads": engine("threads")}
    if ring:
        variants |= {"raw, io_uring": raw_uring, "engine, io_uring": engine("uring")}
    rng, times = np.random.default_rng(0), {}
    n_blocks = store.shape.num_layers * n_experts
    for i in range(batches + 10):  # the first 10 warm up
        for depth in depths:
            for name, run in variants.items():
                blocks = rng.integers(0, n_blocks, depth).tolist()
                t, c = time.perf_counter(), time.thread_time()
                run(blocks)
                if i >= 10:
                    times.setdefault((name, depth), []).append((time.perf_counter() - t, time.thread_time() - c))
    print(f"fork-join batches of random fp16 expert reads ({store.blob} B each) into fp16 slots, median of {batches}\n")
    print("| path | reads per batch | us per batch | vs raw, same backend | MB/s | caller CPU us per batch |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, depth), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        wall, cpu = (statistics.median(x[i] for x in ts) for i in (0, 1))
        raw = statistics.median(x[0] for x in times[("raw, " + name.split(", ")[1], depth)])
        print(f"| {name} | {depth} | {1e6 * wall:.0f} | {wall / raw:.2f}x | {depth * store.blob / wall / 1e6:.0f} | "
              f"{1e6 * cpu:.0f} |")
    for e in engines.values():
        e.close()
    if ring:
        ring.close()


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
    p.add_argument("--fork-join", action="store_true", help="batches of reads issued together (module docstring)")
    p.add_argument("--batches", type=int, default=300, help="--fork-join: batches per variant and depth")
    a = p.parse_args()
    ckpt = open_checkpoint(a.model)
    args = model_args(ckpt.config)
    if a.fork_join:
        store = open_store("disk", ckpt, args, fmt=ExpertFormat.parse("fp16"))
        fork_join(store, a.depths, a.batches)
        store.close()
        return
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
    run_script(main)
