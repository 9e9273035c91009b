"""expertcache: Mixture-of-Experts inference with a policy-driven expert cache over a real
slow tier. The public entry points are re-exported here."""
from .engine.cache import CacheConfig
from .engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from .engine.generate import generate
from .engine.moe import PrefetchConfig
from .engine.perplexity import PerplexityResult, perplexity
from .engine.stats import RunStats
from .errors import ExpertCacheError
from .policies import MissPolicy, make_policy

__all__ = ["BUILTIN_MODEL", "CacheConfig", "Engine", "EngineConfig", "ExpertCacheError", "MissPolicy",
           "PerplexityResult", "PrefetchConfig", "RunStats", "generate", "make_policy", "perplexity"]
