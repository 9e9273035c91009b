"""The decision kernel is compiled without bounds checks; here it runs once with them (a
fresh process with NUMBA_BOUNDSCHECK=1 and its own cache) over every policy, eviction order
and quota on a small trace, in windows and in decode order."""
import os
import subprocess
import sys

SCRIPT = """
import numpy as np
from pathlib import Path
from expertcache.engine.cache import CacheConfig
from expertcache.lab.simulator import replay
from expertcache.lab.trace import Trace
rng = np.random.default_rng(0)
L, E, N = 3, 24, 200
logits = (rng.normal(0, 1, (N, L, E)) + rng.normal(0, 1.5, (L, E))).astype(np.float16)
header = {"num_layers": L, "num_experts": E, "top_k": 4, "norm_topk_prob": False, "hidden_size": 8,
          "expert_params": 3 * 8 * 4, "context": 50}
trace = Trace(header, np.zeros(N, np.int32), logits)
policies = ["fetch-all", "threshold:tau=0.3", "first-choice:beta=0.2", "substitute-all:sub=drop",
            "substitute-all:sub=window,window=6", "band:lo=0.1,hi=0.3", "conditional:j=1,m=30",
            "quality-first", "llama.cpp", "moe-infinity"]
for policy in policies:
    for quota in ("layer", "global"):
        for window in (None, 1):
            r = replay(trace, policy, CacheConfig(fraction=0.25, quota=quota), window=window)
            assert r.stats.moe_calls == N * L
            if policy == "quality-first":
                r = replay(trace, policy, CacheConfig(fraction=0.25, quota=quota), "demand", window=window)
                assert r.stats.moe_calls == N * L
print("ok")
"""


def test_kernel_in_bounds(tmp_path):
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
