"""The timed policy benchmark (instrument 3): real fetches from the slow tier, the same
tokens under every policy, repetitions interleaved round-robin, medians and ratios from
one run. Three timings per variant: free-running greedy decode (a substituting policy may
decode different text), decode of fetch-every-miss's greedy continuation one token per
forward (the same text for every variant, each with its own cache decisions), and
teacher-forced windows (prompt-processing speed)."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..choices import BENCH_POLICIES as POLICIES
from ..engine.cache import CacheConfig
from ..engine.checkpoint import open_checkpoint
from ..engine.engine import BUILTIN_MODEL, Engine, EngineConfig, max_seq_limit
from ..engine.generate import generate
from ..engine.moe import PrefetchConfig
from ..engine.perplexity import EVAL_TEXT, exp, teacher_forced
from ..engine.predictors import predictor_bytes
from ..engine.quant import ExpertFormat
from ..errors import BadInput, NotEnoughMemory
from ..policies import DECIMAL
from ..models import model_args
from .study import signed

FLOOR = "all resident"


def parse_variant(v: str) -> tuple[str, PrefetchConfig | None]:
    """'policy' or 'policy+mode/predictor[:budget=N,drop=0|1,fetched=0|1,confidence=W]', e.g.
    'fetch-all+prefetch/quasi-hidden' or 'fetch-all+prefetch/quasi-hidden:budget=4' (the next layer's N best
    predicted experts); fetched=1 prefetches only those the policy would fetch were they misses, confidence=W
    only those predicted at a gate weight of at least W (0 <= W <= 1)."""
    policy, plus, pre = v.partition("+")
    pre, colon, options = pre.partition(":")
    mode, slash, predictor = pre.partition("/")
    if not policy or plus and not mode or slash and not predictor or colon and not options:
        raise BadInput(f"{v!r} is incomplete: give 'policy' or 'policy+mode/predictor[:options]', e.g. "
                       "'fetch-all+prefetch/quasi-hidden:budget=4'")
    if not plus:
        return policy, None
    config, given = PrefetchConfig(predictor or "quasi-hidden", mode), set()
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key in given:
            raise BadInput(f"prefetch option {key} is given twice in {v!r}; give it once")
        given.add(key)
        if key == "confidence":
            weight = float(value) if DECIMAL.fullmatch(value.strip()) else math.nan
            if not 0 <= weight <= 1:
                raise BadInput(f"prefetch option {item!r} in {v!r}: confidence=W takes a gate weight 0 <= W <= 1, "
                               "e.g. confidence=0.1")
            config = replace(config, confidence=weight)
            continue
        if key not in ("budget", "drop", "fetched") or not value.isdigit() or \
                (int(value) < 1 if key == "budget" else value not in ("0", "1")):
            raise BadInput(f"prefetch option {item!r} in {v!r}: use budget=N (N >= 1 experts a layer), drop=0|1, "
                           "fetched=0|1 or confidence=W")
        config = replace(config, **{key: int(value) if key == "budget" else value != "0"})
    return policy, config


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs: tier, cache size, policy variants, token counts and repetitions."""
    store: str = "disk"
    store_dir: Path | None = None
    store_format: ExpertFormat | None = None  # the experts' format in the slow tier; None: the checkpoint's
    read_mode: str = "auto"  # disk store reads: auto, direct or buffered
    io: str = "auto"  # how disk-store reads are issued: auto, uring or threads (CacheConfig.io)
    slot_dtype: str = "auto"  # the fast tier's expert format (EngineConfig.slot_dtype)
    dense_dtype: str = "auto"  # the dense weights' format (EngineConfig.dense_dtype)
    device: str = "cpu"
    cache_fraction: float | None = None  # None: CacheConfig's default (a quarter), or what a memory budget leaves
    cache_bytes: int | None = None  # overrides cache_fraction (CacheConfig.bytes)
    memory_budget: int | None = None  # the whole fast tier's bytes (EngineConfig.memory_budget); no floor then
    policies: tuple[str, ...] = POLICIES
    prompt_tokens: int = 32
    decode_tokens: int = 64
    forced_tokens: int = 1024
    context: int = 256
    repeats: int = 5


