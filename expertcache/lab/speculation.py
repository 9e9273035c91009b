"""Quality of speculative execution: perplexity against exact decoding on the study's
token sequences with a paired bootstrap CI, and greedy agreement on prompts of every domain."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..engine.cache import CacheConfig
from ..engine.engine import EngineConfig
from ..engine.moe import PrefetchConfig
from ..engine.perplexity import perplexity
from ..engine.predictors import PREDICTORS
from .study import BASELINE, StudyConfig, exact_engine, generation_test, paired_increase, study_sequences


def speculative_quality(model: Path | None, cfg: StudyConfig, predictors=PREDICTORS,
                        progress: Callable[..., None] | None = None) -> dict:
    """Perplexity increase over fetch-every-miss (paired bootstrap CI) and greedy agreement when each predictor's
    experts run in place of the true router's. `progress(label, n, total=None)` as `run_study`'s: a phase
    starts with its total (perplexity of every variant, then the generation test)."""
    engine = exact_engine(model, EngineConfig(store="ram", cache=CacheConfig(fraction=cfg.cache_fraction),
                                              initial="warm", max_seq=max(EngineConfig.max_seq, cfg.context)))
    seq = study_sequences(engine, cfg)
    setups = {BASELINE: lambda e: (e.set_policy(BASELINE), e.set_prefetch(None))}
    for name in predictors:
        setups[f"speculative/{name}"] = lambda e, n=name: (e.set_policy(BASELINE),
                                                          e.set_prefetch(PrefetchConfig(n, "speculative")))
    runs = {}
    if progress:  # the perplexity phase: every variant over the same tokens
        progress(BASELINE, 0, total=seq.scored * len(setups))
    for label, setup in setups.items():
        setup(engine)
        runs[label] = perplexity(engine, seq.ids, cfg.context, reset=False, segments=seq.starts,
                                 progress=(lambda n, s=label: progress(s, n)) if progress else None)
    base = runs[BASELINE]
    out = {"tokens": base.tokens, "ppl": {k: r.ppl for k, r in runs.items()},
           "increase": {k: paired_increase(base.window_nll, r.window_nll, cfg.bootstrap, cfg.seed)
                        for k, r in runs.items() if k != BASELINE}}
    gen = generation_test(engine, seq, cfg, progress, setups)
    out["generation"] = {k: {m: v[m] for m in ("identical_token_share", "mean_first_divergence")}
                         for k, v in gen.items() if k not in ("samples", "prompt0")}
    engine.close()
    return out
