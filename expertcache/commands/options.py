"""Options shared by every verb that loads a model."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..engine.cache import CacheConfig
from ..engine.engine import Engine, EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser, store: str = "disk") -> None:
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint folder (default: the built-in model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--store", default=store, help="slow tier: ram, disk or pinned (default: %(default)s)")
    p.add_argument("--store-dir", type=Path, default=None, help="where the disk store lives (default: ~/.cache)")
    p.add_argument("--cache", type=float, default=0.25, help="cache size as a fraction of each layer's experts")
    p.add_argument("--cache-bytes", type=int, default=None, help="cache size in bytes (overrides --cache)")
    p.add_argument("--quota", default="layer", help="layer (per-layer slots) or global")
    p.add_argument("--policy", default="fetch-all",
                   help="miss policy: fetch-all, substitute-all, threshold:tau=0.15, first-choice, "
                        "quality-first, speed-first; options sub=best|drop|window, window=M, beta=B")
    p.add_argument("--eviction", default=None, help="lru, lfu or freq (default: the policy's choice)")
    p.add_argument("--initial", default="auto", help="initial residency: warm, cold or auto")
    p.add_argument("--max-seq", type=int, default=2048)


def engine_from_args(a: argparse.Namespace) -> Engine:
    cache = CacheConfig(fraction=a.cache, bytes=a.cache_bytes, quota=a.quota)
    return Engine(a.model, EngineConfig(device=a.device, store=a.store, cache=cache, policy=a.policy,
                                        eviction=a.eviction,
                                        initial=a.initial, store_dir=a.store_dir, max_seq=a.max_seq))


def write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=1, default=str))
