"""How much prefetching can save on this machine: on-demand loading against a real predictor and
against an oracle that knows every next layer's experts, in decode on the disk store.

    python benchmarks/prefetch_bound.py [--model DIR] [--cache 0.25] [--policy fetch-all] [--fetched] [--split]
                                        [--replayed]
                                        [--predictors estimator lookahead] [--budgets 8 4] [--tokens 64]
                                        [--repeats 15] [--feed greedy|text] [--json FILE]
                                        [--store-dtype int4 --slot-dtype int4 --dense-dtype int4]
                                        [--lookahead-from DIR ...] [--one-call] [--disk-mbps 500 1000 0]
                                        [--device cuda [--store pinned]]

The policy alone decodes greedily first; every variant then decodes those tokens again, one a forward, so that all
of them run the same inputs. `--feed text` feeds the evaluation text's own tokens after the prompt instead, one a
forward: a small model's greedy continuation soon falls into a loop, whose few experts stay resident and miss
little, where text routes as a user's varied decode does. The oracle replays that first run's routes: under a
policy that fetches every miss (fetch-all) they are the routes every variant computes; under a substituting one
(quality-first) the cache's contents, which its prefetches change, move what later layers route a little, and the
header says what share of the routed experts the oracle knew. Its prediction costs nothing but the lookup, so it
bounds what any predictor can gain here: perfect recall and precision, with the real cost of issuing, reading and
waiting. `--fetched` prefetches only what the policy would fetch were it a miss (`fetched=1`), the oracle included.
`--split` adds the oracle paying the first predictor's call (run, its answer unused): between it and the oracle
lies what the call's time costs, between it and the predictor what its wrong and missed reads cost. `--replayed`
adds the first predictor's own predictions at a lookup's cost (its logits recorded in a decode of the same tokens,
replayed): what the predictor would take were its call free, its reads started where the oracle's start (under a
substituting policy its rows are those of the recording run, as the oracle's routes are). Each predictor runs at
each of `budgets` (prefetches per layer among its top-k; default top-k), the oracle at the first, and so do the
replayed predictions and the lookahead trained in each `--lookahead-from` folder (a copy of the model's trained
with other options).
`--one-call` adds each variant with a decode token's experts run in one call after its last wait rather than each
as it lands (where experts are large enough for that, `CompiledExperts.one_by_one`); its shares are of its own
on-demand and oracle runs. `--disk-mbps` runs every variant with the store's disk held at each of these read rates
(MB/s; 0: its own) by a block-I/O cgroup (root; `expertcache.lab.cgroup.ReadThrottle`), rates and variants
alternated within each round, a table for each rate: whether the disk or the CPU sets a token's pace decides what
a prediction's time costs, and this machine's disk drifts between 0.6 and 4 GB/s from hour to hour (held, reads
wait in the group's queue before they reach the device, which "disk busy" counts alone). `--device cuda` runs it
on a GPU, the fast tier in its memory (a prediction's call then costs kernel launches, not the CPU's streaming of
its weights), from the disk store or, with `--store pinned`, from pinned host memory over the bus.
"Of the oracle's gain" is (on demand / variant - 1) / (on demand / oracle - 1) on the three's mean times over the
rounds (every variant runs in every round, seconds apart, where this disk's speed drifts over minutes), with a 90%
interval from resampling the rounds; "predict" the wall time of a token's predictions (the attention run ahead
included). "disk busy" is the time per token that the store's device had a read in flight (Linux's /proc/diskstats;
n/a elsewhere): no prefetch can bring a token below it, so on demand / disk busy bounds any gain; "thread CPU" is
the decoding thread's own CPU time per token (its compute share, issuing and checking reads, predicting; not its
waits); "ppl of the decoded tokens" their perplexity on the logits each variant's decode gave them, scored in the
warm-up round (a prefetch moves a substituting policy's choices). Variants run round robin, `repeats` times after
one warm-up round, in reverse order every other round, so that a drift favours none of them; medians. Counts are
the decode tokens' own (the prompt's forward excluded).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from expertcache.cli import run_script
from expertcache.lab.cgroup import ReadThrottle


class Recorder:
    """Wraps the MoE runner's `route` and keeps each decode token's routed ids and gate weights, layer by layer."""

    def __init__(self):
        from expertcache.engine import moe
        self.moe, self.route, self.on = moe, moe.route, False
        self.tokens: list[list[np.ndarray]] = []
        moe.route = self._route

    def _route(self, x, weight, router, layer):
        r = self.route(x, weight, router, layer)
        if self.on and r.ids.shape[0] == 1:
            if layer == 0:
                self.tokens.append([])
            self.tokens[-1].append((r.ids[0].copy(), r.weights[0].copy()))
        return r


def oracle_rows(model, routes: list[list[tuple[np.ndarray, np.ndarray]]]) -> np.ndarray:
    """Router logits [tokens, layers, E] that give each decode token's true experts (`routes`, ids and weights,
    from a run of the same tokens) their routed gate weights, the other experts sharing the rest of the mass: a
    softmax router ranks them first, in their routed order, and a policy's filter sees their true weights."""
    E = model.args.num_experts
    rows = np.empty((len(routes), len(routes[0]), E), np.float32)
    for t, layers in enumerate(routes):
        for layer, (ids, w) in enumerate(layers):
            rows[t, layer] = np.log(max((1.0 - float(w.sum())) / (E - len(ids)), 1e-12))
            rows[t, layer, ids] = np.log(np.maximum(w, 1e-12))
    return rows


