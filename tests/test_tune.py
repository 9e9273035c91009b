"""tune on the built-in model: the search space, the frontier, the winner's rule and the verb."""
import json

import numpy as np
import pytest

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.perplexity import EVAL_TEXT
from expertcache.lab.calibrate import CALIB_TEXT
from expertcache.lab.costmodel import DATASHEET
from expertcache.lab.tune import (BETAS, EVICTIONS, RULES, TuneConfig, check_profile_for, search_space, slot_engine,
                                  tune, tune_ids)
from expertcache.policies import make_policy

SMALL = ("fetch-all", "threshold:tau=0.05,eviction=demand", "threshold:tau=0.15,beta=0.5,eviction=freq",
         "threshold:tau=0.3,eviction=lru", "first-choice:eviction=lru", "substitute-all")


def test_search_space_crosses_rules_with_evictions_and_betas():
    specs = search_space()
    takes_beta = [r for r in RULES if "beta" in make_policy(r).parameters]
    assert len(specs) == len(EVICTIONS) * (len(takes_beta) * len(BETAS) + len(RULES) - len(takes_beta))
    for spec in specs:
        assert make_policy(spec).eviction in EVICTIONS
    assert make_policy("threshold:tau=0.1,beta=0.5,eviction=demand").eviction == "demand"
    assert "threshold:tau=0.05,beta=0.5,eviction=demand" in specs and "conditional:j=2,m=16,eviction=lru" in specs


def test_eviction_in_a_spec_must_be_known():
    assert cli.main(["simulate", "x.ectrace", "--policies", "threshold:eviction=newest"]) == 2


@pytest.fixture(scope="module")
def result():
    cfg = TuneConfig(budget_pct=3.0, cache=CacheConfig(fraction=0.25), calib_tokens=1024, tokens=1024, context=256,
                     candidates=SMALL, presets=("quality-first",), finalists=8, bootstrap=500)
    ids = tune_ids(None, CALIB_TEXT.read_text(encoding="utf-8"), EVAL_TEXT.read_text(encoding="utf-8"), cfg)
    return tune(None, ids, DATASHEET["rtx3090-qwen3-next"], cfg)


def test_finalists_are_the_frontier_and_the_winner_the_fastest_within_budget(result):
    rows = {r["spec"]: r for r in result.candidates}
    assert {s for s in rows if "+" not in s} == {*SMALL, "quality-first"}
    finalists = [s for s in result.finalists if s != "fetch-all"]
    assert finalists
    for s in finalists:  # no candidate is at least as fast with less mass
        assert not any(r["estimated_ms"] < rows[s]["estimated_ms"] and r["mass_per_call"] < rows[s]["mass_per_call"]
                       for r in rows.values())
    assert result.finalists["fetch-all"]["pct"] == 0
    within = [s for s, f in result.finalists.items() if f["pct"] <= 3.0]
    assert result.winner == min(within, key=lambda s: rows[s]["estimated_ms"])
    assert any(f["pct"] > 3.0 for s, f in result.finalists.items() if s.startswith("substitute-all"))  # it binds
    v = result.validation[result.winner]
    assert v["ci"][0] <= v["pct"] <= v["ci"][1] and v["estimated_speedup"] >= 1
    assert "quality-first" in result.validation


def test_prefetching_is_searched_on_the_frontier_in_decode(result):
    """In decode the frontier's policies are replayed again with each predictor, at top-k, at half of it, and
    for a substituting policy with only what it would fetch; each priced with its predictor's cost in place.
    A prefetch changes no window's output: a finalist that prefetches scores as its policy does."""
    rows = {r["spec"]: r for r in result.candidates}
    prefetching = [s for s in rows if "+prefetch/" in s]
    for predictor in ("quasi-hidden", "estimator", "lookahead"):
        assert f"fetch-all+prefetch/{predictor}" in rows and f"fetch-all+prefetch/{predictor}:budget=4" in rows
        sure = rows[f"fetch-all+prefetch/{predictor}:confidence=0.1"]  # the sure predictions only: fewer reads
        assert 0 < sure["prefetches_per_token"] < rows[f"fetch-all+prefetch/{predictor}"]["prefetches_per_token"]
        one = rows[f"fetch-all+prefetch/{predictor}"]
        assert one["prefetches_per_token"] > rows[f"fetch-all+prefetch/{predictor}:budget=4"]["prefetches_per_token"]
        assert one["fetches_per_token"] < rows["fetch-all"]["fetches_per_token"]  # recall above nothing
        assert one["mass_per_call"] == 0 and one["prediction_s"] > 0
    # each predictor priced by its own measured call, the same on every row it prefetches for (no timing order:
    # which predictor is cheaper on the built-in model drifts with the machine's load)
    prices = {}  # predictor -> the prices of its rows
    for s in prefetching:
        prices.setdefault(s.split("+prefetch/")[1].split(":")[0], set()).add(rows[s]["prediction_s"])
    assert all(len(p) == 1 for p in prices.values()) and len(set.union(*prices.values())) == 3
    assert any(s.endswith(":fetched=1") for s in prefetching)
    assert not any(s.startswith("fetch-all+") and "fetched" in s for s in prefetching)  # fetch-all fetches all
    for s, f in result.finalists.items():
        if "+" in s:
            assert f == result.finalists.get(s.partition("+")[0], f)
    assert result.config["prefetch_skipped"] == {}


