"""The built-in model end to end: HF transformers agrees with the engine on its perplexity,
and every verb runs on it with the disk store and a 25% cache."""
import json
import math

import pytest
import torch

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from expertcache.engine.perplexity import EVAL_TEXT, perplexity


@pytest.fixture(scope="module")
def eval_ids():
    engine = Engine(None, EngineConfig(cache=CacheConfig(fraction=1.0)))
    return engine.encode(EVAL_TEXT.read_text(encoding="utf-8"))[:1025]


def test_transformers_perplexity_equals_fetch_every_miss(eval_ids):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL, dtype=torch.float32).eval()
    x = torch.tensor(eval_ids)
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(hf(x[:-1][None]).logits[0], x[1:]).item()
    engine = Engine(None, EngineConfig(store="disk", cache=CacheConfig(fraction=0.25)))
    ours = perplexity(engine, eval_ids, context=1024)
    assert engine.stats.sync_fetches > 0
    assert ours.ppl == pytest.approx(math.exp(nll), rel=1e-5)


def test_generate_and_ppl_verbs(capsys, tmp_path):
    assert cli.main(["generate", "-n", "8", "--json", str(tmp_path / "g.json"), "ROMEO."]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ROMEO.") and "hit rate" in out.err
    assert "prefill: " in out.err and "generation: " in out.err  # prompt and generated tokens timed apart
    g = json.loads((tmp_path / "g.json").read_text())
    assert len(g["tokens"]) == 8 and g["stats"]["tokens"] > 8
    assert cli.main(["ppl", "--max-tokens", "300", "--context", "128", "--policy", "quality-first:beta=0",
                     "--json", str(tmp_path / "p.json")]) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["tokens"] == 300 and p["ppl"] > 1 and len(p["window_nll"]) == 3
    # the policy as given, every option (its name alone read quality-first), and how the cache ran it
    assert (p["policy"], p["eviction"], p["quota"], p["initial"]) == ("quality-first:beta=0", "demand", "layer",
                                                                      "warm")  # auto, with routing counts: warm
    # an eviction order the spec names and another asked: refused, where the other ran under the spec's name
    capsys.readouterr()
    assert cli.main(["ppl", "--max-tokens", "8", "--policy", "threshold:tau=0.15,eviction=lfu", "--eviction",
                     "lru"]) == 2
    assert "names eviction=lfu, and eviction lru is asked too" in capsys.readouterr().err
    assert cli.main(["info", "--budget", "16"]) == 0
    assert "experts per MoE layer" in capsys.readouterr().out


def test_infos_json_holds_the_figures_its_lines_print(tmp_path, capsys):
    """info's JSON keeps what it prints: the MoE layers, and the budget's MiB, experts per layer, share and
    verdict (it kept only the experts per layer)."""
    out = tmp_path / "info.json"
    assert cli.main(["info", "--budget", "16", "--json", str(out)]) == 0
    said, i = capsys.readouterr().out, json.loads(out.read_text())
    assert f"({i['moe_layers']} MoE)" in said and i["all_experts_bytes"] == i["expert_bytes"] * i["num_experts"] * \
        i["moe_layers"]
    b = i["budget"]
    assert b == {"mib": 16.0, "experts_per_layer": 16 * 2**20 // i["expert_bytes"] // i["moe_layers"],
                 "fraction": b["experts_per_layer"] / i["num_experts"], "enough": True}, b
    assert f"16 MiB holds {b['experts_per_layer']} experts per MoE layer ({b['fraction']:.0%}): enough" in said


def test_the_study_of_a_model_larger_than_memory_reads_its_experts_from_the_disk(monkeypatch):
    """Where the ram store's experts do not fit in memory (and the study and `predict --speculative` take no
    --store), the emulation runs on the disk store, whose reads give the same weights: the same numbers."""
    from expertcache.engine import engine as engine_module
    from expertcache.errors import NotEnoughMemory
    from expertcache.lab.study import StudyConfig, run_study
    cfg = StudyConfig(tokens_per_domain=128, context=64, prompts_per_domain=1, new_tokens=4, bootstrap=50,
                      policies=("fetch-all", "threshold:tau=0.15"), generation_policies=("fetch-all", "threshold:tau=0.15"))
    ram = run_study(None, cfg)
    check = engine_module.Engine._check_memory

    def refuse_ram(self, *args):
        if self.config.store == "ram":
            raise NotEnoughMemory("this run would hold more than this machine has free")
        check(self, *args)
    monkeypatch.setattr(engine_module.Engine, "_check_memory", refuse_ram)
    disk = run_study(None, cfg)
    assert ram.config["store"] == "ram" and disk.config["store"] == "disk"
    assert {p: r["ppl"] for p, r in disk.runs.items()} == {p: r["ppl"] for p, r in ram.runs.items()}
    assert disk.generation["samples"] == ram.generation["samples"]


def test_study_and_bench_run(tmp_path, monkeypatch):
    import dataclasses

    from expertcache.engine.generate import generate
    from expertcache.lab import report
    from expertcache.lab.bench import BenchConfig, run_bench
    from expertcache.lab.report import write_report
    from expertcache.lab.study import StudyConfig, run_study, study_sequences
    cfg = StudyConfig(tokens_per_domain=256, context=128, prompts_per_domain=1, new_tokens=6, bootstrap=200,
                      policies=("fetch-all", "substitute-all", "threshold:tau=0.15", "first-choice", "quality-first",
                                "quality-first:beta=0", "band:lo=0.25", "band:lo=0,hi=0.09", "lowbit:tau=0.15"),
                      generation_policies=("fetch-all", "threshold:tau=0.15"))
    res = run_study(None, cfg)
    files = write_report(res, tmp_path)
    assert all(f.exists() for f in files)
    before = {f.name: f.read_bytes() for f in files}
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):  # a later run's, cut short at its README:
        m.setattr(report, "write_text", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))  # the earlier one stays
        write_report(dataclasses.replace(res, model="another"), tmp_path)
    assert {f.name: f.read_bytes() for f in files} == before and sorted(tmp_path.iterdir()) == sorted(files)
    runs = res.runs
    # the baseline is the full model: every expert resident gives its perplexity and its text
    floor = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    seq = study_sequences(floor, cfg)
    assert runs["fetch-all"]["ppl"] == pytest.approx(perplexity(floor, seq.ids, cfg.context,
                                                                segments=seq.starts).ppl, rel=1e-5)
    floor.reset()
    assert res.generation["samples"]["fetch-all"] == floor.decode(list(generate(floor, seq.prompts[0][1],
                                                                                cfg.new_tokens)))
    assert runs["substitute-all"]["slots_substituted_pct"] > 0
    assert runs["threshold:tau=0.15"]["sync_fetches_per_token"] > runs["first-choice"]["sync_fetches_per_token"]
    # low-precision copies move fewer bytes than full fetches, substitution fewer still
    kib = {p: runs[p]["fetched_kib_per_token"] for p in ("fetch-all", "lowbit:tau=0.15", "threshold:tau=0.15")}
    assert kib["fetch-all"] > kib["lowbit:tau=0.15"] > kib["threshold:tau=0.15"] > 0
    assert set(res.analyses) >= {"where_loss_comes_from", "mass_hypothesis", "equal_mass", "background_admission"}
    assert 0 <= res.generation["threshold:tau=0.15"]["identical_token_share"] <= 1
    b = run_bench(None, BenchConfig(policies=("fetch-all", "threshold:tau=0.15", "fetch-all+prefetch/router-ahead"),
                                    decode_tokens=4, forced_tokens=64, context=32, repeats=1))
    s = b.summary()
    assert s["fetch-all"]["ppl"] == pytest.approx(s["all resident"]["ppl"], rel=1e-5)
    # prefetching is a decode-time pipeline: there it ran, and decoded the exact text
    assert b.decode_counts["fetch-all+prefetch/router-ahead"]["prefetch_fetches"] > 0
    assert b.decoded["fetch-all+prefetch/router-ahead"] == b.decoded["all resident"] == b.decoded["fetch-all"]
    from expertcache.lab.bench import table
    rows = table(b).splitlines()
    assert len(rows) == len(s) + 1 and max(map(len, rows)) <= 100  # the terminal's table fits 100 columns


