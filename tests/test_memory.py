"""--memory-budget bounds the whole fast tier: the engine sizes its expert cache from it, the
KV cache grows to what is used, and a process's peak RSS stays within the budget plus what
the interpreter and its libraries take before any model (measured in the same way)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache import CacheConfig, Engine, EngineConfig
from expertcache.engine.perplexity import EVAL_TEXT
from expertcache.errors import BadInput, CacheTooSmall, NotEnoughMemory

# In a fresh process: the libraries, the compiled kernels (the predictor's too: compiled where numba's cache is
# empty, which took ~90 MiB more than the budget), their thread pool and the tokenizer first (the baseline, by
# running the built-in model once with every expert in fp32 slots, then closing it), then the
# built-in model under a budget, generating from the disk store; the peak RSS of that part alone (Linux resets
# the high-water mark on request).
SCRIPT = """
import gc, json, re, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer
from expertcache import BUILTIN_MODEL, CacheConfig, Engine, EngineConfig, generate
from expertcache.engine.moe import PrefetchConfig

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

torch.set_num_threads(1)
# fp32 slots: every expert alone (90 MiB) exceeds the budget below
cfg = EngineConfig(store="disk", max_seq=512, cache=CacheConfig(fraction=1.0, io_workers=2), initial="cold",
                   slot_dtype="fp32")
prefetch = PrefetchConfig(sys.argv[2]) if sys.argv[2] != "-" else None
warm = Engine(None, EngineConfig(**{**cfg.__dict__, "prefetch": prefetch}))  # the predictor's kernels too
list(generate(warm, list(range(1, 33)), 4))
tokenizer = Tokenizer.from_file(str(BUILTIN_MODEL / "tokenizer.json"))
warm.close()
del warm
gc.collect()
base = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
e = Engine(None, EngineConfig(**{**cfg.__dict__, "memory_budget": int(sys.argv[1]), "prefetch": prefetch,
                                 "cache": CacheConfig(io_workers=2)}))
list(generate(e, list(range(1, 33)), 32))
print(json.dumps({"base": base, "peak": status("VmHWM"), "anon": status("RssAnon"), "file": status("RssFile"),
                  **e.budget()}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("predictor,budget", [("-", 48 * 2**20), ("lookahead", 72 * 2**20)])
def test_peak_rss_within_budget(predictor, budget):
    """Also with the lookahead's prefetch, whose nets and sketches (~14 MiB) the budget counts."""
    Engine(None, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25))).close()  # convert the store first
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(budget), predictor], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    parts = run["dense_bytes"] + run["kv_bytes_max"] + run["buffer_bytes"] + run["workspace_bytes"] + \
        run["cache_bytes"] + run["predictor_bytes"]
    assert parts <= budget and run["cache_bytes"] > budget / 5
    assert (run["predictor_bytes"] > 8 * 2**20) == (predictor == "lookahead")
    assert run["kv_bytes"] < run["kv_bytes_max"]  # 64 positions used of 512: the KV cache did not take it all
    assert run["peak"] - run["base"] <= budget, {k: run[k] / 2**20 for k in ("base", "peak", "anon", "file")}
    # without the budget the same run holds every expert: more than the budget allows
    assert run["expert_bytes_fast"] * 128 * 6 > budget


def test_budget_too_small_names_the_parts():
    with pytest.raises(CacheTooSmall, match=r"--memory-budget 4\.0 MiB .*dense weights .*KV cache"):
        Engine(None, EngineConfig(store="ram", memory_budget=4 * 2**20))


def test_a_budget_short_of_a_full_pass_takes_smaller_passes_and_computes_the_same():
    """A budget that a forward pass of 512 tokens' workspace would leave without a top-k set of slots runs in
    smaller passes, the same logits, where it was refused."""
    from expertcache.engine.generate import prefill
    config = EngineConfig(store="disk", max_seq=600)
    full = Engine(None, config)
    ids = full.encode(EVAL_TEXT.read_text()[:4000])[:300]
    budget = full.plan.total + full._least_slots_bytes() - 1
    want = prefill(full, ids)
    full.close()
    short = Engine(None, replace(config, memory_budget=budget))
    assert short.forward_tokens < 512 and short.plan.total + short._least_slots_bytes() <= budget
    torch.testing.assert_close(prefill(short, ids), want, atol=1e-4, rtol=0)
    short.close()