@dataclass
class BenchResult:
    """Per variant: per-repeat ms/token (decode and teacher-forced), perplexity, fetches, stalls and the
    decoded tokens."""
    config: dict
    decode_ms: dict = field(default_factory=dict)  # variant -> per-repeat ms/token, free-running greedy decode
    stream_ms: dict = field(default_factory=dict)  # decoding fetch-all's greedy continuation token by token
    forced_ms: dict = field(default_factory=dict)  # teacher-forced windows
    ppl: dict = field(default_factory=dict)
    fetches_per_token: dict = field(default_factory=dict)
    fetched_kib_per_token: dict = field(default_factory=dict)  # teacher-forced, every transfer and precision
    stall_ms_per_token: dict = field(default_factory=dict)
    decoded: dict = field(default_factory=dict)  # variant -> the greedy tokens it decoded
    decode_counts: dict = field(default_factory=dict)  # variant -> free-running decode's synchronous fetches,
    # prefetch reads and dropped prefetches per decode forward

    def summary(self) -> dict:
        """Per variant: median ms/token, speedups against fetch-all, ratios to the floor, perplexity increase
        and counters."""
        timings = {"decode": self.decode_ms, "stream": self.stream_ms, "forced": self.forced_ms}
        med = {k: {name: statistics.median(t[k]) for name, t in timings.items()} for k in self.decode_ms}
        base, floor = med["fetch-all"], med.get(FLOOR)  # no floor under a memory budget: it would exceed it
        rows = {}
        for k, m in med.items():
            rows[k] = {f"{name}_{what}": v for name in timings for what, v in (
                ("ms", m[name]), ("speedup_vs_fetch_all", base[name] / m[name]),
                ("vs_floor", m[name] / floor[name] if floor else math.nan))}
            rows[k] |= {"ppl": self.ppl[k], "ppl_increase_pct": 100 * (self.ppl[k] / self.ppl["fetch-all"] - 1),
                       "fetches_per_token": self.fetches_per_token[k], "stall_ms_per_token": self.stall_ms_per_token[k],
                        "fetched_kib_per_token": self.fetched_kib_per_token.get(k, 0.0)}
        return rows

    def to_dict(self) -> dict:
        """The configuration, summary and raw timings as JSON-ready values."""
        return {"config": self.config, "summary": self.summary(), "decode_ms": self.decode_ms,
                "stream_ms": self.stream_ms, "forced_ms": self.forced_ms, "decoded": self.decoded,
                "decode_counts": self.decode_counts}


def _decode_stream(engine: Engine, prompt: list[int], stream: list[int]) -> float:
    """ms per forward of decoding `stream` (the continuation of `prompt`) one token per forward,
    whatever the model predicts: the same text for every policy, each with its own cache."""
    engine.reset()
    engine.forward(torch.tensor(prompt), 0)
    t0 = time.perf_counter()
    for pos, token in enumerate(stream[:-1], len(prompt)):  # the last token's forward would predict beyond it
        engine.forward(torch.tensor([token]), pos)
    return 1000 * (time.perf_counter() - t0) / (len(stream) - 1)


def _timed(engine: Engine, prompt: list[int], forced: list[int], stream: list[int],
           cfg: BenchConfig) -> tuple[float, float, float, float, dict]:
    """One repetition: free-running greedy decode after the prompt, decode of `stream` token by
    token, then teacher-force `forced` in windows from a fresh start; returns (decode ms/token, stream ms/token,
    forced ms/token, forced NLL, counters)."""
    stream_ms = _decode_stream(engine, prompt, stream)
    engine.reset()
    it = generate(engine, prompt, cfg.decode_tokens)
    decoded = [next(it)]  # the prompt's forward is not decode time
    s = engine.stats
    counted = ("sync_fetches", "prefetch_fetches", "prefetch_dropped")
    before = [getattr(s, name) for name in counted]
    tok0, t0 = s.tokens, time.perf_counter()
    decoded += list(it)
    decode = 1000 * (time.perf_counter() - t0) / (s.tokens - tok0)  # the decode forwards that ran, one token each
    decode_counts = {name: (getattr(s, name) - b) / (s.tokens - tok0) for name, b in zip(counted, before)}
    engine.reset()  # every variant's windows start from the same cache, whatever its decode left there
    f0, st0, tok0, b0 = s.sync_fetches, s.stall_s, s.tokens, s.fetched_bytes_per_token * s.tokens
    nll, t0 = 0.0, time.perf_counter()
    for logits, targets in teacher_forced(lambda x: engine.forward(x, 0), forced, cfg.context):
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
    n = len(forced) - 1
    forced_ms = 1000 * (time.perf_counter() - t0) / n
    counters = {"fetches": (s.sync_fetches - f0) / (s.tokens - tok0),
                "kib": (s.fetched_bytes_per_token * s.tokens - b0) / 1024 / (s.tokens - tok0),
                "stall": 1000 * (s.stall_s - st0) / (s.tokens - tok0),
                "decoded": decoded, "decode_counts": decode_counts}
    return decode, stream_ms, forced_ms, nll / n, counters