def test_the_studys_exact_perplexity_is_ppls_each_domain_scoring_its_own_next_token(tmp_path):
    """A domain's last window scored the next domain's first token (and the text's last, a copy of itself), so the
    study's fetch-every-miss perplexity was not `ppl`'s over the same tokens and windows."""
    from expertcache.lab.study import StudyConfig, run_study, study_sequences
    text = tmp_path / "text.txt"
    text.write_text(EVAL_TEXT.read_text()[:3000])
    floor = Engine(None, EngineConfig(store="ram", cache=CacheConfig(fraction=1.0)))
    one = StudyConfig(text=str(text), tokens_per_domain=256, context=128, prompts_per_domain=1, new_tokens=2,
                      bootstrap=10, policies=("fetch-all",), generation_policies=("fetch-all",))
    res = run_study(None, one)
    want = perplexity(floor, floor.encode(text.read_text())[:257], 128)
    assert (res.runs["fetch-all"]["ppl"], res.sequences["tokens"]) == (pytest.approx(want.ppl, rel=1e-6), 256)
    two = StudyConfig(**{**one.__dict__, "domains": (1500,)})  # each domain's windows as its own text's
    seq = study_sequences(floor, two)
    res = run_study(None, two)
    texts = [text.read_text()[:1500], text.read_text()[1500:]]
    each = [perplexity(floor, floor.encode(t)[:257], 128).window_nll for t in texts]
    assert seq.starts == [0, 257] and res.runs["fetch-all"]["window_nll"] == pytest.approx(each[0] + each[1])
    floor.close()