def test_a_larger_budget_never_gives_fewer_slots():
    """A budget that just fits a full pass's workspace gave it all but a top-k set of slots: 110M ran with 13 slots
    a layer where 105M had 43, and passes of powers of two still dipped them where one doubled. Nor may slots past
    a top-k set starve a prompt's passes: the pass first takes the size that reads least for a prompt token and a
    decoded one together (64 tokens on the built-in model at 2,048 positions), the slots the rest; past every
    expert held, the pass grows. A decode's slots (on the CPU, the long pass's workspace too) never fewer either."""
    ran, decode = [], []
    for mib in range(80, 170, 6):
        engine = Engine(None, EngineConfig(store="ram", memory_budget=mib * 2**20, max_seq=2048))
        ran.append((engine.budget()["slots_per_layer_long_pass"], engine.forward_tokens))
        decode.append(engine.cache.per_layer)
        engine.close()
    least = engine.args.top_k
    assert ran == sorted(ran) and ran[-1] == (128, 512), ran
    assert all(tokens >= 64 or slots == least for slots, tokens in ran) and ran[0] == (least, ran[0][1]), ran
    assert [slots for slots, _ in ran if slots > least][0] < 60, ran  # slots grow with the budget from there
    assert decode == sorted(decode) and all(d >= s for d, (s, _) in zip(decode, ran)), decode
    assert any(d > s for d, (s, _) in zip(decode, ran)), decode


