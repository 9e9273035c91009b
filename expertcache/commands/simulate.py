"""expertcache simulate: replay policies on a trace over a sweep of cache sizes."""
from __future__ import annotations

import argparse
import functools
import signal
import threading
from pathlib import Path

from ..choices import BENCH_POLICIES, INITIAL
from ..errors import BadInput, CheckpointError
from .options import add_json_argument, announce_compile, fraction, plot_path, positive_int, write_json

HELP = "replay miss policies on a router-logit trace: hits, fetches, substitutions per cache size"


def add_arguments(p):
    """The verb's options."""
    p.add_argument("trace", type=Path, help="a trace file written by `expertcache trace`")
    p.add_argument("--policies", nargs="+", default=list(BENCH_POLICIES), help="policy specs to replay")
    p.add_argument("--cache", type=fraction, nargs="+", default=[0.25], help="cache fractions to sweep")
    p.add_argument("--eviction", default=None, help="lru, lfu, freq, halving or demand (default: each policy's choice)")
    p.add_argument("--initial", default="auto", choices=INITIAL,
                   help="warm (the model's routing counts), cold or auto")
    p.add_argument("--profile", default=None, help="cost model: a calibrate-hw file, rtx3090-qwen3-next or "
                                                   "a6000-qwen3-30b; adds estimated ms/token")
    p.add_argument("--window", type=positive_int, default=None,
                   help="tokens decided per layer call: the trace's context (default, as ppl runs) or 1 (decode)")
    p.add_argument("--jobs", type=job_count, default=1,
                   help="replay the sweep in this many local processes, or 'ray' for a Ray cluster")
    p.add_argument("--ray-address", default=None,
                   help="with --jobs ray: the cluster to join, e.g. ray://head:10001 or auto (default: a local Ray)")
    p.add_argument("--plot", type=plot_path, default=None, help="time vs substituted-mass frontier PNG")
    add_json_argument(p)


def job_count(text: str) -> int | str:
    """An argparse type: a process count >= 1, or 'ray'."""
    if text == "ray":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a process count >= 1 or 'ray'") from None


@functools.lru_cache(maxsize=4)
def _load(trace_path: str, initial: str):
    """A trace, its routes and warm-start counts, once per process (a sweep's jobs share them).
    initial: warm (the counts beside the trace's model, which must be there), cold, or auto
    (warm when the counts are there)."""
    from ..engine.checkpoint import ROUTING_COUNTS, load_routing_counts
    from ..lab.simulator import route_trace
    from ..lab.trace import read_trace
    trace = read_trace(Path(trace_path))
    h = trace.header
    model = Path(h["model"])
    counts = None if initial == "cold" else load_routing_counts(model, (h["num_layers"], h["num_experts"]))
    if initial == "warm" and counts is None:
        raise CheckpointError(f"{model / ROUTING_COUNTS} (the model of trace {trace_path}) is missing for a warm "
                              f"start; run `expertcache calibrate --model {model}` or pass --initial cold")
    return trace, route_trace(trace), counts


UNMEASURED = ("predict_s", "stall_s", "wall_s", "compile_s", "peak_memory_bytes", "read_mode", "kernels",
              "ms_per_token")


def task(trace_path: str, policy: str, fraction: float, eviction: str | None, initial: str,
         profile: str | None, window: int | None = None) -> dict:
    """One unit of a sweep: a pure function of its arguments returning one JSON-able row, so a
    sweep can go to a process pool here or to any cluster scheduler as independent jobs."""
    from ..engine.cache import CacheConfig
    from ..lab.costmodel import load_profile
    from ..lab.simulator import replay
    trace, routes, counts = _load(trace_path, initial)
    h = trace.header
    cost = load_profile(profile, (h["num_layers"], h["top_k"], h["expert_params"], f"trace {trace_path}")) \
        if profile else None
    r = replay(trace, policy, CacheConfig(fraction=fraction), eviction, counts, routes=routes, window=window)
    est = cost.ms_per_token(r.stats) if cost else None  # no profile, no estimate
    # a replay counts; it times and holds nothing of the engine's: those fields are null, not a measured zero
    unmeasured = dict.fromkeys(UNMEASURED)
    return {"policy": policy, "cache": fraction, "start": "cold" if counts is None else "warm",
            "events_per_second": r.events_per_second, "routing_seconds": routes.seconds, "estimated_ms_per_token": est,
            **r.stats.to_dict(), **unmeasured}