def test_a_policys_generation_in_the_study_is_the_same_beside_a_lowbit_policy():
    """A lowbit policy run earlier left its low-precision copies' store attached, and every later policy's prompts
    were decided under the policy rather than run exactly, expert by expert: threshold's generation test read
    4.7% identical tokens beside lowbit, 9.4% alone."""
    from expertcache.lab.study import StudyConfig, run_study
    alone = StudyConfig(tokens_per_domain=256, context=128, prompts_per_domain=1, new_tokens=8, bootstrap=10,
                        policies=("fetch-all", "threshold:tau=0.15"),
                        generation_policies=("fetch-all", "threshold:tau=0.15"))
    beside = StudyConfig(**{**alone.__dict__, "policies": ("fetch-all", "lowbit:tau=0.15", "threshold:tau=0.15"),
                            "generation_policies": ("fetch-all", "lowbit:tau=0.15", "threshold:tau=0.15")})
    runs = [run_study(None, cfg) for cfg in (alone, beside)]
    assert runs[0].generation["threshold:tau=0.15"] == runs[1].generation["threshold:tau=0.15"]
    assert runs[0].runs["threshold:tau=0.15"]["ppl"] == runs[1].runs["threshold:tau=0.15"]["ppl"]


def test_a_policy_too_long_for_the_terminal_table_keeps_its_whole_name():
    """Cut to its column, quality-first+prefetch/lookahead:fetched=1 and :fetched=1,confidence=0.1 read the same."""
    from types import SimpleNamespace

    from expertcache.lab.bench import table
    figures = dict(decode_ms=2.5, decode_speedup_vs_fetch_all=1.2, forced_ms=1.5, forced_speedup_vs_fetch_all=2.0,
                   ppl_increase_pct=6.1, fetches_per_token=4.4)
    names = ["fetch-all", "quality-first+prefetch/lookahead:fetched=1",
             "quality-first+prefetch/lookahead:fetched=1,confidence=0.1"]
    rows = table(SimpleNamespace(summary=lambda: {n: figures for n in names})).splitlines()
    assert rows[1].startswith("fetch-all ") and rows[2] == names[1] and rows[4] == names[2]  # whole, on their own
    assert all(len(r) <= 100 for r in rows) and rows[3].split() == rows[5].split() == rows[1].split()[1:]