def test_short_prompts_known_ahead_give_the_slots_what_longer_passes_would_take(tmp_path):
    """With longest_prompt a budget plans passes no longer than the prompts, and the slots take the rest: more of
    them at the same budget, the same logits, a prompt past the bound run in more passes. `generate` counts its
    prompt's tokens before the engine loads, `ppl` passes its window."""
    from expertcache import cli
    from expertcache.engine.generate import prefill
    budget = 90 * 2**20
    config = EngineConfig(store="ram", memory_budget=budget, max_seq=2048, initial="cold")
    planned = Engine(None, config)
    short = Engine(None, replace(config, longest_prompt=16))
    assert planned.forward_tokens > 16 >= short.forward_tokens
    assert short.cache.active > planned.cache.active  # in a prompt's passes
    assert short.plan.total + short.cache.active * short.cache.expert_bytes * 6 <= budget
    ids = planned.encode(EVAL_TEXT.read_text()[:2000])[:40]
    torch.testing.assert_close(prefill(short, ids), prefill(planned, ids), atol=1e-4, rtol=0)
    slots, hello = planned.budget()["slots_per_layer_long_pass"], len(planned.encode("Hello there"))
    planned.close()
    short.close()
    with pytest.raises(BadInput, match="longest_prompt=0 must be a positive number of tokens"):
        EngineConfig(longest_prompt=0)
    assert cli.main(["generate", "--store", "ram", "--memory-budget", "90M", "-n", "2", "--json",
                     str(tmp_path / "g.json"), "Hello there"]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["budget"]["slots_per_layer_long_pass"] == Engine(
        None, replace(config, longest_prompt=hello)).budget()["slots_per_layer_long_pass"] > slots


def held(engine: Engine) -> int:
    """The bytes of the fast tier as `Engine.budget` reports them now: the planned parts and the slots in use."""
    b = engine.budget()
    return sum(b[part] for part in ("planned_dense_bytes", "kv_bytes_max", "buffer_bytes", "workspace_bytes",
                                    "predictor_bytes", "cache_bytes"))


@pytest.mark.parametrize("quota", ["layer", "global"])
def test_a_decode_takes_back_a_long_pass_workspace_as_slots(quota):
    """Under a budget on the CPU, a long prompt's passes hold a top-k set of slots beside their workspace, and a
    decode step the slots that workspace gave back (a scored window's logits among them, which a decode never holds);
    the next long pass empties them again and gives their pages back to the system. Fetch-every-miss stays exact
    throughout."""
    config = EngineConfig(store="disk", max_seq=600, initial="cold", cache=CacheConfig(quota=quota))
    plain = Engine(None, replace(config, cache=CacheConfig(fraction=1.0)))
    lent = Engine(None, replace(config, memory_budget=40 * 2**20))
    long, short = lent.budget()["slots_per_layer_long_pass"], lent.budget()["slots_per_layer_short_pass"]
    assert lent.forward_tokens > 16 and short > long and lent.cache.per_layer == short
    ids = torch.tensor(plain.encode(EVAL_TEXT.read_text()[:6000])[:lent.forward_tokens + 40])
    L, S = lent.args.num_moe_layers, lent.cache.num_slots
    for start in (0, 1):  # a second prompt after a decode, as a chat's next turn
        prompt = ids[start:-8]
        torch.testing.assert_close(lent.forward(prompt, 0), plain.forward(prompt, 0), atol=1e-4, rtol=0)
        assert lent.cache.active == long and held(lent) <= lent.config.memory_budget
        resident = lent.cache.state.owner >= 0
        assert resident.sum() <= long * L
        cut = np.zeros(S, bool)
        if quota == "layer":
            for layer in range(L):
                cut[layer * short + long:(layer + 1) * short] = True
        else:
            cut[long * L:] = True
        assert not resident[cut].any() and not np.isin(lent.cache.slot_of, np.flatnonzero(cut)).any()
        slots = lent.cache.w13 if lent.cache.w13 is not None else lent.cache.blobs
        if start:  # the decode's slots given back: their pages read as zeros
            assert not slots[torch.from_numpy(cut)].any()
        for t in range(len(prompt), len(ids)):
            torch.testing.assert_close(lent.forward(ids[t:t + 1], t), plain.forward(ids[t:t + 1], t), atol=1e-4,
                                       rtol=0)
        assert lent.cache.active == short and (lent.cache.state.owner >= 0).sum() > long * L
        assert held(lent) <= lent.config.memory_budget  # a decode's workspace: not a scored window's logits
        assert lent.budget()["workspace_bytes"] < lent.plan.workspace - lent.args.vocab_size * 4 * 500
    lent.close()
    plain.close()


def test_an_address_space_limit_short_of_a_decodes_slots_runs_without_lending_them(monkeypatch):
    """Under an address-space limit (ulimit -v) every slot mapped counts, touched or not. Where the limit holds a long
    pass's slots but not the more a decode would take back, the run keeps the long pass's slots throughout rather
    than being refused; short of those too, it is refused in one line naming the limit."""
    from expertcache.engine import engine as engine_module
    config = EngineConfig(store="disk", max_seq=600, initial="cold", memory_budget=40 * 2**20)
    lending = Engine(None, config)
    long, short = lending.budget()["slots_per_layer_long_pass"], lending.budget()["slots_per_layer_short_pass"]
    one, fixed = lending.cache.expert_bytes * lending.args.num_moe_layers, lending.plan.total
    lending.close()
    assert short > long + 1
    monkeypatch.setattr(engine_module, "kernels_cached", lambda: True)
    for room in (fixed + (long + short) // 2 * one, fixed // 2):
        monkeypatch.setattr(engine_module, "available_memory", lambda: room)
        monkeypatch.setattr(engine_module, "address_space_room", lambda: room)
        if room > fixed + long * one:
            engine = Engine(None, config)
            assert engine.cache.per_layer == engine.budget()["slots_per_layer_short_pass"] == long
            engine.forward(torch.tensor([1, 2, 3]), 0)
            assert engine.cache.active == long
            engine.close()
        else:
            with pytest.raises(NotEnoughMemory, match=r"address-space limit leaves \(ulimit -v\)"):
                Engine(None, config)


def test_loading_holds_one_layer_of_the_dense_matrices_it_converts(monkeypatch):
    """The dense weights are read as they are converted (weights.DenseWeights): into int4, a load holds one layer's
    source matrices at most, not every layer's. At real shape all of them (294 MB of bf16) stood beside their int4
    while loading, 125 MiB past the memory budget of a tenth of its experts."""
    import weakref

    from expertcache.engine import weights
    live, most, read = set(), [0], weights.DenseWeights.__getitem__

    def tracked(self, name):
        t = read(self, name)
        if weights.is_matrix(name) and name != "embed" and not name.endswith(".router"):  # those two are kept
            live.add(id(t))
            weakref.finalize(t, live.discard, id(t))
            most[0] = max(most[0], len(live))
        return t
    monkeypatch.setattr(weights.DenseWeights, "__getitem__", tracked)
    engine = Engine(None, EngineConfig(store="disk", dense_dtype="int4", initial="cold"))
    layer = [n for n in weights.dense_names(engine.checkpoint, engine.args) if n.startswith("layers.0.")
             and weights.is_matrix(n) and not n.endswith(".router")]
    assert engine.args.num_layers > 1 and 0 < most[0] <= len(layer) + 1, (most, layer)
    engine.close()


def test_kv_cache_grows_and_stays_exact(tiny):
    path, hf = tiny["mixtral"]
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(3))
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=1.0), max_seq=300, initial="cold"))
    assert engine.model.k_cache.shape[2] == 256
    out = [engine.forward(ids[:250], 0)] + [engine.forward(ids[p:p + 1], p) for p in range(250, 300)]
    assert engine.model.k_cache.shape[2] == 300
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(out), hf(ids[None]).logits[0], atol=1e-4, rtol=0)


@pytest.mark.skipif(bool(__import__("expertcache.lab.cgroup", fromlist=["x"]).unavailable()),
                    reason="no memory cgroup can be created here (needs root or a delegated cgroup v2 subtree)")
