"""The emulation study (instrument 1): every policy over the same token sequences with the
exact `ram` store and a virtual cache, so that only the quality effect of the decisions is
measured; then the analyses (where the loss comes from, mass against increase, equal mass).
Returns data; `report` writes the report."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..engine.cache import CacheConfig
from ..engine.engine import Engine, EngineConfig
from ..engine.generate import generate
from ..engine.perplexity import EVAL_TEXT, PerplexityResult, perplexity
from ..errors import BadInput, NotEnoughMemory
from ..policies import make_policy
from .texts import domain_texts

BASELINE = "fetch-all"
TAUS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
MAIN = ["substitute-all", *(f"threshold:tau={t:g}" for t in TAUS), "first-choice",
        "quality-first", "speed-first"]
NO_ADMISSION = "quality-first:beta=0"
HEAVY = "band:lo=0.25"  # substitute only misses with gate weight >= 0.25 (first choices included)
LIGHT = [f"band:lo=0,hi={h:g}" for h in (0.06, 0.09, 0.12, 0.16)]  # only light misses
# light misses as int4 copies; the lightest substituted; heavy hits on a small copy upgraded
LOWBIT = ["lowbit:tau=0.15", "lowbit:tau=0.15,lo=0.05", "lowbit:tau=0.15,upgrade=1"]


PREFIX_FACTOR = 16  # a domain's tokens read: the built-in text's domains (at most ~30k tokens) whole
FEW_WINDOWS = 20  # below it the percentile bootstrap's interval is too narrow: paired_increase takes Student's t


@dataclass(frozen=True)
class StudyConfig:
    """What the study runs: cache size, windows, tokens and prompts per domain, bootstrap and the policies."""
    cache_fraction: float = 0.25
    context: int = 512
    tokens_per_domain: int = 4096
    prompts_per_domain: int = 2
    prompt_tokens: int = 48
    new_tokens: int = 32
    bootstrap: int = 2000
    seed: int = 0
    policies: tuple[str, ...] = (BASELINE, *MAIN, NO_ADMISSION, HEAVY, *LIGHT, *LOWBIT)
    generation_policies: tuple[str, ...] = (BASELINE, "substitute-all", "threshold:tau=0.15", "first-choice",
                                            "quality-first", "speed-first")
    text: str | None = None  # UTF-8 text file (default: the built-in evaluation text, domains from eval.json)
    domains: tuple[int, ...] = ()  # character offsets of topic changes in `text` (default: its segments file)


@dataclass
class StudySequences:
    """The study's evaluation tokens (whole windows per domain) and generation prompts held out from them."""
    ids: list[int]
    domains: list[str]
    starts: list[int]  # token offset of each domain in ids (topic changes); each ends with its next token
    prompts: list[tuple[str, list[int]]]  # (domain, prompt ids), disjoint from ids

    @property
    def scored(self) -> int:
        """The tokens scored: each domain's but its last, which is only a target."""
        return len(self.ids) - len(self.starts)

    def first_windows(self, context: int) -> list[int]:
        """The index of each domain's first window (of `context` tokens) among all windows."""
        return [(s - d) // context for d, s in enumerate(self.starts)]


def study_sequences(engine: Engine, cfg: StudyConfig) -> StudySequences:
    """Each domain of the text (`cfg.text`, split at `cfg.domains`; default: the evaluation text and
    its segments) cut to whole windows of `cfg.context`, and prompts from the rest of it (of its first
    PREFIX_FACTOR times the tokens the domain's windows and prompts take: a large file is not tokenized whole)."""
    if cfg.tokens_per_domain < cfg.context:  # no domain could hold a window, whatever the text
        raise BadInput(f"tokens_per_domain={cfg.tokens_per_domain} holds no window of context={cfg.context} tokens; "
                       "raise the one or lower the other")
    ids, domains, starts, prompts = [], [], [], []
    for_prompts = cfg.prompts_per_domain * (cfg.prompt_tokens + 8)
    for domain, text in domain_texts(Path(cfg.text or EVAL_TEXT), cfg.domains or None):
        toks = engine.encode(text, max_tokens=PREFIX_FACTOR * (cfg.tokens_per_domain + for_prompts))
        n = min(cfg.tokens_per_domain, len(toks) - for_prompts)
        n = n // cfg.context * cfg.context  # windows never straddle a topic change
        if n <= 0:
            continue  # a domain too short for one window and its prompts
        starts.append(len(ids))
        domains.append(domain)
        ids += toks[:n + 1]  # and the token after its last window: that window's last target, not the next domain's
        rest = toks[n + 1:]
        step = max(cfg.prompt_tokens, len(rest) // cfg.prompts_per_domain)
        for p in range(cfg.prompts_per_domain):
            prompt = rest[p * step: p * step + cfg.prompt_tokens]
            if len(prompt) == cfg.prompt_tokens:
                prompts.append((domain, prompt))
    if not ids:
        raise BadInput(f"no domain of {cfg.text or EVAL_TEXT} holds one window of {cfg.context} tokens and "
                       f"{cfg.prompts_per_domain} prompts of {cfg.prompt_tokens}; give a longer text (`study`: or a "
                       "smaller --context)")
    return StudySequences(ids, domains, starts, prompts)


def paired_increase(base: list[float], other: list[float], n_boot: int, seed: int) -> dict:
    """% perplexity increase of `other` over `base` with a paired bootstrap 95% CI over windows; from fewer than
    FEW_WINDOWS windows Student's t interval of their mean difference (a bootstrap of two windows gave an interval
    a fifth as wide, called significant); with fewer than two windows the CI is None (a bootstrap of one window is
    that window), with none the increase too."""
    d = np.asarray(other) - np.asarray(base)
    if len(d) < 2:
        return {"pct": 100 * (math.exp(d.mean()) - 1) if len(d) else None, "ci": None}
    if len(d) < FEW_WINDOWS:
        from scipy.stats import t
        half = float(t.ppf(0.975, len(d) - 1)) * d.std(ddof=1) / math.sqrt(len(d))
        lo, hi = d.mean() - half, d.mean() + half
    else:
        rng = np.random.default_rng(seed)
        boots = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(1)
        lo, hi = np.percentile(boots, [2.5, 97.5])
    pct = lambda x: 100 * (math.exp(x) - 1)  # noqa: E731
    return {"pct": pct(d.mean()), "ci": [pct(lo), pct(hi)]}


def signed(x: float) -> str:
    """A change in percent to two places with its sign: +0.00, never -0.00 for a change that rounds to none."""
    return f"{round(x, 2) + 0.0:+.2f}"


def increase_text(r: dict) -> str:
    """A `paired_increase` as text: '+1.23% [+0.45, +2.01]', the CI 'n/a' from fewer than two windows."""
    if r["pct"] is None:
        return "n/a (no window)"
    ci = "n/a (one window)" if r["ci"] is None else f"{signed(r['ci'][0])}, {signed(r['ci'][1])}"
    return f"{signed(r['pct'])}% [{ci}]"


def pearson(x, y) -> float:
    """Pearson r of x and y; NaN with fewer than 3 points or no spread."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


@dataclass
class StudyResult:
    """The study's configuration, sequences, per-policy metrics, analyses and generation test."""
    config: dict
    model: str
    sequences: dict
    runs: dict = field(default_factory=dict)  # policy -> metrics
    analyses: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)
    not_run: list = field(default_factory=list)  # what an interrupt (Ctrl-C) left out: policies, "generation test"

    def to_dict(self) -> dict:
        """The result as JSON-ready values."""
        return {"config": self.config, "model": self.model, "sequences": self.sequences, "runs": self.runs,
                "analyses": self.analyses, "generation": self.generation} | \
            ({"interrupted": True, "not_run": self.not_run} if self.not_run else {})


def run_metrics(r: PerplexityResult, base: PerplexityResult, cfg: StudyConfig) -> dict:
    """One policy's metrics against the baseline: perplexity increase with CI, substitution and fetch rates,
    and per-window NLL and substituted mass."""
    s = r.stats
    calls, k_slots = s["moe_calls"], s["routed"]
    return {"ppl": r.ppl, "ppl_stderr": r.stderr,
            **paired_increase(base.window_nll, r.window_nll, cfg.bootstrap, cfg.seed),
            "calls_substituted_pct": 100 * s["substituted_calls"] / calls,
            "slots_substituted_pct": 100 * s["substitutions"] / k_slots,
            "mass_per_call": s["substituted_mass"] / calls, "hit_rate": s["hit_rate"],
            "sync_fetches_per_token": s["sync_fetches"] / r.tokens,
            "admissions_per_token": s["background_fetches"] / r.tokens,
            # every transfer and precision: what a policy moves over the slow link, to compare at equal bytes
            "fetched_kib_per_token": (s["sync_fetch_bytes"] + s["lowbit_bytes"] + s["background_bytes"]
                                      + s["prefetch_bytes"]) / r.tokens / 1024,
            "window_nll": r.window_nll, "window_mass": [w["substituted_mass"] / max(1, w["moe_calls"])
                                                        for w in r.window_stats]}


def exact_engine(model: Path | None, config: EngineConfig) -> Engine:
    """An engine on the `ram` store of `config`, the emulation's slow tier; where the experts do not fit in memory,
    on the `disk` store, whose reads give the same weights (every miss then a real read: slower, the same
    numbers)."""
    try:
        return Engine(model, config)
    except NotEnoughMemory:
        return Engine(model, replace(config, store="disk"))


def run_study(model: Path | None, cfg: StudyConfig, progress: Callable[..., None] | None = None) -> StudyResult:
    """Run every policy of `cfg` over the same sequences on the exact `ram` store (`exact_engine`; warm cache
    carried over), then the analyses and the generation test. `progress(label, n)` counts tokens; each phase opens with
    `progress(label, 0, total=T)`, its whole count."""
    engine = exact_engine(model, EngineConfig(store="ram", cache=CacheConfig(fraction=cfg.cache_fraction),
                                              initial="warm", max_seq=max(EngineConfig.max_seq, cfg.context)))
    seq = study_sequences(engine, cfg)
    result = StudyResult(cfg.__dict__ | {"policies": list(cfg.policies), "store": engine.config.store},
                         str(engine.path),
                         {"tokens": seq.scored, "domains": seq.domains,  # among the scored tokens
                          "topic_change_tokens": [s - d for d, s in enumerate(seq.starts)],
                          "prompts": len(seq.prompts), "slots_per_layer": engine.cache.per_layer,
                          "experts": engine.args.num_experts})
    ppl: dict[str, PerplexityResult] = {}
    if progress:
        progress(cfg.policies[0], 0, total=seq.scored * len(cfg.policies))
    try:  # interrupted (Ctrl-C) past the baseline and one policy, the study keeps what it measured: a real
        # model's policies take hours
        for spec in cfg.policies:
            engine.set_policy(spec)
            ppl[spec] = perplexity(engine, seq.ids, cfg.context, reset=False, segments=seq.starts,
                                   progress=(lambda n, s=spec: progress(s, n)) if progress else None)
    except KeyboardInterrupt:
        if len(ppl) < 2:
            engine.close()
            raise
        result.not_run = [spec for spec in cfg.policies if spec not in ppl] + ["generation test"]
    base = ppl[BASELINE]
    result.runs = {spec: {"name": make_name(spec), **run_metrics(r, base, cfg)} for spec, r in ppl.items()}
    result.analyses = analyses(result.runs, seq, cfg)
    if not result.not_run:
        try:
            result.generation = generation_test(engine, seq, cfg, progress)
        except KeyboardInterrupt:
            result.not_run = ["generation test"]
    engine.close()
    return result


def make_name(spec: str) -> str:
    """The policy's display name, e.g. `threshold(tau=0.15)` for 'threshold:tau=0.15'."""
    return repr(make_policy(spec))


def analyses(runs: dict, seq: StudySequences, cfg: StudyConfig) -> dict:
    """The study's findings from the per-policy metrics: where the loss comes from, the mass hypothesis,
    equal mass with different composition, and background admission after topic changes."""
    out = {}
    sub_all, thr = runs.get("substitute-all"), runs.get("threshold:tau=0.15")
    if sub_all and thr:
        out["where_loss_comes_from"] = {
            p: {k: runs[p][k] for k in ("calls_substituted_pct", "slots_substituted_pct", "mass_per_call", "pct", "ci")}
            for p in ("substitute-all", "threshold:tau=0.15")}
    first_fetched = [p for p in runs if p.startswith("threshold:") or p == "first-choice"]
    out["mass_hypothesis"] = {
        "policies": first_fetched,
        "r_across_policies": pearson([runs[p]["mass_per_call"] for p in first_fetched],
                                     [runs[p]["pct"] for p in first_fetched])}
    if thr:
        base = np.asarray(runs[BASELINE]["window_nll"])
        d_nll = np.asarray(thr["window_nll"]) - base
        out["mass_hypothesis"]["r_across_windows_threshold_0.15"] = pearson(thr["window_mass"], d_nll)
    if HEAVY in runs and any(p in runs for p in LIGHT):
        heavy_mass = runs[HEAVY]["mass_per_call"]
        light = min((p for p in LIGHT if p in runs), key=lambda p: abs(runs[p]["mass_per_call"] - heavy_mass))
        keys = ("mass_per_call", "slots_substituted_pct", "pct", "ci")
        pick = lambda p, ks=keys: {"policy": p, **{k: runs[p][k] for k in ks}}  # noqa: E731
        out["equal_mass"] = {"heavy": pick(HEAVY), "light": pick(light),
                             "light_sweep": {p: pick(p, ("mass_per_call", "pct", "ci")) for p in LIGHT if p in runs}}
    if "quality-first" in runs and NO_ADMISSION in runs:
        per_domain = cfg.tokens_per_domain // cfg.context
        after = [w + j for w in seq.first_windows(cfg.context)[1:] for j in range(min(2, per_domain))]
        w_with = np.asarray(runs["quality-first"]["window_nll"])
        w_without = np.asarray(runs[NO_ADMISSION]["window_nll"])
        sel = lambda w: [w[i] for i in after]  # noqa: E731
        out["background_admission"] = {
            "overall": paired_increase(w_without, w_with, cfg.bootstrap, cfg.seed),
            "after_topic_change": paired_increase(sel(w_without), sel(w_with), cfg.bootstrap, cfg.seed),
            "windows_after_change": after,
            "admissions_per_token": runs["quality-first"]["admissions_per_token"]}
    return out


def generation_test(engine: Engine, seq: StudySequences, cfg: StudyConfig, progress=None,
                    setups: dict | None = None) -> dict:
    """Greedy continuations under each variant against fetch-every-miss's. `setups` maps a
    label to a function that configures the engine (default: one per generation policy). `progress` as
    run_study's."""
    setups = setups or {spec: (lambda e, s=spec: e.set_policy(s)) for spec in cfg.generation_policies}
    if progress:
        progress(f"generate {next(iter(setups))}", 0, total=len(setups) * len(seq.prompts) * cfg.new_tokens)
    outs: dict[str, list] = {}
    for spec, setup in setups.items():
        setup(engine)
        outs[spec] = []
        for domain, prompt in seq.prompts:
            engine.reset()
            toks = list(generate(engine, prompt, cfg.new_tokens))
            outs[spec].append({"domain": domain, "tokens": toks,
                               "mass": engine.stats.substituted_mass / max(1, engine.stats.moe_calls)})
            if progress:
                progress(f"generate {spec}", cfg.new_tokens)
    ref = outs[BASELINE]
    report = {}
    for spec, gens in outs.items():
        same, first, mass = [], [], []
        for g, r in zip(gens, ref):
            eq = [a == b for a, b in zip(g["tokens"], r["tokens"])]
            same.append(float(np.mean(eq)))
            first.append(eq.index(False) if False in eq else len(eq))
            mass.append(g["mass"])
        report[spec] = {"identical_token_share": float(np.mean(same)), "mean_first_divergence": float(np.mean(first)),
                        "per_prompt_agreement": same, "per_prompt_mass": mass,
                        "r_mass_vs_disagreement": pearson(mass, 1 - np.asarray(same))}
    report["samples"] = {spec: engine.decode(outs[spec][0]["tokens"]) for spec in outs}
    report["prompt0"] = engine.decode(seq.prompts[0][1])
    return report