def test_trace_and_simulate_verbs(capsys, tmp_path):
    trace = tmp_path / "eval.ectrace"
    assert cli.main(["trace", "--max-tokens", "256", "--context", "128", "--out", str(trace)]) == 0
    assert cli.main(["simulate", str(trace), "--cache", "0.25", "0.5", "--jobs", "2", "--policies", "fetch-all",
                     "quality-first", "llama.cpp", "--profile", "rtx3090-qwen3-next", "--plot", str(tmp_path / "f.png"),
                     "--json", str(tmp_path / "s.json")]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert len(rows) == 6 and (tmp_path / "f.png").exists()
    by = {(r["policy"], r["cache"]): r for r in rows}
    assert by[("fetch-all", 0.5)]["hit_rate"] > by[("fetch-all", 0.25)]["hit_rate"]
    assert by[("quality-first", 0.25)]["estimated_ms_per_token"] < by[("fetch-all", 0.25)]["estimated_ms_per_token"]
    # a replay times nothing of the engine's: its timings are null, not a measured 0 ms a token
    assert all(r[k] is None for r in rows for k in ("ms_per_token", "stall_s", "wall_s", "peak_memory_bytes"))
    capsys.readouterr()
    assert cli.main(["simulate", str(tmp_path / "f.png")]) == 2
    assert "not an expertcache trace" in capsys.readouterr().err


def test_trained_tokenizer_keeps_the_chat_template(tmp_path):
    """`train` rewrites tokenizer_config.json: the rebuilt model must keep the shipped chat template."""
    from expertcache.train.corpus import EOT
    from expertcache.train.tokenizer import train_tokenizer
    text = tmp_path / "train.txt"
    text.write_text(f"KING HENRY.\nNow, lords, for France.{EOT}EXETER.\nMy lord.{EOT}", encoding="utf-8")
    train_tokenizer(text, tmp_path / "model", vocab_size=300)
    written = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    shipped = json.loads((BUILTIN_MODEL / "tokenizer_config.json").read_text())
    assert written["chat_template"] == shipped["chat_template"]


def test_the_bench_floor_holds_every_expert_from_the_start_without_routing_counts(tmp_path):
    """A model with no routing counts beside it (a new checkpoint, the real-shape one): the all-resident floor starts
    with every expert resident all the same; it started empty each repetition and timed their loading (43 ms a token
    against 8 at real shape from a disk store)."""
    import shutil

    from hf_models import save_tiny

    from expertcache.lab.bench import FLOOR, BenchConfig, run_bench
    save_tiny("qwen3_moe", tmp_path, vocab_size=json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"])
    shutil.copy(BUILTIN_MODEL / "tokenizer.json", tmp_path)
    res = run_bench(tmp_path, BenchConfig(store="ram", policies=("fetch-all",), repeats=1, decode_tokens=4,
                                          forced_tokens=32, context=16))
    assert not res.config["warm"] and res.fetches_per_token["fetch-all"] > 0  # the cache under test starts cold
    assert res.fetches_per_token[FLOOR] == 0 and res.decode_counts[FLOOR]["sync_fetches"] == 0


def test_bench_closes_its_first_engine_when_the_floor_fails_to_open(monkeypatch):
    """run_bench opens the engine under test, then the all-resident floor: a floor that fails to open leaves
    the first engine closed (its store, ring and threads), and the error propagates."""
    from expertcache.lab import bench
    opened, closed = [], []

    class Counted(bench.Engine):
        def __init__(self, *a, **k):
            if opened:
                raise RuntimeError("the floor failed to open")
            super().__init__(*a, **k)
            opened.append(self)

        def close(self):
            closed.append(self)
            super().close()
    monkeypatch.setattr(bench, "Engine", Counted)
    with pytest.raises(RuntimeError, match="the floor failed to open"):
        bench.run_bench(None, bench.BenchConfig(store="ram", policies=("fetch-all",), repeats=1))
    assert len(opened) == 1 and closed == opened


def test_the_builtin_model_written_at_a_larger_shape_is_the_same_function(tmp_path, eval_ids, benchmark_script):
    """benchmarks/make_checkpoint.py --from-builtin: the built-in model's weights carried into a larger shape (its
    stream rotated into more channels, its heads among more heads of more channels, its experts' neurons among
    more) compute its logits to fp16's rounding, so that a real-shape checkpoint routes as a trained model does."""
    make = benchmark_script("make_checkpoint")
    shape = {**make.SHAPE, "hidden_size": 384, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
             "moe_intermediate_size": 96}
    config, shards = make.builtin_at_shape(1, shape)
    make.write(tmp_path, config, shards)
    ids = torch.tensor(eval_ids[:129])
    logits = []
    for model in (None, tmp_path):
        engine = Engine(model, EngineConfig(store="ram"))
        logits.append(engine.forward(ids[:-1], 0).float())
        engine.close()
    ours, wide = logits
    assert engine.args.hidden_size == 384 and engine.args.num_heads == 8
    nll = [torch.nn.functional.cross_entropy(x, ids[1:]).item() for x in logits]
    assert nll[1] == pytest.approx(nll[0], rel=1e-3)
    assert (ours.argmax(-1) == wide.argmax(-1)).float().mean() > 0.98
    assert (ours - wide).abs().max(-1).values.median() < 0.02