def test_generate_fits_a_real_memory_cap(tmp_path):
    """Under a cgroup capped at the process's own baseline (imports and kernels, measured in a cgroup of its own)
    plus --memory-budget and 5%, `expertcache generate` from the disk store runs to its end without the OOM
    killer, its peak charge (resident memory and page cache) within the cap; a budget too small is refused in
    one line before any weight is read."""
    from expertcache.lab.cgroup import run_capped
    Engine(None, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25))).close()  # the store, converted
    warm = [sys.executable, "-c", "from expertcache import Engine, EngineConfig, generate; "
                                  "list(generate(Engine(None, EngineConfig(store='disk', max_seq=16)), [1, 2], 2))"]
    base = run_capped(warm, None, timeout=600)
    assert base.returncode == 0, base.stderr[-2000:]
    budget = 64 * 2**20
    cmd = [sys.executable, "-m", "expertcache.cli", "generate", "-p", "KING HENRY.", "-n", "24", "--max-seq", "256",
           "--memory-budget", str(budget)]
    run = run_capped(cmd, int((base.peak_bytes + budget) * 1.05), timeout=600)
    assert run.returncode == 0 and not run.oom_killed, run.stderr[-2000:]
    assert run.peak_bytes <= (base.peak_bytes + budget) * 1.05
    small = run_capped(cmd[:-1] + ["4M"], int((base.peak_bytes + budget) * 1.05), timeout=600)
    assert small.returncode == 2 and small.stderr.strip().count("\n") == 0 and "at least" in small.stderr


@pytest.mark.skipif(bool(__import__("expertcache.lab.cgroup", fromlist=["x"]).unavailable()),
                    reason="no memory cgroup can be created here (needs root or a delegated cgroup v2 subtree)")
def test_a_run_larger_than_the_free_memory_is_refused_not_killed():
    """Under a cgroup cap that leaves less than a run would hold (every expert in the ram store and in fp32 slots),
    `expertcache generate` ends with exit 2 and one line naming what it would hold and the fixes, before loading:
    not with the OOM killer."""
    from expertcache.lab.cgroup import run_capped
    warm = [sys.executable, "-c", "from expertcache import Engine, EngineConfig, generate; "
                                  "list(generate(Engine(None, EngineConfig(store='ram', max_seq=16)), [1, 2], 2))"]
    base = run_capped(warm, None, timeout=600)
    assert base.returncode == 0, base.stderr[-2000:]
    cmd = [sys.executable, "-m", "expertcache.cli", "generate", "-p", "KING HENRY.", "-n", "8", "--store", "ram",
           "--cache", "1.0", "--slot-dtype", "fp32"]
    run = run_capped(cmd, base.peak_bytes + 64 * 2**20, timeout=600)
    err = run.stderr.strip()
    assert run.returncode == 2 and not run.oom_killed and err.count("\n") == 0, err[-2000:]
    assert "this machine has free" in err and "--store disk" in err, err


def test_an_address_space_limit_below_the_libraries_is_refused_in_one_line():
    """Under an address-space limit (ulimit -v) smaller than what PyTorch, LLVM and the BLAS map before a model
    loads, a verb ends at once with one line naming the limit and the fix, and the Python API with that error as
    the engine is imported: OpenBLAS spun for ever in its import under 1.0 GB (2 CPUs), LLVM aborted the process
    under 1.1 GB, and 1.15 GB ran."""
    import resource

    from expertcache.address_space import LIBRARIES_ADDRESS_SPACE, PER_CPU_ADDRESS_SPACE
    limit = LIBRARIES_ADDRESS_SPACE + PER_CPU_ADDRESS_SPACE * len(os.sched_getaffinity(0)) - (64 << 20)
    limited = lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))  # noqa: E731
    done = subprocess.run([sys.executable, "-m", "expertcache.cli", "generate", "-n", "2", "The cache"],
                          capture_output=True, text=True, timeout=120, preexec_fn=limited)
    err = done.stderr.strip()
    assert done.returncode == 2 and err.count("\n") == 0, err[-2000:]
    assert f"address-space limit (ulimit -v {limit >> 10})" in err and "ulimit -v unlimited" in err, err
    # the Python API's road: refused as the engine's package is imported, before numba is
    done = subprocess.run([sys.executable, "-c", "from expertcache import Engine; Engine"], capture_output=True,
                          text=True, timeout=120, preexec_fn=limited)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(
        "expertcache.errors.BadInput: the address-space limit (ulimit -v"), done.stderr[-2000:]


ADDRESS_SPACE = """
import re, resource
from pathlib import Path
from expertcache import Engine, EngineConfig
from expertcache.errors import NotEnoughMemory
size = int(re.search(r"^VmSize:\\s+(\\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.RLIM_INFINITY))
try:
    Engine(None, EngineConfig(store="ram", max_seq=2048))
except NotEnoughMemory as e:
    print(e)
"""