def run_bench(model: Path | None, cfg: BenchConfig, progress: Callable[[str], None] | None = None,
              partial_on_interrupt: bool = False) -> BenchResult:
    """Time every variant of `cfg.policies` and the all-resident floor on the same prompt and evaluation tokens,
    repetitions interleaved round-robin after one warm-up round. With `partial_on_interrupt`, a Ctrl-C after a
    whole timed repetition returns the repetitions completed (`config["repeats_done"]`) instead of raising."""
    cache = CacheConfig(fraction=cfg.cache_fraction, bytes=cfg.cache_bytes, io=cfg.io)
    # the sequence the decode runs: its prompt, its tokens and the one forward more that generate runs
    sequence = cfg.prompt_tokens + cfg.decode_tokens + 1
    limit = max_seq_limit(model_args(open_checkpoint(model or BUILTIN_MODEL).config))
    if sequence > limit:
        raise BadInput(f"--decode-tokens {cfg.decode_tokens} after the {cfg.prompt_tokens}-token prompt exceeds the "
                       f"model's context of {limit} positions; give at most {limit - cfg.prompt_tokens - 1}")
    max_seq = max(sequence, cfg.context)  # what the runs reach, no more: the KV cache and workspace scale with it
    largest = None  # under a budget the cache is sized around the largest predictor a variant attaches, for all
    if cfg.memory_budget is not None:
        prefetches = [p for _, p in map(parse_variant, cfg.policies) if p is not None]
        largest = max(prefetches, default=None, key=lambda p: predictor_bytes(p.predictor, model or BUILTIN_MODEL,
                                                                              torch.float32))
    engine = Engine(model, EngineConfig(device=cfg.device, store=cfg.store, cache=cache, store_dir=cfg.store_dir,
                                        store_format=cfg.store_format, read_mode=cfg.read_mode,
                                        slot_dtype=cfg.slot_dtype, dense_dtype=cfg.dense_dtype, max_seq=max_seq,
                                        memory_budget=cfg.memory_budget, prefetch=largest,
                                        longest_prompt=max(cfg.prompt_tokens, cfg.context, 1)))  # or a forced window
    # the floor holds every expert: under a memory budget it would break the budget the run is measured at
    floor, no_floor = None, "it would break the budget" if cfg.memory_budget is not None else None
    try:
        if cfg.memory_budget is None:
            try:
                floor = Engine(model, replace(engine.config, cache=CacheConfig(fraction=1.0, io=cfg.io)))
            except NotEnoughMemory:  # a model larger than this machine's memory: the case the engine is for
                no_floor = "the model's experts do not fit in memory"
        if floor is not None and floor.routing_counts is None:  # no counts beside the model: every expert
            # resident from the start all the same, or each repetition of the floor timed the loading of every
            # expert (6 fetches of a 9 MiB expert a token from a disk store, at real shape)
            floor.routing_counts = np.ones((floor.args.num_moe_layers, floor.args.num_experts))
        need = cfg.prompt_tokens + cfg.forced_tokens + 1
        ids = engine.encode(EVAL_TEXT.read_text(encoding="utf-8")[: 16 * need])  # tokens average ~3.4 characters
        if len(ids) < need:
            raise BadInput(f"the evaluation text gives {len(ids)} tokens, fewer than the {need} asked for")
        prompt, forced = ids[:cfg.prompt_tokens], ids[cfg.prompt_tokens:cfg.prompt_tokens + cfg.forced_tokens + 1]
        res = BenchResult(cfg.__dict__ | {"policies": list(cfg.policies), "slots_per_layer": engine.cache.per_layer,
                                           "experts": engine.args.num_experts, "warm": engine.warm,
                                           "no_floor": no_floor})
        variants = [FLOOR] * (floor is not None) + list(cfg.policies)
        for v in cfg.policies:  # a bad spec, predictor or budget fails here, before any variant is timed
            policy, prefetch = parse_variant(v)
            engine.set_policy(policy)
            engine.set_prefetch(prefetch)
        engine.set_policy("fetch-all")
        engine.set_prefetch(None)
        stream = list(generate(engine, prompt, cfg.decode_tokens))  # every variant decodes this text (stream timing)
        try:
            _repetitions(res, cfg, variants, engine, floor, prompt, forced, stream, progress)
        except KeyboardInterrupt:
            done = min((len(t) for t in res.decode_ms.values()), default=0)
            if not (partial_on_interrupt and done and len(res.decode_ms) == len(variants)):
                raise
            for timings in (res.decode_ms, res.stream_ms, res.forced_ms):  # the whole repetitions only
                for times in timings.values():
                    del times[done:]
            res.config["repeats_done"] = done
        return res
    finally:  # also when a variant, or the floor's engine, fails: no engine is left open
        engine.close()
        if floor is not None:
            floor.close()