def oracle_predictor(model, routes: list[list[tuple[np.ndarray, np.ndarray]]], paying=None):
    """A predictor that knows each decode token's next-layer experts (`oracle_rows`); the rows are made
    beforehand, so that a prediction costs a lookup. With `paying` (a predictor), each prediction first runs that
    predictor's call and throws its answer away: its cost with the oracle's reads."""
    return replayed_predictor(model, oracle_rows(model, routes), "oracle", paying)


def replayed_predictor(model, rows: np.ndarray, name: str, paying=None):
    """A predictor whose decode token t's logits for layer l + 1 are rows[t, l + 1] ([tokens, layers, E]), at a
    lookup's cost; with `paying`, as `oracle_predictor`'s."""
    from expertcache.engine.predictors import Predictor

    class Replayed(Predictor):
        def __init__(self):
            super().__init__(model)
            self.name, self.token = name, -1

        def decode_logits(self, layer, resid, x, ids, weights, prev=None):
            if layer == 0:
                self.token += 1
            if paying is not None:
                paying.decode_logits(layer, resid, x, ids, weights, prev)
            return rows[self.token, layer + 1:layer + 2]

        def logits(self, layer, resid, x, ids, weights, prev=None):  # the prompt's forward: no prefetch is made from it
            return torch.zeros(x.shape[0], model.args.num_experts)
    return Replayed()