def test_a_run_past_the_address_space_limit_is_refused_before_loading_naming_it():
    """A run whose plan needs more mappings than the address-space limit leaves is refused before any weight is
    read, naming the limit: the slots' anonymous map failed instead, reported as "check the path and the disk"."""
    out = subprocess.run([sys.executable, "-c", ADDRESS_SPACE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "its address-space limit leaves (ulimit -v)" in out.stdout and "ulimit -v unlimited" in out.stdout, \
        out.stdout


ACTIVE_PAGE_CACHE = """
import os, tempfile
from expertcache.engine.budget import available_memory
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "data")
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(os.urandom(2**24))
        f.flush()
        os.fsync(f.fileno())
    before = available_memory()
    for _ in range(2):  # read twice: the kernel moves its pages to the active list
        with open(path, "rb") as f:
            while f.read(2**24):
                pass
    print((before - available_memory()) / 2**20)
"""


@pytest.mark.skipif(bool(__import__("expertcache.lab.cgroup", fromlist=["x"]).unavailable()),
                    reason="no memory cgroup can be created here (needs root or a delegated cgroup v2 subtree)")
def test_page_cache_read_twice_still_counts_as_free_under_a_cap():
    """Under a cgroup cap, a file read twice (a checkpoint converted, then opened) leaves its pages on the active
    list, charged to the group; the kernel takes them back before it kills, so the free memory the engine
    checks against does not shrink by them (it shrank by all 256 MiB, and runs that fit were refused)."""
    from expertcache.lab.cgroup import run_capped
    run = run_capped([sys.executable, "-c", ACTIVE_PAGE_CACHE], 2**30, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout) < 32


def fake_v1_group(tmp_path, rss_file_mib: int, mapped_mib: int) -> Path:
    """A process's /proc folder in a cgroup v1 memory group of 300 MiB holding 280 (106 of them page cache), as
    under a cap after the imports; returns the /proc folder, the groups under tmp_path / "cgroup"."""
    proc, group = tmp_path / "proc", tmp_path / "cgroup" / "memory" / "run"
    proc.mkdir(parents=True)
    group.mkdir(parents=True)
    (proc / "cgroup").write_text("12:memory:/run\n")
    (proc / "status").write_text(f"VmRSS:\t{(168 + rss_file_mib) * 1024} kB\nRssFile:\t{rss_file_mib * 1024} kB\n")
    mib = 2**20
    (group / "memory.limit_in_bytes").write_text(str(300 * mib))
    (group / "memory.usage_in_bytes").write_text(str(280 * mib))
    (group / "memory.stat").write_text(f"total_inactive_file {3 * mib}\ntotal_active_file {103 * mib}\n"
                                       f"total_mapped_file {mapped_mib * mib}\n")
    return proc


def test_the_code_a_run_executes_is_not_counted_as_free_page_cache(tmp_path):
    """Under a cap, the libraries' code is page cache the group holds, but taking it back makes a run read it again
    at once: counted as free, a run of the built-in model under 300 MiB passed the check and then read its
    libraries over and over for minutes. CODE_BYTES of it stay counted as held; code that another group brought
    in (mapped by the process, charged elsewhere) needs none of this group's room."""
    from expertcache.engine.budget import CODE_BYTES, _cgroup_room
    cold = fake_v1_group(tmp_path / "cold", rss_file_mib=49, mapped_mib=49)
    assert _cgroup_room(cold, tmp_path / "cold" / "cgroup") == (300 - 280 + 106) * 2**20 - CODE_BYTES
    warm = fake_v1_group(tmp_path / "warm", rss_file_mib=117, mapped_mib=0)
    assert _cgroup_room(warm, tmp_path / "warm" / "cgroup") == (300 - 280 + 106) * 2**20


# a fresh process scoring windows of the evaluation text under a budget, its resident anonymous memory after each
# quarter of them
WINDOWS_HELD = """
import json, re
from pathlib import Path
from expertcache import Engine, EngineConfig
from expertcache.engine.perplexity import EVAL_TEXT, perplexity

engine = Engine(None, EngineConfig(store="disk", memory_budget=100 * 2**20))
ids = engine.tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8")[:40000]).ids[:6145]
held, scored = [], [0]

def after(tokens):
    scored[0] += tokens
    if scored[0] % 1536 == 0:
        held.append(int(re.search(r"RssAnon:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024)
perplexity(engine, ids, 512, progress=after)
print(json.dumps(held))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_scoring_window_after_window_holds_no_more_memory():
    """Each window's logits (16 MiB on the built-in model) are freed before the next; glibc's malloc, its mapping
    threshold raised to them, kept them in its heap instead of giving them back, and a perplexity run grew by 64 MiB
    every 2,048 tokens until a memory cap killed it. The engine fixes the threshold (budget.map_large_blocks)."""
    out = subprocess.run([sys.executable, "-c", WINDOWS_HELD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    held = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(held) == 4 and held[-1] - held[0] < 24 * 2**20, [h >> 20 for h in held]


def test_a_run_larger_than_the_gpus_free_memory_is_refused_before_loading(monkeypatch):
    """On CUDA the engine compares what the device would hold with what it has free before any weight is read:
    a GPU with too little free memory gets one line naming the sizes and the fixes, with no weight loaded (the
    device here is a stand-in; no GPU is touched before the refusal). One with room for the whole plan passes it."""
    from expertcache.errors import NotEnoughMemory
    free = {"bytes": 32 * 2**20}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    monkeypatch.setattr("expertcache.engine.engine.open_store", lambda *a, **k: pytest.fail("a store was opened"))
    with pytest.raises(NotEnoughMemory, match=r"^this run would hold [\d.]+ MiB on cuda \(.*expert slots .*\), more "
                                              r"than the 32 MiB free there; use a smaller --cache"):
        Engine(None, EngineConfig(device="cuda", store="ram", cache=CacheConfig(fraction=1.0)))
    free["bytes"] = 8 * 2**30
    with pytest.raises(pytest.fail.Exception, match="a store was opened"):  # past the check: it would load now
        Engine(None, EngineConfig(device="cuda", store="ram", cache=CacheConfig(fraction=1.0)))


@pytest.mark.parametrize("slot_dtype, buffers", [("auto", 0), ("fp16", 0), ("fp32", 3)])
def test_the_budget_plans_the_staging_buffers_the_reads_use(slot_dtype, buffers):
    """The built-in model's fp16 blobs land straight in fp16 slots: the plan counts no staging buffer, and the
    slots get those bytes. fp32 slots take them through a buffer of the disk store's fp16 blob per worker and one
    for the calling thread: the plan counts those, not blobs of the slots' dtype."""
    e = Engine(None, EngineConfig(store="disk", slot_dtype=slot_dtype, memory_budget=64 * 2**20, max_seq=256,
                                  cache=CacheConfig(io_workers=2)))
    assert e.plan.buffers == e.budget()["buffer_bytes"] == buffers * e.store.expert_bytes
    assert (e.cache.transfers.direct is not None) == (buffers == 0)
    e.close()


def test_a_predictor_the_budget_did_not_plan_is_refused():
    """Under --memory-budget the cache is sized around the predictor the engine is made with; attaching a larger
    one later would break the budget, and is refused in one line naming the fix."""
    from expertcache.engine.moe import PrefetchConfig
    budget = 56 * 2**20
    plain = Engine(None, EngineConfig(store="ram", memory_budget=budget, max_seq=256))
    with pytest.raises(CacheTooSmall, match=r"^the lookahead predictor takes \d+\.\d MiB .*prefetch/lookahead\)"):
        plain.set_prefetch(PrefetchConfig("lookahead"))
    planned = Engine(None, EngineConfig(store="ram", memory_budget=budget, max_seq=256,
                                        prefetch=PrefetchConfig("lookahead")))
    slots = lambda engine: engine.budget()["slots_per_layer_long_pass"] * 6 * engine.cache.expert_bytes  # noqa: E731
    assert planned.plan.predictor > 8 * 2**20 and slots(planned) <= slots(plain) - planned.plan.predictor
    planned.set_prefetch(PrefetchConfig("quasi-hidden"))  # smaller: within what was planned
    planned.set_prefetch(PrefetchConfig("lookahead"))


def test_bench_under_a_memory_budget_skips_the_floor():
    """`bench --memory-budget` sizes the cache from the budget and leaves out the all-resident floor, which would
    hold more than the budget; the table marks its ratios as absent."""
    from expertcache.lab.bench import FLOOR, BenchConfig, markdown, run_bench
    res = run_bench(None, BenchConfig(store="ram", policies=("fetch-all",), memory_budget=40 * 2**20,
                                      decode_tokens=2, forced_tokens=32, context=32, repeats=1))
    assert FLOOR not in res.summary() and 0 < res.config["slots_per_layer"] < res.config["experts"]
    table = markdown(res)
    assert "memory budget 40 MiB (no all-resident floor: it would break the budget)" in table and "| - |" in table
    # a variant's predictor is planned: the cache is sized around the largest, the same for every variant
    alone = res.config["slots_per_layer"]
    res = run_bench(None, BenchConfig(store="ram", policies=("fetch-all", "fetch-all+prefetch/lookahead"),
                                      memory_budget=40 * 2**20, decode_tokens=2, forced_tokens=32, context=32,
                                      repeats=1))
    assert 0 < res.config["slots_per_layer"] < alone
    from expertcache import cli  # the verb too, whose --cache is no size asked for unless given
    assert cli.main(["bench", "--store", "ram", "--memory-budget", "40M", "--decode-tokens", "2", "--forced-tokens",
                     "16", "--repeats", "1", "--policies", "fetch-all"]) == 0
    assert cli.main(["bench", "--store", "ram", "--memory-budget", "40M", "--cache", "0.5", "--decode-tokens", "2",
                     "--policies", "fetch-all"]) == 2


RAM_STORE_PEAK = """
import resource, sys, torch
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.engine.stores.ram import RamStore
from expertcache.models import model_args
ckpt = open_checkpoint(BUILTIN_MODEL)
store = RamStore(ckpt, model_args(ckpt.config), torch.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
held = sum(p.numel() * p.element_size() for p in store.parts)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / held)
"""


def test_a_ram_store_loads_its_experts_without_holding_them_twice():
    """The ram store's experts are written in place, one layer read at a time: its load's peak is the experts it
    holds and one layer more (with the checkpoint's pages it read), not two copies of the model (2.0x before), the
    difference at real size between loading and being killed for memory."""
    rise = float(subprocess.run([sys.executable, "-c", RAM_STORE_PEAK], capture_output=True, text=True,
                                check=True).stdout)
    assert rise < 1.6


def test_a_first_run_counts_its_kernels_compile_against_the_memory_free(monkeypatch):
    """A first run compiles the kernels, which adds ~1 GB to its peak (1.55 GB against 0.48 on the built-in model):
    under a cap that left room for the run but not for that it was killed for memory, having said only that it was
    compiling. It is refused in one line naming the compile; once the kernels are cached the same room is enough."""
    from expertcache.engine import engine as engine_module
    from expertcache.errors import NotEnoughMemory
    monkeypatch.setattr(engine_module, "available_memory", lambda: 600 * 2**20)
    monkeypatch.setattr(engine_module, "kernels_cached", lambda: False)
    with pytest.raises(NotEnoughMemory, match="compiling the kernels .* a first run where more memory is free"):
        Engine(None, EngineConfig(store="ram", max_seq=64))
    monkeypatch.setattr(engine_module, "kernels_cached", lambda: True)
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    engine.forward(torch.tensor([1, 2, 3]), 0)  # compiled or loaded: numba's cache holds them now
    engine.close()
    monkeypatch.undo()
    assert engine_module.kernels_cached()


def test_low_precision_copies_held_in_memory_are_refused_where_they_do_not_fit(monkeypatch):
    """A lowbit policy on the ram store holds every expert's small copy beside the experts: where the machine has
    not the room, switching to it is refused before the copies are made (it was killed for memory while making
    them), and the engine keeps its policy."""
    from expertcache.engine import engine as engine_module
    from expertcache.errors import NotEnoughMemory
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    monkeypatch.setattr(engine_module, "available_memory", lambda: 2**20)
    with pytest.raises(NotEnoughMemory, match="low-precision copies .*--store disk"):
        engine.set_policy("lowbit:tau=0.15")
    assert engine.small_store is None and engine.policy.name == "fetch-all"
    engine.forward(torch.tensor([1, 2, 3]), 0)
    engine.close()


def test_a_closed_engine_lets_its_memory_go_at_close_without_the_garbage_collector():
    """close() lets the slots, weights, KV cache and predictors go at once, not with the engine's last reference:
    `with Engine(...) as e` in a loop held the closed engine's memory while the next one loaded (4.6 GB against 2.4
    at real shape). A predictor holds the model, whose MoE runner holds the predictor: the cycle is broken too,
    without waiting for the collector's next pass. What it ran stays readable; what it let go is refused in one
    line."""
    import gc
    import weakref

    from expertcache.engine.moe import PrefetchConfig
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    engine.set_prefetch(PrefetchConfig("quasi-hidden"))
    engine.forward(torch.tensor([1, 2, 3]), 0)
    held = [weakref.ref(engine.cache), weakref.ref(engine.model), weakref.ref(engine.runner)]
    gc.disable()
    try:
        engine.close()
        assert [ref() for ref in held] == [None, None, None]
    finally:
        gc.enable()
    assert engine.variant == "fetch-all+prefetch/quasi-hidden" and engine.stats.tokens == 3
    with pytest.raises(BadInput, match="engine is closed"):
        engine.cache  # noqa: B018
    with pytest.raises(AttributeError):
        engine.no_such_attribute  # noqa: B018


def test_bench_leaves_out_a_floor_that_does_not_fit_in_memory(monkeypatch):
    """A model whose experts do not all fit in memory (the case the engine is for) is timed without the floor,
    and the table says why, rather than refused whole."""
    from expertcache.engine import engine as engine_module
    from expertcache.errors import NotEnoughMemory
    from expertcache.lab.bench import FLOOR, BenchConfig, markdown, run_bench
    check = engine_module.Engine._check_memory

    def no_room_for_all(self, cache, *args):
        if cache.fraction == 1.0:
            raise NotEnoughMemory("this run would hold more than this machine has free")
        check(self, cache, *args)
    monkeypatch.setattr(engine_module.Engine, "_check_memory", no_room_for_all)
    res = run_bench(None, BenchConfig(store="ram", policies=("fetch-all",), decode_tokens=2, forced_tokens=32,
                                      context=32, repeats=1))
    assert FLOOR not in res.summary() and res.summary()["fetch-all"]["decode_ms"] > 0
    assert "no all-resident floor: the model's experts do not fit in memory" in markdown(res)


def test_server_admits_requests_while_their_kv_fits():
    """The scheduler reserves each request's prompt + max_tokens positions at admission and admits no more than
    the engine's --kv-positions hold; the rest wait and then run, and the memory plan counts the whole pool."""
    import threading

    from expertcache.engine.sampling import SamplingParams
    from expertcache.serve.scheduler import Request, Scheduler, SchedulerConfig
    engine = Engine(None, EngineConfig(store="ram", max_seq=64, kv_positions=100))
    one = Engine(None, EngineConfig(store="ram", max_seq=64)).plan.kv
    assert engine.plan.kv * 64 == one * 100  # the plan counts the pool, not one sequence
    scheduler = Scheduler(engine, SchedulerConfig(max_active=8))
    most, done = [0], threading.Semaphore(0)

    def emit(item):
        most[0] = max(most[0], scheduler.kv_reserved)
        assert len(scheduler.active) <= 2  # 3 requests of 40 positions: 2 fit in 100
        if item is None:
            done.release()
    requests = [Request([1 + i] * 8, SamplingParams(max_tokens=32, ignore_eos=True), emit) for i in range(3)]
    scheduler.start()
    for r in requests:
        scheduler.submit(r)
    for _ in requests:
        assert done.acquire(timeout=300)
    scheduler.stop()
    assert most[0] == 80 and scheduler.kv_reserved == 0
    assert all(r.completion_tokens == 32 for r in requests)
    with pytest.raises(Exception, match="--kv-positions 10 holds less than one --max-seq 64"):
        Engine(None, EngineConfig(store="ram", max_seq=64, kv_positions=10))


def test_layers_sharing_their_slots_need_only_a_top_k_set_in_all():
    """With --quota global the layers share every slot, so a cache of 12 slots in all (2 a layer, fewer than
    top-8) runs the built-in model, fetch-every-miss still equal to every expert resident; with a layer quota the
    same bytes are refused in one line that names --quota global, as is a budget below the per-layer floor."""
    from expertcache import perplexity
    full = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    ids = full.encode(EVAL_TEXT.read_text(encoding="utf-8")[:4000])[:400]
    shared = Engine(None, EngineConfig(store="ram", cache=CacheConfig(bytes=12 * full.cache.expert_bytes,
                                                                      quota="global")))
    assert (shared.cache.per_layer, shared.cache.num_slots) == (2, 12)
    assert perplexity(shared, ids, 200).ppl == pytest.approx(perplexity(full, ids, 200).ppl, rel=1e-6)
    assert shared.stats.hit_rate < 0.5
    with pytest.raises(CacheTooSmall, match=r"1 expert slot per layer, fewer than top-k=8.*--quota global"):
        Engine(None, EngineConfig(store="ram", cache=CacheConfig(bytes=7 * full.cache.expert_bytes)))
    fixed = Engine(None, EngineConfig(store="ram", max_seq=64)).plan.total
    # 2 slots a layer: enough shared, too few a layer's own even in the smallest passes (their workspace is ~30 slots
    # smaller)
    budget = fixed + 12 * full.cache.expert_bytes
    with pytest.raises(CacheTooSmall, match=r"top-8 experts per layer need .*--quota global"):
        Engine(None, EngineConfig(store="ram", max_seq=64, memory_budget=budget))
    tight = Engine(None, EngineConfig(store="ram", max_seq=64, memory_budget=budget,
                                      cache=CacheConfig(quota="global")))
    # at least the 12 slots a full pass leaves (smaller passes, whose workspace the slots outweigh, leave more), and
    # fewer than a top-k set a layer
    assert 12 <= tight.budget()["slots_per_layer_long_pass"] * 6 < 8 * 6