def _repetitions(res: BenchResult, cfg: BenchConfig, variants: list[str], engine: Engine, floor: Engine | None,
                 prompt: list[int], forced: list[int], stream: list[int], progress: Callable[[str], None] | None):
    """The warm-up round and the timed repetitions, each variant once a round, into `res`."""
    for rep in range(cfg.repeats + 1):  # repetition 0 warms up
        for v in variants:
            if v == FLOOR:
                e = floor
            else:
                e = engine
                policy, prefetch = parse_variant(v)
                e.set_policy(policy)
                e.set_prefetch(prefetch)
            d, st, f, nll, c = _timed(e, prompt, forced, stream, cfg)
            if progress:
                progress(f"{f'rep {rep}' if rep else 'warm-up'} {v}: decode {d:.2f} ms/token, fetch-all's "
                         f"tokens {st:.2f} ms/token, teacher-forced {f:.2f} ms/token")
            if rep:
                res.decode_ms.setdefault(v, []).append(d)
                res.stream_ms.setdefault(v, []).append(st)
                res.forced_ms.setdefault(v, []).append(f)
                res.ppl[v] = exp(nll)
                res.fetches_per_token[v] = c["fetches"]
                res.fetched_kib_per_token[v] = c["kib"]
                res.stall_ms_per_token[v] = c["stall"]
                res.decoded[v] = c["decoded"]
                res.decode_counts[v] = c["decode_counts"]


def markdown(res: BenchResult) -> str:
    """The benchmark's summary as a Markdown table under a line describing the setup."""
    c = res.config
    setup = (f"`{c['store']}` store on {c['device']}, cache {c['slots_per_layer']}/{c['experts']} experts per layer, "
             f"{'warm' if c['warm'] else 'cold'} start"
             + (f", memory budget {c['memory_budget'] / 2**20:.0f} MiB" if c.get("memory_budget") else "")
             + (f" (no all-resident floor: {c['no_floor']})" if c.get("no_floor") else "")
             + f"; decode {c['decode_tokens']} tokens after a "
             f"{c['prompt_tokens']}-token prompt (free-running, and fetch-all's greedy tokens one per forward), "
             f"teacher-force {c['forced_tokens']} tokens in windows of {c['context']}; median of "
             + (f"{c['repeats_done']} interleaved repetitions of {c['repeats']} (interrupted); "
                if "repeats_done" in c else f"{c['repeats']} interleaved repetitions; ")
             + "speed-ups against fetch-all, ratios to the floor (all resident). "
             "Fetches and stalls are those of the teacher-forced phase.")
    lines = [setup, "",
             "| policy | decode ms/token | speedup | vs floor | same-tokens decode ms/token | speedup | vs floor | "
             "teacher-forced ms/token | speedup | vs floor | ppl increase (teacher-forced) | "
             "teacher-forced fetches/token | teacher-forced KiB fetched/token | teacher-forced stall ms/token |",
             "|---|" + "---:|" * 13]
    for k, r in res.summary().items():
        cells = [f"{r[f'{n}_ms']:.2f} | {r[f'{n}_speedup_vs_fetch_all']:.2f}x | "
                 + ("-" if math.isnan(r[f"{n}_vs_floor"]) else f"{r[f'{n}_vs_floor']:.2f}x")
                 for n in ("decode", "stream", "forced")]
        lines.append(f"| `{k}` | {' | '.join(cells)} | "
                     f"{signed(r['ppl_increase_pct'])}% | {r['fetches_per_token']:.2f} | "
                     f"{r['fetched_kib_per_token']:.1f} | {r['stall_ms_per_token']:.2f} |")
    return "\n".join(lines)


def table(res: BenchResult) -> str:
    """The benchmark's headline figures, one policy a row, narrow enough for a 100-column terminal: decode and
    teacher-forced ms/token with speed-ups against fetch-all, perplexity increase and fetches per token (the
    rest of `markdown`'s columns are in the JSON). A policy too long for its column has a line of its own above
    its figures: cut, two policies that differ only past the cut read the same."""
    head = ("policy", "decode ms/tok", "x f-all", "forced ms/tok", "x f-all", "ppl +%", "fetch/tok")
    rows = [(k, f"{r['decode_ms']:.2f}", f"{r['decode_speedup_vs_fetch_all']:.2f}x", f"{r['forced_ms']:.2f}",
             f"{r['forced_speedup_vs_fetch_all']:.2f}x", f"{signed(r['ppl_increase_pct'])}",
             f"{r['fetches_per_token']:.2f}") for k, r in res.summary().items()]
    width = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    width[0] = min(width[0], 100 - sum(w + 2 for w in width[1:]))

    def fmt(row):
        return "  ".join([row[0].ljust(width[0])] + [c.rjust(w) for c, w in zip(row[1:], width[1:])])
    lines = [fmt(head)]
    for row in rows:
        lines += [row[0], fmt(("", *row[1:]))] if len(row[0]) > width[0] else [fmt(row)]
    return "\n".join(lines)