def recorded_rows(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The attached predictor's logits for every one-token forward and layer of a decode of `tokens` (`decode`), as
    it ran them ([forwards, layers, E], layer 0's zero): what `replayed_predictor` gives back. As the oracle's
    routes (Recorder), a prompt of one token is such a forward, and so has its row."""
    predictor, rows = engine.runner.predictor, []
    shape = (engine.args.num_moe_layers, engine.args.num_experts)

    def kept(method):
        def call(layer, resid, x, ids, weights, prev=None):
            out = getattr(type(predictor), method)(predictor, layer, resid, x, ids, weights, prev)
            if out is not None and x.shape[0] == 1:
                if layer == 0:
                    rows.append(np.zeros(shape, np.float32))
                rows[-1][layer + 1] = out.float().numpy()[0] if isinstance(out, torch.Tensor) else out[0]
            return out
        return call

    predictor.decode_logits, predictor.logits = kept("decode_logits"), kept("logits")
    try:
        decode(engine, prompt, tokens)
    finally:
        del predictor.decode_logits, predictor.logits
    return np.stack(rows)


def share_of_gain(on_demand: np.ndarray, variant: np.ndarray, oracle: np.ndarray, resamples: np.ndarray
                  ) -> tuple[float | None, list[float] | None]:
    """A variant's share of the oracle's gain on the mean times per token of the same rounds, and its 5th and
    95th percentiles over `resamples` (rows of round indices); None where the oracle gained nothing."""
    def share(rounds):
        d, v, o = on_demand[rounds].mean(), variant[rounds].mean(), oracle[rounds].mean()
        return (d / v - 1) / (d / o - 1) if d > o else np.nan
    point = share(slice(None))
    if np.isnan(point):
        return None, None
    shares = [share(rounds) for rounds in resamples]
    return float(point), [float(x) for x in np.nanpercentile(shares, [5, 95])]


def busy_ms(path: Path):
    """A counter of the milliseconds that the device holding `path` has had I/O in flight, or None where
    the kernel does not report it (io_ticks, /proc/diskstats)."""
    st = os.stat(path)
    try:
        for line in open("/proc/diskstats"):
            f = line.split()
            if (int(f[0]), int(f[1])) == (os.major(st.st_dev), os.minor(st.st_dev)):
                return int(f[12])
    except (OSError, ValueError, IndexError):
        pass
    return None


def finished(engine) -> None:
    """Wait for the device's queued work, so that a time read next includes it (CUDA runs asynchronously)."""
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def decode(engine, prompt: list[int], tokens: list[int], score: bool = False) -> dict:
    """The prompt's forward, then `tokens` one a forward, as decode runs them: per-token figures of the decode
    alone. `score`: also the perplexity of `tokens` on the logits of the forwards that precede each (the
    quality of the decode itself, where a prefetch can move a substituting policy's choices), computed between
    the timed forwards."""
    engine.reset()
    logits = engine.forward(torch.tensor(prompt), 0, last=True)
    nll = []
    s = engine.stats
    before = (s.tokens, s.sync_fetches, s.prefetch_fetches, s.stall_s, s.predict_s)
    path = engine.store.path if engine.config.store == "disk" else None  # the pinned store reads no disk
    busy = path and busy_ms(path)
    finished(engine)
    start, cpu = time.perf_counter(), time.thread_time()
    for i, token in enumerate(tokens):
        if score:
            nll.append(-torch.log_softmax(logits[-1].float(), -1)[token].item())
        logits = engine.forward(torch.tensor([token]), len(prompt) + i, last=True)
    finished(engine)
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    busy = None if busy is None else busy_ms(path) - busy
    n = s.tokens - before[0]
    return {"ms_per_token": 1e3 * wall / n, "sync_fetches": (s.sync_fetches - before[1]) / n,
            "prefetches": (s.prefetch_fetches - before[2]) / n, "stall_ms": 1e3 * (s.stall_s - before[3]) / n,
            "predict_ms": 1e3 * (s.predict_s - before[4]) / n, "disk_busy_ms": None if busy is None else busy / n,
            "thread_cpu_ms": 1e3 * cpu / n, "ppl": float(np.exp(np.mean(nll))) if nll else None}


def main() -> None:
    from expertcache.engine.cache import CacheConfig
    from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
    from expertcache.engine.perplexity import EVAL_TEXT
    from expertcache.engine.predictors import make_predictor
    from expertcache.engine.quant import ExpertFormat
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUILTIN_MODEL)
    p.add_argument("--cache", type=float, default=0.25)
    p.add_argument("--policy", default="fetch-all")
    p.add_argument("--fetched", action="store_true", help="prefetch only what the policy would fetch (fetched=1)")
    p.add_argument("--split", action="store_true", help="add the oracle paying the first predictor's call")
    p.add_argument("--replayed", action="store_true",
                   help="add the first predictor's own predictions at a lookup's cost (recorded in place, replayed)")
    p.add_argument("--store-dtype", default=None, help="the disk store's format (default: the checkpoint's)")
    p.add_argument("--slot-dtype", default="auto")
    p.add_argument("--dense-dtype", default="auto")
    p.add_argument("--predictors", nargs="+", default=["estimator", "lookahead"])
    p.add_argument("--budgets", type=int, nargs="+", default=[None], help="prefetches per layer (default: top-k)")
    p.add_argument("--lookahead-from", type=Path, nargs="+", default=[],
                   help="also the lookahead trained in each of these copies of the model's folder (e.g. with other "
                        "sketches: cp -al MODEL DIR && expertcache predict --train --model DIR ...), side by side")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--feed", choices=("greedy", "text"), default="greedy",
                   help="decode the policy's greedy continuation of the prompt, or the text's own next tokens")
    p.add_argument("--repeats", type=int, default=15, help="rounds: fewer let this disk's drift decide the share")
    p.add_argument("--one-call", action="store_true",
                   help="also each variant with a decode token's experts run in one call after its last wait, "
                        "rather than each as its read lands")
    p.add_argument("--disk-mbps", type=float, nargs="+", default=[0],
                   help="the store's disk held at each of these read rates in turn, MB/s (0: its own rate; root)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, or cuda (the fast tier in its memory)")
    p.add_argument("--store", default="disk", choices=("disk", "pinned"),
                   help="the slow tier: the disk store, or pinned host memory (--device cuda)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.repeats < 1 or a.tokens < 1 or a.prompt_tokens < 1:
        p.error("--repeats, --tokens and --prompt-tokens must be at least 1, e.g. --tokens 32 --repeats 15")
    if a.store == "pinned" and (a.device == "cpu" or a.disk_mbps != [0]):
        p.error("--store pinned is the slow tier of a GPU's cache, without a disk: give --device cuda and no "
                "--disk-mbps")
    if not all(0 <= r < 1e7 for r in a.disk_mbps):  # NaN fails too
        p.error("--disk-mbps takes read rates in MB/s, 0 for the disk's own, e.g. --disk-mbps 500 1000 0")
    recorder = Recorder()
    rates = list(dict.fromkeys(a.disk_mbps))
    fmt = ExpertFormat.parse(a.store_dtype, 32) if a.store_dtype else None
    engine = Engine(a.model, EngineConfig(device=a.device, store=a.store, cache=CacheConfig(fraction=a.cache),
                                          policy=a.policy,
                                          store_format=fmt, slot_dtype=a.slot_dtype, dense_dtype=a.dense_dtype))
    # each folder's lookahead, made before anything runs (a folder without one is refused at once) and kept for
    # every round, as the engine keeps its own
    made = {folder: make_predictor("lookahead", engine.model, folder) for folder in a.lookahead_from}
    if a.prompt_tokens + a.tokens > engine.model.max_seq:
        p.error(f"--prompt-tokens + --tokens = {a.prompt_tokens + a.tokens} exceeds the model's "
                f"{engine.model.max_seq} positions")
    text = engine.encode(EVAL_TEXT.read_text()[:40 * (a.prompt_tokens + a.tokens)])
    if a.feed == "text" and len(text) < a.prompt_tokens + a.tokens:
        p.error(f"the evaluation text has {len(text)} tokens, fewer than --prompt-tokens + --tokens")
    prompt = text[:a.prompt_tokens]
    throttle = None
    if rates != [0]:
        try:
            throttle = ReadThrottle(engine.store.path)
        except RuntimeError as e:
            p.error(f"--disk-mbps: {e}")
    with throttle or contextlib.nullcontext():
        measure(a, engine, recorder, prompt, text, made, rates, throttle)


def measure(a, engine, recorder, prompt, text, made, rates, throttle) -> None:
    """Every variant at every rate, round robin; the tables and --json."""
    from expertcache.engine.generate import generate
    from expertcache.engine.moe import PrefetchConfig
    from expertcache.progress import progress_bar
    engine.reset()
    tokens = list(generate(engine, prompt, a.tokens)) if a.feed == "greedy" else \
        text[a.prompt_tokens:a.prompt_tokens + a.tokens]  # greedy: the policy alone
    recorder.on = True
    decode(engine, prompt, tokens)
    recorder.on = False
    routes, recorder.tokens = recorder.tokens, []
    budget = lambda b: "" if b is None else f", budget {b}"  # noqa: E731
    variants = {"on demand": None} | {f"prefetch, {name}{budget(b)}": PrefetchConfig(name, budget=b, fetched=a.fetched)
                                      for name in a.predictors for b in a.budgets}
    others = {}  # variant -> the folder its lookahead is read from
    for folder in a.lookahead_from:
        for b in a.budgets:
            name = f"prefetch, lookahead of {folder.name}{budget(b)}"
            others[name], variants[name] = folder, PrefetchConfig("lookahead", budget=b, fetched=a.fetched)
    oracle = f"prefetch, oracle{budget(a.budgets[0])}"
    variants[oracle] = PrefetchConfig(a.predictors[0], budget=a.budgets[0], fetched=a.fetched)
    paying = f"{oracle}, paying {a.predictors[0]}'s call"
    if a.split:
        variants[paying] = variants[oracle]
    replayed = {}  # variant -> the first predictor's rows, recorded in place, replayed at a lookup's cost
    if a.replayed:
        engine.set_prefetch(PrefetchConfig(a.predictors[0]))
        rows = recorded_rows(engine, prompt, tokens)
        for b in a.budgets:
            name = f"prefetch, {a.predictors[0]} replayed{budget(b)}"
            replayed[name], variants[name] = rows, PrefetchConfig(a.predictors[0], budget=b, fetched=a.fetched)
    one_call = {f"{name}, one call": name for name in variants} if a.one_call else {}  # -> the variant it runs
    variants |= {name: variants[base] for name, base in one_call.items()}
    runs: dict[float, dict[str, list[dict]]] = {rate: {name: [] for name in variants} for rate in rates}
    ppl = {}  # the decoded tokens' perplexity, scored in the warm-up round (its time is not kept)
    known = None  # the share of the routed experts the oracle knew: runs of the same tokens from a reset are alike,
    # so the warm-up's is every round's, and the timed rounds record nothing
    schedule = [(rate, name) for rate in rates for name in variants]
    with progress_bar(None, total=len(variants) + a.repeats * len(schedule), unit="run") as bar:
        for round_ in range(a.repeats + 1):  # round 0 warms up, at the first rate
            for rate, name in (schedule[:len(variants)] if not round_ else schedule)[::1 if round_ % 2 else -1]:
                if throttle is not None:
                    throttle.set(int(rate * 1e6) or None)
                engine.set_prefetch(variants[name])  # the engine makes each predictor once and keeps it
                engine.runner.as_landed = name not in one_call
                base = one_call.get(name, name)
                if base == oracle:
                    engine.runner.predictor = oracle_predictor(engine.model, routes)
                elif base == paying:  # the predictor that set_prefetch made
                    engine.runner.predictor = oracle_predictor(engine.model, routes, engine.runner.predictor)
                elif base in others:
                    engine.runner.predictor = made[others[base]]
                elif base in replayed:
                    engine.runner.predictor = replayed_predictor(engine.model, replayed[base], "replayed")
                recorder.on = name == oracle and not round_
                at = f", {rate:g} MB/s" if throttle is not None and rate else ""
                bar.set_description(f"{f'round {round_}/{a.repeats}' if round_ else 'warm-up'}, {name}{at}")
                figures = decode(engine, prompt, tokens, score=not round_)
                bar.update()
                if not round_:
                    ppl[name] = figures["ppl"]
                if recorder.on:
                    known = np.mean([np.isin(ids, true[0]).mean() for seen, want in zip(recorder.tokens, routes)
                                     for (ids, _), true in zip(seen[1:], want[1:])])
                    recorder.on, recorder.tokens = False, []
                if round_:
                    runs[rate][name].append(figures)
    fetched = " (prefetching what it would fetch)" if a.fetched else ""
    print(f"{a.store} store, {a.device}, cache {a.cache}, {a.policy}{fetched}, "
          f"{a.tokens} decode tokens ({'greedy' if a.feed == 'greedy' else 'the text'}'s), medians of {a.repeats}; "
          f"the oracle knew {known:.1%} of the routed experts of layers 1 on")
    by_rate = {rate: table(a, runs[rate], ppl, one_call, oracle) for rate in rates}
    for rate, rows in by_rate.items():
        print(f"\nthe disk held at {rate:g} MB/s\n" if rate else "\nthe disk at its own rate\n")
        na = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        share = lambda r: "n/a" if r["of_oracle_gain"] is None else \
            "{:.0%} ({:.0%} to {:.0%})".format(r["of_oracle_gain"], *r["of_oracle_gain_interval"])  # noqa: E731
        print("| variant | ms/token | vs on demand | of the oracle's gain (90% interval) | synchronous fetches/token "
              "| prefetches/token | stall ms/token | predict ms/token | disk busy ms/token | thread CPU ms/token "
              "| ppl of the decoded tokens |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {r['ms_per_token']:.2f} | {r['vs_on_demand']:.2f}x | {share(r)} | "
                  f"{r['sync_fetches']:.1f} | {r['prefetches']:.1f} | {r['stall_ms']:.2f} | {r['predict_ms']:.3f} | "
                  f"{na(r['disk_busy_ms'], '.2f')} | {r['thread_cpu_ms']:.2f} | {r['ppl']:.3f} |")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "oracle_knew": float(known),
                                      "by_disk_mbps": [{"disk_mbps": rate, "medians": by_rate[rate],
                                                        "runs": runs[rate]} for rate in rates]}, indent=1))


def table(a, runs: dict[str, list[dict]], ppl: dict, one_call: dict, oracle: str) -> dict[str, dict]:
    """Each variant's medians over the rounds, its speed-up over on demand and its share of the oracle's gain."""
    rows = {name: {k: None if rs[0][k] is None else statistics.median(r[k] for r in rs) for k in rs[0]} | {
            "ppl": ppl[name]} for name, rs in runs.items()}
    times = {name: np.array([f["ms_per_token"] for f in rs]) for name, rs in runs.items()}
    resamples = np.random.default_rng(0).integers(0, a.repeats, (2000, a.repeats))
    suffix = lambda name: ", one call" if name in one_call else ""  # noqa: E731 -- its baselines ran as it did
    for name, r in rows.items():
        r["vs_on_demand"] = rows["on demand" + suffix(name)]["ms_per_token"] / r["ms_per_token"]
        r["of_oracle_gain"], r["of_oracle_gain_interval"] = share_of_gain(
            times["on demand" + suffix(name)], times[name], times[oracle + suffix(name)], resamples)
    return rows

if __name__ == "__main__":
    run_script(main)