def test_a_forced_search_makes_no_prefetching_candidates():
    cfg = TuneConfig(cache=CacheConfig(fraction=0.25), calib_tokens=600, tokens=600, context=256, mode="forced",
                     candidates=("fetch-all", "threshold:tau=0.15,eviction=lru"), presets=(), finalists=2, bootstrap=100)
    ids = tune_ids(None, CALIB_TEXT.read_text(encoding="utf-8"), EVAL_TEXT.read_text(encoding="utf-8"), cfg)
    res = tune(None, ids, DATASHEET["rtx3090-qwen3-next"], cfg)
    assert not any("+" in r["spec"] for r in res.candidates)


def test_a_model_larger_than_memory_is_scored_from_the_disk_and_what_does_not_fit_is_left_out(monkeypatch):
    """Where the ram store's experts do not fit in memory, the exact scores read the disk store, and give the same
    perplexities; where they fit but a lowbit finalist's small copies would not fit beside them, that finalist is
    left out, with why, and the rest are scored (the search was killed for memory at real size)."""
    from expertcache.engine import engine as engine_module
    from expertcache.errors import NotEnoughMemory
    cfg = TuneConfig(cache=CacheConfig(fraction=0.25), calib_tokens=600, tokens=600, context=256, mode="forced",
                     candidates=("fetch-all", "threshold:tau=0.15,eviction=lru", "lowbit:tau=0.15"), presets=(),
                     finalists=3, bootstrap=100)
    ids = tune_ids(None, CALIB_TEXT.read_text(encoding="utf-8"), EVAL_TEXT.read_text(encoding="utf-8"), cfg)
    runs = {}
    for room in ("no ram store", "no small copies"):
        with monkeypatch.context() as m:
            if room == "no ram store":
                def refuse_ram(self, *args, check=engine_module.Engine._check_memory):
                    if self.config.store == "ram":
                        raise NotEnoughMemory("this run would hold more than this machine has free")
                    check(self, *args)
                m.setattr(engine_module.Engine, "_check_memory", refuse_ram)
            else:
                m.setattr(engine_module.Engine, "_check_memory", lambda self, *args: None)
                m.setattr(engine_module, "available_memory", lambda: 2**20)
            runs[room] = tune(None, ids, DATASHEET["rtx3090-qwen3-next"], cfg)
    disk, ram = runs["no ram store"], runs["no small copies"]
    assert disk.config["store"] == {"auto": "disk"} and ram.config["store"] == {"auto": "ram"}
    assert "lowbit:tau=0.15" in disk.finalists and disk.config["not_scored"] == {}
    assert "lowbit:tau=0.15" not in ram.finalists
    assert "low-precision copies" in ram.config["not_scored"]["lowbit:tau=0.15"]
    assert {s: f["ppl"] for s, f in ram.finalists.items()} == \
        {s: f["ppl"] for s, f in disk.finalists.items() if s in ram.finalists}  # exact on either store
    assert ram.winner in ram.finalists and ram.winner in ram.validation


