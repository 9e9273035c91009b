"""Decode speed of each model family on its tiny random model: the engine (every expert
resident, RAM store) against HF transformers (eager, its own KV cache), ms per decoded token.

Both decode the same 48 tokens one at a time after an 8-token prompt; one warm-up run, then
the median over `--trials` runs. Tiny models measure per-token overhead (routing, decisions,
Python), not weight bandwidth.

    python benchmarks/families_decode.py [--families glm4_moe deepseek_v3] [--trials 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "tests")]
from hf_models import save_tiny  # noqa: E402

from expertcache.engine.cache import CacheConfig  # noqa: E402
from expertcache.engine.engine import Engine, EngineConfig  # noqa: E402

PROMPT, NEW = 8, 48


def engine_ms(path: Path, ids: torch.Tensor) -> float:
    engine = Engine(path, EngineConfig(cache=CacheConfig(fraction=1.0), initial="cold", max_seq=PROMPT + NEW))
    engine.forward(ids[:PROMPT], 0)
    start = time.perf_counter()
    for pos in range(PROMPT, PROMPT + NEW):
        engine.forward(ids[pos:pos + 1], pos)
    engine.close()
    return 1000 * (time.perf_counter() - start) / NEW


@torch.inference_mode()
def hf_ms(model, ids: torch.Tensor) -> float:
    cache = model(ids[None, :PROMPT], use_cache=True).past_key_values
    start = time.perf_counter()
    for pos in range(PROMPT, PROMPT + NEW):
        cache = model(ids[None, pos:pos + 1], cache=cache, use_cache=True).past_key_values
    return 1000 * (time.perf_counter() - start) / NEW


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["glm4_moe", "deepseek_v3"])
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, prompt {PROMPT}, {NEW} decoded tokens, median of {a.trials}")
    print("| family | engine ms/token | HF ms/token | engine / HF |")
    print("|---|---:|---:|---:|")
    for fam in a.families:
        with tempfile.TemporaryDirectory() as d:
            hf = save_tiny(fam, Path(d))
            ids = torch.randint(0, 96, (PROMPT + NEW,), generator=torch.Generator().manual_seed(0))
            runs = {"engine": [], "hf": []}
            for trial in range(a.trials + 1):  # trial 0 warms up
                e, h = engine_ms(Path(d), ids), hf_ms(hf, ids)
                if trial:
                    runs["engine"].append(e)
                    runs["hf"].append(h)
            e, h = statistics.median(runs["engine"]), statistics.median(runs["hf"])
            print(f"| {fam} | {e:.2f} | {h:.2f} | {e / h:.2f} |")


if __name__ == "__main__":
    main()
