"""--memory-budget bounds the whole fast tier: the engine sizes its expert cache from it, the
KV cache grows to what is used, and a process's peak RSS stays within the budget plus what
the interpreter and its libraries take before any model (measured in the same way)."""
import json
import subprocess
import sys

import pytest
import torch

from expertcache import CacheConfig, Engine, EngineConfig
from expertcache.errors import CacheTooSmall

# Peak RSS of a process that loads the libraries, compiles the kernel and runs a tiny model
# (the baseline), or the built-in model under a budget, generating from the disk store.
SCRIPT = """
import json, resource, sys
import torch
from expertcache import CacheConfig, Engine, EngineConfig, generate
path, budget = sys.argv[1] or None, int(sys.argv[2])
torch.set_num_threads(1)
cfg = EngineConfig(store="disk", max_seq=512, cache=CacheConfig(fraction=1.0, io_workers=2),
                   memory_budget=budget or None, initial="cold")
e = Engine(path, cfg)
list(generate(e, list(range(1, 33)), 32))
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **e.budget()}))
"""


def peak(path, budget):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path or ""), str(budget)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_within_budget(tiny):
    # convert the built-in model's disk store first: conversion reads every expert once
    Engine(None, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25))).close()
    baseline = peak(tiny["qwen3_moe"][0], 0)["peak"]
    budget = 48 * 2**20
    run = peak(None, budget)
    parts = run["dense_bytes"] + run["kv_bytes_max"] + run["buffer_bytes"] + run["cache_bytes"]
    assert parts <= budget and run["cache_bytes"] > budget / 2
    assert run["kv_bytes"] < run["kv_bytes_max"]  # 64 positions used of 512: the KV cache did not take it all
    assert run["peak"] <= baseline + budget, (run["peak"] - baseline) / 2**20


def test_budget_too_small_names_the_parts():
    with pytest.raises(CacheTooSmall, match=r"--memory-budget 4\.0 MiB .*dense weights .*KV cache"):
        Engine(None, EngineConfig(store="ram", memory_budget=4 * 2**20))


def test_kv_cache_grows_and_stays_exact(tiny):
    path, hf = tiny["mixtral"]
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(3))
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=1.0), max_seq=300, initial="cold"))
    assert engine.model.k_cache.shape[2] == 256
    out = [engine.forward(ids[:250], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(250, 300)]
    assert engine.model.k_cache.shape[2] == 300
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(out), hf(ids[None]).logits[0], atol=1e-4, rtol=0)