def test_tune_verb_writes_the_search_and_the_plot(tmp_path, capsys):
    out, png = tmp_path / "tune.json", tmp_path / "tune.png"
    assert cli.main(["tune", "--budget", "3%", "--profile", "rtx3090-qwen3-next", "--calib-tokens", "600",
                     "--tokens", "600", "--context", "256", "--finalists", "4", "--json", str(out),
                     "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["winner"] in data["finalists"] and f"policy: {data['winner']}" in text
    assert len(data["candidates"]) >= len(search_space()) and png.stat().st_size > 10_000


def test_a_profile_given_for_other_slots_or_mode_is_refused():
    """tune's --profile files go in the order auto, then --slot-dtypes: given in another order, an int4 profile
    priced the auto slots, silently. A profile records its slots and mode; a datasheet's (none recorded) is taken."""
    from dataclasses import replace

    from expertcache.errors import BadInput
    sheet = DATASHEET["rtx3090-qwen3-next"]
    cfg = TuneConfig(cache=CacheConfig(fraction=0.25), calib_tokens=600, tokens=600, context=256,
                     slot_dtypes=("auto", "int4"))
    ids = tune_ids(None, CALIB_TEXT.read_text(encoding="utf-8"), EVAL_TEXT.read_text(encoding="utf-8"), cfg)
    swapped = {"auto": replace(sheet, slot_dtype="int4", mode="decode"), "int4": replace(sheet, slot_dtype="float16")}
    with pytest.raises(BadInput, match=r"given for --slot-dtype auto \(float16 slots\), --mode decode was measured "
                                       "with int4 slots"):
        tune(None, ids, swapped, cfg)
    forced = {"auto": replace(sheet, slot_dtype="float16", mode="forced"), "int4": sheet}
    with pytest.raises(BadInput, match="was measured with forced mode.*calibrate-hw --mode decode"):
        tune(None, ids, forced, cfg)
    engine = slot_engine(None, cfg, "auto")  # auto's slots are the checkpoint's fp16: a profile of fp16 slots fits
    check_profile_for(replace(sheet, slot_dtype="float16", mode="decode"), "auto", engine, "decode")
    engine.close()


def test_tune_bad_budget_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--budget", "lots"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--budget" in err and "1%" in err


@pytest.mark.parametrize("argv, words", [(["--text", "/nonexistent.txt"], "no such text file"),
                                         (["--profile", "nowhere.json"], "unknown hardware profile")])
def test_tune_bad_input_is_one_line(argv, words, capsys):
    assert cli.main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


@pytest.mark.parametrize("verb", [["tune", "--budget", "1%"], ["trace", "--out", "t.ectrace"], ["study"],
                                  ["calibrate"]])
def test_a_blank_text_is_one_line(verb, tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n", encoding="utf-8")
    assert cli.main([*verb, "--text", str(blank)]) == 2
    err = capsys.readouterr().err.split("\r")[-1]  # after any progress bar's last redraw
    assert err.count("\n") == 1 and "holds no text" in err


def test_tune_refuses_a_short_text_before_measuring(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    assert cli.main(["tune", "--budget", "1%", "--text", str(short)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fewer than two windows" in err and "quick profile" not in err
    # the calibration text given as the held-out one: nothing held out, refused before measuring
    assert cli.main(["tune", "--budget", "1%", "--text", str(CALIB_TEXT)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "validated on what it was tuned on" in err and "quick profile" not in err


@pytest.mark.parametrize("argv", [["--cache-bytes", "1"], ["--cache", "0.01"],
                                  ["--cache-bytes", "2949119", "--slot-dtypes", "int4"]])
def test_tune_refuses_a_cache_too_small_before_measuring(argv, capsys):
    """A cache of fewer slots than top-k was refused by the first engine after the quick profile (minutes at real
    size), naming --quota, which tune does not take; with --slot-dtypes int4, by auto's float slots, a byte short
    of 8 a layer, whatever the int4 ones hold in those bytes."""
    assert cli.main(["tune", "--budget", "1%", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fewer than top-k=8" in err and "quick profile" not in err, err
    assert "--quota" not in err, err


@pytest.fixture(scope="module")
def user_text(tmp_path_factory):
    """A user's own text: two topics (verse, then scripture), changing at a known character."""
    eval_text = EVAL_TEXT.read_text(encoding="utf-8")
    first, second = eval_text[100_000:106_000], eval_text[200_000:206_000]
    path = tmp_path_factory.mktemp("text") / "mine.txt"
    path.write_text(first + second, encoding="utf-8")
    return path, len(first)


def test_study_on_a_users_text_and_domains(user_text, tmp_path, capsys):
    path, change = user_text
    out = tmp_path / "study.json"
    assert cli.main(["study", "--text", str(path), "--domains", str(change), "--tokens-per-domain", "256",
                     "--context", "128", "--policies", "threshold:tau=0.15", "--out", str(tmp_path / "s"),
                     "--json", str(out)]) == 0
    seq = json.loads(out.read_text())["sequences"]
    assert seq["domains"] == ["mine:0", "mine:1"] and seq["topic_change_tokens"] == [0, 256]
    assert seq["tokens"] == 512


def test_trace_on_a_users_text_and_domains(user_text, tmp_path):
    from expertcache.lab.calibrate import encode_text
    from expertcache.lab.trace import read_trace
    path, change = user_text
    out = tmp_path / "mine.ectrace"
    assert cli.main(["trace", "--text", str(path), "--domains", str(change), "--out", str(out)]) == 0
    docs = read_trace(out).header["documents"]
    text = path.read_text(encoding="utf-8")
    from expertcache.engine.engine import BUILTIN_MODEL
    n0 = len(encode_text(BUILTIN_MODEL, text[:change]))
    assert [d[:2] for d in docs] == [[0, n0], [n0, n0 + len(encode_text(BUILTIN_MODEL, text[change:]))]]


@pytest.mark.parametrize("domains, words", [("12,x", "comma-separated"), ("99999999", "must increase strictly")])
def test_bad_domains_are_one_line(user_text, tmp_path, domains, words, capsys):
    path, _ = user_text
    try:
        code = cli.main(["trace", "--text", str(path), "--domains", domains, "--out", str(tmp_path / "t")])
    except SystemExit as e:  # argparse's own check
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err


def test_per_layer_taus_follow_the_layers_scale():
    from expertcache.lab.tune import PER_LAYER_TAUS, TILTS, per_layer_specs
    scale = np.array([1.0, 2.0, 3.0])  # z-scores -1.22, 0, 1.22
    specs = per_layer_specs(scale, evictions=("lru",), betas=(0.0,))
    assert len(specs) == len(PER_LAYER_TAUS) * len(TILTS)
    taus = [make_policy(s).taus for s in specs]
    f = 2 ** 1.2247
    assert taus[0] == pytest.approx((0.05 * f, 0.05, 0.05 / f), rel=1e-2)  # tau 0.05, tilt -1
    assert taus[1] == pytest.approx((0.05 / f, 0.05, 0.05 * f), rel=1e-2)
    for spec in specs:
        make_policy(spec).bind(3, 8)  # one tau per layer


def test_lowbit_candidates_have_their_own_frontier():
    from expertcache.lab.tune import pick_finalists
    rows = [{"spec": "fetch-all", "estimated_ms": 10, "mass_per_call": 0, "inexact_per_call": 0},
            {"spec": "first-choice", "estimated_ms": 5, "mass_per_call": 0.2, "inexact_per_call": 3},
            {"spec": "lowbit:tau=0.3", "estimated_ms": 6, "mass_per_call": 0, "inexact_per_call": 4},
            {"spec": "lowbit:tau=0.1", "estimated_ms": 8, "mass_per_call": 0, "inexact_per_call": 1},
            {"spec": "lowbit:tau=0.15", "estimated_ms": 9, "mass_per_call": 0, "inexact_per_call": 2}]
    rows = [{**r, "slots": "auto", "label": r["spec"]} for r in rows]
    # lowbit's zero substituted mass would hide fetch-all; apart, its frontier is by inexact experts
    assert pick_finalists(rows, 8) == ["first-choice", "fetch-all"]
    assert pick_finalists(rows, 8, 4) == ["first-choice", "fetch-all", "lowbit:tau=0.3", "lowbit:tau=0.1"]


def test_default_candidates_add_per_layer_taus_and_lowbit(tmp_path):
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.lab.trace import record_trace
    from expertcache.lab.tune import LOWBIT_RULES, default_candidates, layer_entropy
    trace = record_trace(BUILTIN_MODEL, list(range(1, 200)), tmp_path / "t.ectrace", 64, "float32")
    h = layer_entropy(trace)
    assert h.shape == (trace.header["num_layers"],) and (h > 0).all() and (h < np.log(128)).all()
    specs = default_candidates(trace, TuneConfig())
    assert len(specs) == len(search_space()) + 48 + 3 * len(LOWBIT_RULES)
    assert len(default_candidates(trace, TuneConfig(per_layer=False, lowbit=False))) == len(search_space())
    per_layer = [s for s in specs if "/" in s]
    assert len(per_layer) == 48 and all(len(make_policy(s).taus) == len(h) for s in per_layer)


def test_quantized_slots_are_searched_at_equal_bytes_against_the_exact_model():
    """With --slot-dtypes int4 and a cache in bytes, int4 slots are candidates of their own: more of them in
    the same bytes (a higher hit rate), their own frontier of finalists, and their perplexity increase taken
    over the exact model's (fetch-every-miss on float slots), so their quantization error counts."""
    specs = ("fetch-all", "threshold:tau=0.15,eviction=lru")
    cfg = TuneConfig(budget_pct=3.0, cache=CacheConfig(bytes=11796480), calib_tokens=600, tokens=600, context=256,
                     candidates=specs, presets=(), finalists=2, slot_finalists=2, bootstrap=200,
                     slot_dtypes=("auto", "int4"))
    ids = tune_ids(None, CALIB_TEXT.read_text(encoding="utf-8"), EVAL_TEXT.read_text(encoding="utf-8"), cfg)
    res = tune(None, ids, DATASHEET["rtx3090-qwen3-next"], cfg)
    rows = {r["label"]: r for r in res.candidates}
    assert {n for n in rows if "+" not in n} == {*specs, *(f"{s} @int4" for s in specs)}
    assert "fetch-all+prefetch/lookahead @int4" in rows  # prefetching on int4's frontier too
    assert rows["fetch-all @int4"]["hit_rate"] > rows["fetch-all"]["hit_rate"] + 0.2  # 102 slots a layer, not 32
    exact_int4 = [n for n in res.finalists if n.startswith("fetch-all") and n.endswith(" @int4")]
    assert exact_int4 and res.finalists["fetch-all"]["pct"] == 0
    assert all(res.finalists[n]["pct"] != 0 for n in exact_int4)  # int4's own error, against the exact model
    assert res.winner in res.finalists and res.winner in res.validation


def test_the_winner_is_kept_only_where_it_decodes_faster():
    """The winner is timed on the disk store against fetch-every-miss, and one that prefetches also against its
    fallback, the fastest by estimate of its own policy and the finalists within budget that do not prefetch on its
    slots; the fastest measured wins, and the speed-up is fetch-every-miss's time over its. Fetch-every-miss
    itself is not timed."""
    from expertcache.lab.costmodel import DECODE_PROMPT, time_runs
    from expertcache.lab.tune import timed_choice
    ids = tune_ids(None, CALIB_TEXT.read_text(encoding="utf-8"), EVAL_TEXT.read_text(encoding="utf-8"),
                   TuneConfig(calib_tokens=600, tokens=600, context=256))[0]
    asked = []

    def timer(labels):
        asked.append(labels)
        timed = time_runs(None, [(0.25, spec) for spec in labels], ids[:DECODE_PROMPT + 24], "decode", repeats=1)
        return {spec: 1000 * t.seconds for spec, t in zip(labels, timed)}

    winner = "threshold:tau=0.15+prefetch/quasi-hidden"
    within = [winner, "first-choice", "fetch-all @int4", "threshold:tau=0.05+prefetch/estimator"]
    est = {winner: 1.0, "threshold:tau=0.15": 1.3, "first-choice": 1.2, "fetch-all @int4": 0.5,
           "threshold:tau=0.05+prefetch/estimator": 0.9}
    got = timed_choice(winner, within, est, timer)
    assert asked == [[winner, "first-choice", "fetch-all"]]  # not int4's slots, nor another prefetching finalist
    assert got["fallback"] == "first-choice" and got["estimated"] == winner
    ms = got["measured_ms"]
    assert got["winner"] == min(ms, key=ms.get) and got["speedup"] == ms["fetch-all"] / ms[got["winner"]]
    assert all(v > 0 for v in ms.values())
    est["threshold:tau=0.15"] = 1.1  # its own policy, estimated faster than the other: the fallback
    assert timed_choice(winner, within, est, timer)["fallback"] == "threshold:tau=0.15"
    alone = timed_choice("first-choice", within, est, timer)  # no fallback: against fetch-every-miss only
    assert asked[-1] == ["first-choice", "fetch-all"] and alone["fallback"] is None
    int4 = timed_choice("fetch-all @int4", within, est, lambda labels: {s: 1.0 + len(s) for s in labels})
    assert set(int4["measured_ms"]) == {"fetch-all @int4", "fetch-all"} and int4["winner"] == "fetch-all"
    assert timed_choice("fetch-all", within, est, timer) == {} and len(asked) == 3
