"""Where a decode token's time goes: wall-clock per stage of the engine's forward, decoding
greedily with every expert resident (or a smaller cache), stages timed with perf_counter by
wrapping the engine's own functions in this process.

    python benchmarks/decode_profile.py [--model DIR] [--device cuda] [--store ram] [--cache 1.0] [--tokens 64]
        [--trials 5] [--store-dtype int4 --slot-dtype int4 --dense-dtype int4] [--json FILE]

Stages (nested stages are subtracted from their parents): attention (the dense attention
block, norms excluded; the compiled decode block includes its two norms), route (router
product, host sync, top-k), decide (the decision kernel call), carry_out (logged actions:
transfers, waits),
absorb (counters), experts (the k experts' compute), lm_head (final norm and logits), and
the rest of the forward (norms, residual adds, the MoE runner's Python, the engine's
bookkeeping). The wrappers add ~0.3 us per call, which falls into the stage they wrap.

On CUDA a stage's time is the host's: launching its kernels, and waiting where it syncs (route). One more
trial then runs under PyTorch's profiler for what the device did in a token: its kernels' summed time, and
the kernel launches, host-device copies and synchronizations the host made.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from expertcache.cli import run_script


class StageTimer:
    """Accumulates wall seconds per stage; nested stages are charged to the innermost one."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.stack: list[list] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            frame = [name, 0.0]  # [name, seconds of nested stages]
            self.stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.stack.pop()
                self.total[name] += dt - frame[1]
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1][1] += dt
        return timed

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


class TimedExperts:
    """The runner's compiled expert calls, both timed as "experts"."""

    def __init__(self, inner, timer: StageTimer):
        self.inner, self.call, self.window = inner, timer.wrap("experts", inner), timer.wrap("experts", inner.window)

    def __call__(self, *args):
        return self.call(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def instrument(engine, timer: StageTimer) -> None:
    """Wrap the engine's stages in `timer` (this process only)."""
    from expertcache.engine import moe
    m, cache = engine.model, engine.cache
    m._attention = timer.wrap("attention", m._attention)
    m._attention_token = timer.wrap("attention", m._attention_token)  # the compiled block, norms included
    for i, f in list(m.linear.items()):
        m.linear[i] = timer.wrap("attention", f)
    moe.route = timer.wrap("route", moe.route)
    moe.experts_compute = timer.wrap("experts", moe.experts_compute)
    if engine.runner.compiled is not None:  # the compiled expert calls on the CPU, a token's and a window's
        engine.runner.compiled = TimedExperts(engine.runner.compiled, timer)
    m._logits_token = timer.wrap("lm_head", m._logits_token)
    decide = "decide_routed" if hasattr(cache, "decide_routed") else "decide"  # the runner's call
    setattr(cache, decide, timer.wrap("decide", getattr(cache, decide)))
    cache.carry_out = timer.wrap("carry_out", cache.carry_out)
    cache.poll = timer.wrap("poll", cache.poll)
    engine.stats.absorb = timer.wrap("absorb", engine.stats.absorb)


def profile(a) -> dict:
    from expertcache.engine.cache import CacheConfig
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.engine.quant import ExpertFormat
    fmt = ExpertFormat.parse(a.store_dtype, 32) if a.store_dtype else None
    engine = Engine(a.model, EngineConfig(device=a.device, store=a.store, cache=CacheConfig(fraction=a.cache),
                                          policy=a.policy, store_format=fmt, slot_dtype=a.slot_dtype,
                                          dense_dtype=a.dense_dtype))
    if a.cache >= 1.0:  # every expert resident from the start, whatever routing counts the checkpoint has
        import numpy as np
        engine.routing_counts = np.ones((engine.args.num_moe_layers, engine.args.num_experts))
        engine.config = replace(engine.config, initial="auto")
    timer = StageTimer()
    instrument(engine, timer)
    forward = timer.wrap("forward", engine.forward)
    prompt = engine.encode("KING HENRY.\nNow, lords, for France; the enterprise whereof")

    def decode() -> float:
        """Greedy tokens after the prompt; wall seconds of the decode."""
        engine.reset()
        tok = int(forward(torch.tensor(prompt), 0)[-1].argmax())
        pos = len(prompt)
        timer.reset()
        start = time.perf_counter()
        for _ in range(a.tokens):
            tok = int(forward(torch.tensor([tok]), pos)[-1].argmax())  # argmax on the host: one sync a token
            pos += 1
        return time.perf_counter() - start

    per_trial, stage_trials = [], defaultdict(list)
    for trial in range(a.trials + 1):  # trial 0 warms up
        wall = decode()
        if trial:
            per_trial.append(1e3 * wall / a.tokens)
            stage_trials["outside forward"].append(1e3 * (wall - sum(timer.total.values())) / a.tokens)
            for name, s in timer.total.items():
                stage_trials[name].append(1e3 * s / a.tokens)
    calls = {name: n / a.tokens for name, n in timer.calls.items()}
    result = {"ms_per_token": statistics.median(per_trial),
              "stages_ms": {k: statistics.median(v) for k, v in stage_trials.items()}, "calls_per_token": calls}
    if engine.device.type == "cuda":
        result["device"] = device_counts(decode, a.tokens)
    engine.close()
    return result


def device_counts(decode, tokens: int) -> dict:
    """One decode under PyTorch's profiler: per token, the device's kernel time and the host's kernel launches,
    copies and synchronizations (the runtime's calls, as the profiler names them)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode()
    rows = prof.key_averages()

    def count(match) -> float:
        return sum(r.count for r in rows if match(r.key)) / tokens
    device_us = sum(r.self_device_time_total for r in rows if r.device_type == torch.autograd.DeviceType.CUDA)
    return {"kernel_ms": device_us / 1e3 / tokens,
            "launches": count(lambda k: k in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                               "cuLaunchKernelEx")),
            "copies": count(lambda k: k.startswith("cudaMemcpy")),
            "syncs": count(lambda k: k.startswith("cuda") and "Synchronize" in k)}


def main() -> None:
    from expertcache.engine.engine import BUILTIN_MODEL
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUILTIN_MODEL)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--store", default="ram")
    p.add_argument("--cache", type=float, default=1.0)
    p.add_argument("--policy", default="fetch-all")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--store-dtype", default=None, help="the disk store's format (default: the checkpoint's)")
    p.add_argument("--slot-dtype", default="auto")
    p.add_argument("--dense-dtype", default="auto")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON to FILE")
    a = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    r = profile(a)
    if a.json:
        a.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(a).items()}, **r}, indent=1))
    print(f"{a.store} store, cache {a.cache}, {a.policy}: {r['ms_per_token']:.3f} ms/token "
          f"(median of {a.trials} trials of {a.tokens} tokens; stage medians need not sum exactly)\n")
    print("| stage | ms/token | share | calls/token |\n|---|---:|---:|---:|")
    names = sorted(r["stages_ms"], key=lambda k: -r["stages_ms"][k])
    for k in names:
        ms = r["stages_ms"][k]
        label = "rest of forward (norms, adds, runner, bookkeeping)" if k == "forward" else k
        print(f"| {label} | {ms:.3f} | {ms / r['ms_per_token']:.0%} | {r['calls_per_token'].get(k, 0):.0f} |")
    if "device" in r:
        d = r["device"]
        print(f"\nper token on the device: kernels {d['kernel_ms']:.3f} ms; the host made {d['launches']:.0f} kernel "
              f"launches, {d['copies']:.0f} copies and {d['syncs']:.0f} synchronizations")


if __name__ == "__main__":
    run_script(main)
