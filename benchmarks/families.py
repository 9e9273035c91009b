"""Decode speed of each model family on its tiny random model (the test configurations): the
engine (all experts resident in RAM; fetch-every-miss from the disk store at a 25% cache)
against HF transformers with its own KV / linear-attention cache, in ms per decoded token,
median of repeats after a warm-up. Tiny models measure per-token overhead (routing,
decisions, Python), not weight bandwidth.

    python benchmarks/families.py [--families gpt_oss qwen3_next ...] [--tokens 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from hf_models import FAMILIES, save_tiny  # noqa: E402

from expertcache.cli import run_script
from expertcache.engine.cache import CacheConfig  # noqa: E402
from expertcache.engine.engine import Engine, EngineConfig  # noqa: E402

PROMPT = list(range(3, 19))


def median_ms(step, tokens: int, repeats: int) -> float:
    """Median over repeats (after one warm-up) of ms per token of `step(tokens)`."""
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        step(tokens)
        if r:
            times.append((time.perf_counter() - start) * 1000 / tokens)
    return statistics.median(times)


@torch.inference_mode()
def hf_decode(hf, tokens: int) -> None:
    out = hf(torch.tensor([PROMPT]), use_cache=True)
    cache, tok = out.past_key_values, out.logits[0, -1].argmax()
    for _ in range(tokens):
        out = hf(tok.view(1, 1), cache=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[0, -1].argmax()


def engine_decode(engine: Engine, tokens: int) -> None:
    engine.reset()
    tok = engine.forward(torch.tensor(PROMPT), 0)[-1].argmax()
    for pos in range(len(PROMPT), len(PROMPT) + tokens):
        tok = engine.forward(tok.view(1), pos)[-1].argmax()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    print("| family | HF transformers | engine, ram, all resident | engine, disk, 25% cache, fetch-all |")
    print("|---|---:|---:|---:|")
    for family in a.families:
        with tempfile.TemporaryDirectory() as d:
            hf = save_tiny(family, Path(d))
            row = [median_ms(lambda n: hf_decode(hf, n), a.tokens, a.repeats)]
            for store, fraction in (("ram", 1.0), ("disk", 0.25)):
                engine = Engine(d, EngineConfig(store=store, cache=CacheConfig(fraction=fraction), initial="cold",
                                                store_dir=Path(d) / "store"))
                row.append(median_ms(lambda n: engine_decode(engine, n), a.tokens, a.repeats))
                engine.close()
        print(f"| {family} | " + " | ".join(f"{ms:.2f} ms/token" for ms in row) + " |")


if __name__ == "__main__":
    run_script(main)