def run_tasks(tasks: list[tuple], jobs: int | str = 1, ray_address: str | None = None,
              ray_init: dict | None = None) -> list[dict]:
    """`task(*t)` for every t of `tasks`, in order: here (jobs 1), on a local process pool
    (jobs N) or as Ray tasks (jobs 'ray': `ray.remote` over the same pure function, on the
    cluster at `ray_address` or a local Ray; `ray_init` passes more ray.init options). Every
    worker must see the trace file at the same path (a shared file system)."""
    if jobs == "ray":
        try:
            import ray
        except ImportError:
            raise BadInput("--jobs ray needs Ray: pip install 'expertcache[cluster]' (or pip install ray)") from None
        started = not ray.is_initialized()
        # ray.init sets its own SIGTERM handler, which raises SystemExit wherever the thread is, and shutdown leaves
        # it: a later `timeout` on the caller (a test run) failed one test and went on instead of ending it
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        if started:
            ray.init(address=ray_address, **(ray_init or {}))
        try:
            remote = ray.remote(task)
            return ray.get([remote.remote(*t) for t in tasks])
        finally:
            if started:
                ray.shutdown()
                if threading.current_thread() is threading.main_thread():
                    for s, handler in handlers.items():
                        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if jobs > 1:
        import multiprocessing
        # spawn, not fork: a forked child of a process whose OpenMP threads have run can hang
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            return pool.starmap(task, tasks)
    return [task(*t) for t in tasks]


def run(a) -> int:
    """Run the verb; returns the exit code."""
    announce_compile("simulator")
    from ..lab.trace import read_trace
    trace = read_trace(a.trace)
    from ..engine.cache import CacheConfig, slots_per_layer
    from ..lab.simulator import trace_shape
    h = trace.header
    for size in a.cache:  # checked before any replay; its fix names neither bytes nor --quota, which simulate lacks
        slots_per_layer(CacheConfig(fraction=size), trace_shape(h), 2 * h["expert_params"], h["top_k"],
                        quota_hint=False, bytes_hint=False)
    # a policy or cache size given twice is replayed once, as bench and study run it: not a second identical row
    tasks = [(str(a.trace), policy, fraction, a.eviction, a.initial, a.profile, a.window)
            for fraction in dict.fromkeys(a.cache) for policy in dict.fromkeys(a.policies)]
    if a.ray_address and a.jobs != "ray":
        raise BadInput("--ray-address applies with --jobs ray; add --jobs ray or leave --ray-address out")
    rows = run_tasks(tasks, a.jobs, a.ray_address)
    model = Path(trace.header["model"])
    # said, since --initial auto starts cold where the trace's model has no routing counts (or no longer exists)
    print(f"start: warm, from {model / 'routing_counts.json'}" if rows and rows[0]["start"] == "warm" else
          f"start: cold ({'as asked' if a.initial == 'cold' else f'no routing counts beside {model}'})")
    print("| policy | cache | hit rate | fetches/token | admissions + upgrades/token | slots subst. | mass/call "
          "| est. ms/token | events/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['policy']}` | {r['cache']:g} | {r['hit_rate']:.1%} | {r['fetches_per_token']:.2f} | "
              f"{r['background_fetches'] / r['tokens']:.3f} | {100 * r['substitutions'] / r['routed']:.1f}% | "
              f"{r['substituted_mass_per_call']:.4f} | "
              f"{'-' if r['estimated_ms_per_token'] is None else format(r['estimated_ms_per_token'], '.2f')} | "
              f"{r['events_per_second'] / 1e6:.2f}M |")
    write_json(a.json, {"trace": str(a.trace), "header": trace.header, "runs": rows})
    if a.plot:
        plot_frontier(rows, a.plot)
    return 0


def plot_frontier(rows: list[dict], path: Path) -> None:
    """Estimated time per token (fetches per token without a profile) against substituted
    mass, the perplexity proxy; one point per (policy, cache size)."""
    from ..lab.plots import scatter
    timed = all(r["estimated_ms_per_token"] is not None for r in rows)
    y = "estimated_ms_per_token" if timed else "fetches_per_token"
    scatter({f"{r['policy']} @{r['cache']:g}": (r["substituted_mass_per_call"], r[y]) for r in rows},
            "substituted gate mass per MoE call", "estimated ms/token" if timed else "synchronous fetches/token",
            "Replayed policies: time vs substituted mass", path, frontier=True,
            short={f"{r['policy']} @{r['cache']:g}": r["policy"] for r in rows},
            groups={f"{r['policy']} @{r['cache']:g}": f"cache {r['cache']:g}" for r in rows})
