"""The decision kernel is compiled without bounds checks; here it runs once with them (a
fresh process with NUMBA_BOUNDSCHECK=1 and a cache of its own, kept across runs: numba recompiles what
changed, by each source file's stamp) over every policy, eviction order
and quota on a small trace, in windows and in decode order. And where its machine code is
cached: in the project's folder per kernel version, with numba's configuration untouched."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
# every policy, and each parameter at the edges of its checked range (top-k 4 of 24 experts)
policies = ["fetch-all", "threshold:tau=0.3", "first-choice:beta=0.2", "substitute-all:sub=drop",
            "substitute-all:sub=window,window=6", "band:lo=0.1,hi=0.3", "conditional:j=1,m=24",
            "quality-first", "llama.cpp", "moe-infinity", "conditional:j=4,m=4", "conditional:j=0,m=5",
            "substitute-all:sub=window,window=5", "threshold:tau=0,sub=window,window=24", "band:lo=0,hi=1,sub=drop",
            "threshold:tau=1,beta=0", "lowbit:tau=0.3,lo=0.1,upgrade=1", "lowbit:tau=1,upgrade=1"]
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


def test_kernel_in_bounds():
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "expertcache-numba-boundscheck"
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


CACHE_SCRIPT = """
import sys
import numba, numpy as np
before = numba.config.CACHE_DIR
from expertcache.kernel import compiled, routing
assert numba.config.CACHE_DIR == before, (before, numba.config.CACHE_DIR)
routing._block_max(np.zeros(16, np.int64), 0, 16)  # a kernel function: compiled, cached
sys.path.insert(0, sys.argv[1])
import user_module  # somebody else's cached function
user_module.f(1)
print(compiled.cache_dir())
"""


@pytest.mark.parametrize("numba_dir", [False, True])
def test_kernel_cache_leaves_numba_config_alone(tmp_path, numba_dir):
    (tmp_path / "user_module.py").write_text("import numba\n@numba.njit(cache=True)\ndef f(x):\n    return x + 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if numba_dir:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    out = subprocess.run([sys.executable, "-c", CACHE_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    kernel_dir = Path(out.stdout.strip())
    base = tmp_path / ("numba" if numba_dir else "xdg")
    assert kernel_dir.parent == base / "expertcache-numba" and len(kernel_dir.name) == 16  # one folder per version
    assert [f.name.split("-")[0] for f in kernel_dir.glob("*.nbi")] == ["routing._block_max"]
    user = [f.parent for f in tmp_path.rglob("user_module.f-*.nbi")]
    # numba's own choice for everyone else: NUMBA_CACHE_DIR, else __pycache__ beside the module
    assert user and all(u != kernel_dir and (u.is_relative_to(base) if numba_dir else u.name == "__pycache__")
                        for u in user), user
