"""expertcache: Mixture-of-Experts inference with a policy-driven expert cache over a real
slow tier. The public entry points are re-exported here, imported on first use: the command
line starts without torch, so that an interrupt while it loads ends quietly (cli.main)."""
import importlib

_EXPORTS = {"CacheConfig": ".engine.cache", "BUILTIN_MODEL": ".engine.engine", "Engine": ".engine.engine",
            "EngineConfig": ".engine.engine", "generate": ".engine.generate", "PrefetchConfig": ".engine.moe",
            "PerplexityResult": ".engine.perplexity", "perplexity": ".engine.perplexity",
            "RunStats": ".engine.stats", "ExpertCacheError": ".errors", "MissPolicy": ".policies",
            "make_policy": ".policies", "SamplingParams": ".engine.sampling", "TextGeneration": ".engine.generate"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
