"""The command line as a newcomer meets it: help and --version without torch, every default shown, flags named
in errors, generate's statistics, ppl's Ctrl-C."""
import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expertcache import cli
from expertcache.commands import chat as cli_chat


def test_help_and_version_load_neither_torch_nor_numba():
    code = ("import sys\nfrom expertcache import cli\n"
            "for argv in (['--help'], ['--version'], *([v, '--help'] for v in cli.VERBS)):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'numba', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    assert "expertcache 0" in out  # --version


def test_every_option_says_its_default():
    """Each option of each verb has help, and the help shows its default unless it has none (a flag, or None
    described in words)."""
    parser = cli.Parser(prog="expertcache")
    sub = parser.add_subparsers(parser_class=cli.Parser)
    for verb in cli.VERBS:
        p = sub.add_parser(verb)
        importlib.import_module(f"expertcache.commands.{verb.replace('-', '_')}").add_arguments(p)
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (verb, action.dest)
            if action.default not in (None, False, []) and not action.required and \
                    not isinstance(action, argparse._StoreFalseAction):  # --no-X: "default: True" would mislead
                assert "default" in formatter._get_help_string(action), (verb, action.dest)


def test_library_defaults_are_the_verbs_defaults():
    """The verbs restate a few library defaults so that --help need not import the library: they must agree."""
    from expertcache.lab.bench import BenchConfig
    from expertcache.lab.study import StudyConfig
    from expertcache.train.train import Schedule
    args = {}
    for verb in ("bench", "study", "train"):
        p = cli.Parser(prog=verb)
        importlib.import_module(f"expertcache.commands.{verb}").add_arguments(p)
        args[verb] = p.parse_args([])
    b, s = args["bench"], args["study"]
    assert (b.decode_tokens, b.forced_tokens, b.repeats) == (BenchConfig.decode_tokens, BenchConfig.forced_tokens,
                                                             BenchConfig.repeats)
    assert tuple(b.policies) == BenchConfig.policies
    assert (s.tokens_per_domain, s.context) == (StudyConfig.tokens_per_domain, StudyConfig.context)
    assert args["train"].tokens == Schedule.tokens


def test_sampling_errors_name_the_cli_flags(capsys):
    assert cli.main(["generate", "--store", "ram", "-n", "0"]) == 2
    assert "-n/--max-new-tokens 0 must be >= 1" in capsys.readouterr().err
    assert cli.main(["generate", "--store", "ram", "--max-seq", "8", "-n", "8", "-p", "ROMEO."]) == 2
    err = capsys.readouterr().err
    assert "-n 8 exceed --max-seq 8" in err and "max_tokens" not in err


def test_chat_names_its_flags_when_a_reply_cannot_fit(monkeypatch, capsys):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\n"))
    assert cli.main(["chat", "--store", "ram", "--max-seq", "16", "-n", "8"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "-n 8 exceed --max-seq 16" in err and "max_tokens" not in err, err


@pytest.mark.parametrize("flags, words", [(["--logit-bias", "99999=1"], "logit_bias names token 99999"),
                                          (["-n", "100000"], "-n 100000 leaves no room")])
def test_chat_refuses_at_start_what_would_refuse_every_message(monkeypatch, capsys, flags, words):
    """A bias on a token past the vocabulary, or -n past --max-seq, refused each message in turn ("the conversation
    goes on") where none could: refused once, before the banner."""
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhello\n"))
    assert cli.main(["chat", "--store", "ram", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err and "goes on" not in err, err


def test_chat_leaves_out_a_message_too_long_and_goes_on(monkeypatch, capsys):
    """A message that cannot fit even alone ended the session (exit 2), and the exchanges before it had been dropped
    for it: the conversation was lost. It is left out, named on stderr, and the next message is answered with the
    conversation kept; the exit code still says a message was refused."""
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\n" + "word " * 300 + "\nAnd you?\n"))
    prompts = []
    real = cli_chat.fitting_prompt

    def recorded(engine, template, messages, max_tokens):
        prompt = real(engine, template, messages, max_tokens)
        prompts.append([m["content"] for m in messages])
        return prompt
    monkeypatch.setattr(cli_chat, "fitting_prompt", recorded)
    assert cli.main(["chat", "--store", "ram", "--max-seq", "256", "-n", "4", "--ignore-eos"]) == 2
    err = capsys.readouterr().err
    assert "the message is left out; the conversation goes on" in err and "-n 4 exceed --max-seq 256" in err, err
    assert len(prompts) == 2 and prompts[1][0] == "Who goes there?" and prompts[1][-1] == "And you?", prompts


@pytest.mark.parametrize("argv", [["ppl", "--store", "ram", "--max-tokens", "32"],
                                  ["generate", "--store", "ram", "-n", "3", "-p", "ROMEO."]])
def test_json_dash_puts_the_json_alone_on_stdout(argv, capsys, tmp_path, monkeypatch):
    """`--json -` is stdout, as the tools it pipes into expect: not a file named "-", and no other line in it."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([*argv, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["tokens"] == 32 if argv[0] == "ppl" else len(data["tokens"]) == 3
    assert ("perplexity" if argv[0] == "ppl" else "ROMEO.") in err  # the human output, moved
    assert not (tmp_path / "-").exists()


def test_generate_reports_prefill_and_generation_apart(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    assert cli.main(["generate", "--store", "ram", "-n", "6", "-p", "ROMEO."]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ROMEO.") and out.endswith("\n")
    speed = next(line for line in err.splitlines() if line.startswith("prefill:"))
    assert "prompt tokens in" in speed and "generation: 6 tokens, 5 decode steps" in speed
    assert "ms/token" not in err  # no figure that mixes the two


def test_generate_escapes_what_an_ascii_stdout_cannot_hold(monkeypatch):
    """Under PYTHONIOENCODING=ascii or a C locale, a prompt or generation outside ASCII is written escaped."""
    import io
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    assert cli.main(["generate", "--store", "ram", "-n", "2", "-p", "caf\u00e9 \u2615"]) == 0
    out.flush()
    assert out.buffer.getvalue().startswith(b"caf\\xe9 \\u2615")


def test_a_c_locale_without_utf8_mode_takes_and_writes_text_outside_ascii():
    """Under LC_ALL=C PYTHONUTF8=0 Python reads arguments and stdin as ASCII, non-ASCII as lone surrogates, and
    writes stdout with surrogateescape: a prompt, a stop string or a system message outside ASCII was refused as
    not UTF-8, and the generation's echo of it ended in a UnicodeEncodeError's traceback. Bytes that are not UTF-8
    are still refused in one line."""
    import subprocess
    import sys
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    run = ["-m", "expertcache", "generate", "--store", "ram", "-n", "2"]
    proc = subprocess.run([sys.executable, *run, "-p", "caf\u00e9 \u2615", "--stop", "\u00e9t\u00e9"],
                          capture_output=True, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(b"caf\\xe9 \\u2615"), proc.stderr.decode()
    proc = subprocess.run([sys.executable, *run], input="caf\u00e9\n".encode(), capture_output=True, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(b"caf\\xe9"), proc.stderr.decode()
    proc = subprocess.run([sys.executable, "-m", "expertcache", "chat", "--store", "ram", "-n", "2", "--system",
                           "\u00e9t\u00e9"], input="caf\u00e9\n".encode(), capture_output=True, env=env)
    assert proc.returncode == 0 and b"error" not in proc.stderr, proc.stderr.decode()
    proc = subprocess.run([sys.executable, *run, "-p", b"caf\xe9"], capture_output=True, env=env)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 2 and err.count("\n") == 0 and "not UTF-8 text" in err, err


def test_perplexity_interrupted_keeps_the_windows_scored():
    from expertcache import Engine, EngineConfig, perplexity
    engine = Engine(None, EngineConfig(store="ram", max_seq=64))
    ids = engine.encode(open(cli.DATA / "eval.txt").read()[:4000])[:97]
    seen = []

    def progress(n):
        seen.append(n)
        if len(seen) == 2:
            raise KeyboardInterrupt
    r = perplexity(engine, ids, 32, progress=progress, partial_on_interrupt=True)
    assert r.interrupted and r.tokens == 64 and len(r.window_nll) == len(r.window_stats) == 2
    with pytest.raises(KeyboardInterrupt):
        seen.clear()
        perplexity(engine, ids, 32, progress=progress)
    engine.close()


def test_an_interrupted_perplexitys_statistics_are_the_scored_windows(monkeypatch):
    """A Ctrl-C inside a window's forward left that window's MoE calls and fetches in the run's statistics, over the
    tokens of the windows scored alone: fetches a token and time a token came out inflated (30.5 fetches a token
    against 25.4 in its windows)."""
    from expertcache import Engine, EngineConfig, perplexity
    engine = Engine(None, EngineConfig(store="ram", max_seq=64, initial="cold"))
    ids = engine.encode(open(cli.DATA / "eval.txt").read()[:4000])[:97]
    passes, calls = engine._passes, []

    def cut_in_the_third(x, pos, last):
        calls.append(pos)
        if len(calls) == 3:
            passes(x[:16], pos, last)  # half the window decided and fetched, then Ctrl-C
            raise KeyboardInterrupt
        return passes(x, pos, last)
    monkeypatch.setattr(engine, "_passes", cut_in_the_third)
    r = perplexity(engine, ids, 32, partial_on_interrupt=True)
    layers = engine.args.num_moe_layers
    assert r.interrupted and r.tokens == 64 and r.stats["tokens"] == 64
    assert r.stats["moe_calls"] == 64 * layers == sum(w["moe_calls"] for w in r.window_stats)
    assert r.stats["sync_fetches"] == sum(w["sync_fetches"] for w in r.window_stats)
    assert engine.stats.moe_calls == 64 * layers  # the engine's own, which `ppl` prints
    engine.close()


def test_study_policies_restrict_the_generation_test_too(tmp_path, capsys):
    """A study of some policies runs only those in its generation test too; its --json may go into the folder that
    its --out makes (refused before: that folder did not exist yet)."""
    out = tmp_path / "report" / "study.json"
    assert cli.main(["study", "--policies", "substitute-all", "--tokens-per-domain", "64", "--context", "64",
                     "--out", str(tmp_path / "report"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"fetch-all", "substitute-all"}
    assert set(res["generation"]) - {"samples", "prompt0"} == {"fetch-all", "substitute-all"}


class InterruptAtCall:
    """Stands in for `module.name`: its `stop`-th call (counting from 1, `calls` so far) raises KeyboardInterrupt, as a
    Ctrl-C there would; every other call runs the real function."""

    def __init__(self, monkeypatch, module, name: str):
        self.real, self.calls, self.stop = getattr(module, name), 0, None
        monkeypatch.setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.stop:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


def test_an_interrupted_study_writes_the_report_of_what_ran(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a study's third policy: its report holds the baseline and the policy measured, names what did
    not run, and the run ends with an interrupt's exit code; everything was lost, hours of a real model's runs.
    Interrupted within the baseline, nothing is written."""
    import expertcache.lab.study as study
    cut = InterruptAtCall(monkeypatch, study, "perplexity")
    out = tmp_path / "report"
    argv = ["study", "--policies", "substitute-all", "threshold:tau=0.15", "--tokens-per-domain", "64", "--context",
            "64", "--out", str(out), "--json", str(tmp_path / "study.json")]
    cut.stop = 3
    assert cli.main(argv) == 130
    res = json.loads((out / "study.json").read_text())
    assert set(res["runs"]) == {"fetch-all", "substitute-all"} and res["generation"] == {}
    assert res["interrupted"] and res["not_run"] == ["threshold:tau=0.15", "generation test"]
    assert "not run `threshold:tau=0.15`, nor the generation test" in (out / "README.md").read_text()
    assert "not run: threshold:tau=0.15, generation test" in capsys.readouterr().err
    cut.calls, cut.stop, out = 0, 1, tmp_path / "none"
    assert cli.main([*argv[:-4], "--out", str(out)]) == 130 and not out.exists()


def test_an_interrupted_bench_keeps_its_whole_repetitions(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a bench's third repetition: the table and JSON hold the two repetitions completed (the third's
    first variant left out), say so, and the run ends with an interrupt's exit code; everything was lost. Before a
    whole repetition, nothing is written."""
    import expertcache.lab.bench as bench
    cut = InterruptAtCall(monkeypatch, bench, "_timed")
    argv = ["bench", "--store", "ram", "--policies", "substitute-all", "--decode-tokens", "4", "--forced-tokens", "64",
            "--repeats", "5", "--json", str(tmp_path / "bench.json")]
    cut.stop = 3 * 3 + 2  # the floor, fetch-all and substitute-all a round: the warm-up, two rounds, one variant more
    assert cli.main(argv) == 130
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["config"]["repeats_done"] == 2
    assert all(len(t) == 2 for t in res["decode_ms"].values()) and len(res["decode_ms"]) == 3
    out, err = capsys.readouterr()
    assert "median of 2 interleaved repetitions of 5 (interrupted)" in out
    assert "interrupted: the table holds 2 of 5 repetitions" in err
    cut.calls, cut.stop = 0, 3 + 2
    (tmp_path / "bench.json").unlink()
    assert cli.main(argv) == 130 and not (tmp_path / "bench.json").exists()


def test_an_interrupted_tune_reports_the_finalists_it_scored(tmp_path, capsys, monkeypatch):
    """Ctrl-C while tune scores its finalists: the report and JSON hold the search and the finalists scored whole
    (the one cut short left out), choose no policy, and the run ends with an interrupt's exit code; everything was
    lost. Within the baseline's scoring, nothing is written."""
    import expertcache.lab.tune as tune
    cut = InterruptAtCall(monkeypatch, tune, "perplexity")
    argv = ["tune", "--budget", "3%", "--profile", "rtx3090-qwen3-next", "--calib-tokens", "600", "--tokens", "600",
            "--context", "256", "--finalists", "4", "--json", str(tmp_path / "tune.json")]
    cut.stop = 3  # the baseline and one finalist scored, the next cut short
    assert cli.main(argv) == 130
    res = json.loads((tmp_path / "tune.json").read_text())
    assert res["config"]["interrupted"] == "score" and res["winner"] is None and res["validation"] == {}
    policies = {tune.without_prefetch(s) for s in res["finalists"]}  # a prefetching one scores as its policy
    assert len(policies) == 2 and "fetch-all" in policies and len(res["candidates"]) > 4
    out, err = capsys.readouterr()
    assert f"interrupted while scoring the finalists: {len(res['finalists']) - 1} scored (above), no policy " \
        "chosen" in out and "held-out validation" not in out
    assert err.strip().endswith("interrupted while scoring the finalists: the report holds what was done"), err
    cut.calls, cut.stop = 0, 1
    (tmp_path / "tune.json").unlink()
    assert cli.main(argv) == 130 and not (tmp_path / "tune.json").exists()


def test_a_text_of_one_domain_reports_no_interval_where_it_has_no_windows(tmp_path):
    """A text without topic changes has no window after one, and one window has no bootstrap interval: the study
    says so where it printed NaN, and a paired increase of one window has no CI."""
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.lab.study import increase_text, paired_increase
    assert paired_increase([], [], 100, 0) == {"pct": None, "ci": None}
    one = paired_increase([2.0], [2.01], 100, 0)
    assert one["ci"] is None and increase_text(one) == "+1.01% [n/a (one window)]"
    # a change that rounds to none reads +0.00, as bench, study and tune print it, not -0.00
    assert increase_text({"pct": -0.001, "ci": [-0.004, 0.003]}) == "+0.00% [+0.00, +0.00]"
    two = paired_increase([2.0, 2.1], [2.01, 2.2], 100, 0)
    assert two["ci"][0] <= two["pct"] <= two["ci"][1]
    # two windows whose increases differ: Student's t interval spans both signs, where the bootstrap's (the two
    # windows' own values) called a -3.4% change significant
    few = paired_increase([1.0, 1.2], [0.96, 1.17], 2000, 0)
    assert few["ci"][0] < 0 < few["ci"][1] and few["pct"] == pytest.approx(-3.44, abs=0.01)
    text = tmp_path / "one_domain.txt"  # no segments file beside it: one domain
    text.write_text((BUILTIN_MODEL.parent / "eval.txt").read_text(encoding="utf-8")[:1500], encoding="utf-8")
    assert cli.main(["study", "--text", str(text), "--policies", "quality-first", "quality-first:beta=0",
                     "--tokens-per-domain", "128", "--context", "64", "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "README.md").read_text()
    assert "after each topic change n/a (no window)" in report and "+nan" not in report
    assert "teacher-forced tokens of one_domain.txt (" in report  # the user's text, not "the evaluation text"


def test_chat_prints_a_banner_and_leaves_at_quit(monkeypatch, capsys):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\n/quit\nNever answered.\n"))
    assert cli.main(["chat", "--store", "ram", "-n", "4", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "expertcache chat: the built-in model" in err.splitlines()[0] and "/exit, /quit" in err
    assert len([line for line in out.splitlines() if line.strip()]) == 1  # one reply, then /quit left


def test_chat_shows_a_reasoning_models_thoughts_on_stderr_and_its_answer_on_stdout(monkeypatch, capsys, tmp_path):
    """A template that writes reasoning in <think> tags: chat's stdout has the answer alone (what a script piping
    messages in reads), stderr the reasoning."""
    import io
    import shutil

    from expertcache.engine.engine import BUILTIN_MODEL
    shutil.copytree(BUILTIN_MODEL, tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: {# </think> #}")
    monkeypatch.setattr("sys.stdin", io.StringIO("Who goes there?\n"))
    said = json.dumps("<think>\nA guard asks.\n</think>\n\nA friend.")
    assert cli.main(["chat", "--model", str(tmp_path / "model"), "--store", "ram", "-n", "40",
                     "--grammar", f"start: {said}"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "A friend." and "A guard asks." in err


def test_readme_tour_commands_parse_and_version_runs():
    """Every command of the README's tour is one the CLI accepts as written (flags, values, sizes); the set-up
    commands at the top are the ones the project documents."""
    import re
    import shlex
    readme = (cli.DATA.parents[1] / "README.md").read_text()
    assert readme.split("```bash\n")[1].startswith("pip install torch==2.13.0 -e . && expertcache generate\n")
    tour = readme.split("## A tour", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split("#")[0]) for line in tour.splitlines() if line.startswith("expertcache")]
    assert len(commands) >= 8
    parser = cli.Parser(prog="expertcache")
    sub = parser.add_subparsers(dest="verb", parser_class=cli.Parser)
    for verb in cli.VERBS:
        importlib.import_module(f"expertcache.commands.{verb.replace('-', '_')}").add_arguments(sub.add_parser(verb))
    for argv in commands:
        if argv[1:] != ["--help"]:
            assert parser.parse_args(argv[1:]).verb == argv[1], argv
    assert re.search(r"expertcache generate -p \"ROMEO\.\"", tour)


def test_first_runs_compile_notice_comes_with_the_first_compile(tmp_path):
    """Where this version's kernels were never compiled, the notice is printed once, when numba first compiles, and
    not by a run that ends before compiling (bad input stays one line); the verb's success leaves the mark that
    ends it. Each set of kernels has its own: a first `simulate` or `tune` after a `generate` compiled for a
    minute without a word."""
    code = ("import sys\nfrom numba import njit\nfrom expertcache.commands import options\n"
            "options.announce_compile(*sys.argv[2:])\noptions.announce_compile('engine')\n"
            "print('before', file=sys.stderr)\n"
            "if sys.argv[1] == 'compile':\n"
            "    njit(lambda x: x + 1)(1)\n    njit(lambda x: x + 2)(1)\n    options.compiled_ok()\n")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path), "NUMBA_CACHE_DIR": ""}
    env.pop("NUMBA_CACHE_DIR")

    def run(what, *kernels):
        return subprocess.run([sys.executable, "-c", code, what, *kernels], capture_output=True, text=True, env=env,
                              check=True).stderr.splitlines()
    assert run("nothing") == ["before"]
    err = run("compile")
    assert err[0] == "before" and len(err) == 2 and "compiling the kernels" in err[1] and "cached in" in err[1]
    assert run("compile") == ["before"]  # the mark was left
    err = run("compile", "engine", "simulator")  # the simulator's kernels never compiled: said once
    assert len(err) == 2 and "compiling the kernels" in err[1], err
    assert run("compile", "simulator") == ["before"]
    env["XDG_CACHE_HOME"] = "/proc/expertcache"  # a folder that cannot be made: every run compiles, and says why
    err = run("compile")
    assert "cannot be written, so every run compiles again" in err[1] and "NUMBA_CACHE_DIR" in err[1]


def test_a_first_runs_compiling_is_not_counted_as_the_models_time(capsys):
    """numba compiles a kernel at its first call, inside the forward a first run times: those seconds are the
    compiler's (minutes on a new machine), so ms/token and generate's speeds leave them out and say so."""
    import time

    import torch
    from numba import njit

    from expertcache.engine.compile_clock import compile_seconds
    from expertcache.engine.engine import Engine, EngineConfig
    engine = Engine(None, EngineConfig(store="ram"))

    def forward_that_compiles():
        njit(lambda x: x * 3 + 1)(2)  # a function never compiled before: compiled here
        return torch.zeros(1, 4)
    before, start = compile_seconds(), time.perf_counter()
    engine._timed(forward_that_compiles, 1)
    took = time.perf_counter() - start
    compiling = compile_seconds() - before
    assert engine.stats.compile_s == pytest.approx(compiling) and compiling > 0.02
    assert engine.stats.wall_s <= took - compiling + 1e-4
    assert "not counted" in engine.stats.line()
    engine.close()


def test_loading_a_kernel_from_numbas_cache_is_counted_as_compiling(tmp_path):
    """A later run loads each kernel's machine code from numba's cache at its first call (a tenth of a second for
    the engine's), which numba's compile event leaves out: the clock counts it too, so that a first prompt's speed
    is the model's, not the loader's."""
    (tmp_path / "kern.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f(x):\n"
                                      "    return x * 3 + 1\n")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from expertcache.engine.compile_clock import "
             "compile_seconds; import kern; b = compile_seconds(); kern.f(2); print(compile_seconds() - b, "
             "sum(kern.f.stats.cache_hits.values()))")
    runs = [subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True,
                           env=os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}).stdout.split()
            for _ in range(2)]
    (compiled, hits0), (loaded, hits1) = runs
    assert (hits0, hits1) == ("0", "1") and float(compiled) > 0 and float(loaded) > 0, runs


def test_predict_writes_its_table_as_json_and_a_plot(tmp_path, capsys):
    """`predict --plot --json`: the printed table's recalls, per predictor and layer transition, and a PNG of them."""
    png, js = tmp_path / "recall.png", tmp_path / "recall.json"
    assert cli.main(["predict", "--max-tokens", "64", "--predictors", "router-ahead", "quasi-hidden",
                     "--plot", str(png), "--json", str(js)]) == 0
    table = json.loads(js.read_text())
    assert list(table) == ["router-ahead", "quasi-hidden"]
    assert all(len(rec) == 5 and all(0 <= r <= 1 for r in rec) for rec in table.values())
    out = capsys.readouterr().out
    assert f"| quasi-hidden | {table['quasi-hidden'][0]:.1%} |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reader_that_leaves_the_pipe_ends_the_run_quietly():
    """`expertcache generate | head -c 1`: no traceback and no error blaming the disk, but SIGPIPE's exit status,
    as a shell tool ends when its reader has left."""
    p = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "generate", "--store", "ram", "-n", "256",
                          "--ignore-eos"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)
    p.stdout.close()  # the reader leaves after the first token
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and "error" not in err and "Traceback" not in err, err


def test_a_prompt_awaited_on_an_open_pipe_is_said_to_be_awaited():
    """Without a prompt, generate reads a stdin that is not a terminal; one that stays open (an IDE's, a job's)
    looked like a hang, nothing said. A line on stderr says what it waits for, then the prompt is read as before."""
    p = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "generate", "--store", "ram", "-n", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    while "reading the prompt from stdin" not in line:  # a first run's compile notice may come first
        line = p.stderr.readline()
        assert line, "generate ended without saying it waits for a prompt"
    out, err = p.communicate("JULIET.\n", timeout=300)
    assert p.returncode == 0 and out.startswith("JULIET."), err


@pytest.mark.parametrize("argv, said", [
    (["generate", "--policy", "fetch-most"], "fetch-most"),
    (["serve", "--store", "tape"], "unknown store 'tape'"),
    (["ppl", "--store", "ram", "--read-mode", "direct"], "--read-mode direct"),
    (["chat", "--policy", "quality-first+prefetch/oracle"], "oracle"),
    (["bench", "--policies", "quality-first", "speed-firts"], "speed-firts"),
    (["ppl", "--device", "tpu"], "unknown device 'tpu'"),
    *([] if torch.cuda.is_available() else [(["generate", "--device", "cuda"], "no CUDA device"),
                                            (["generate", "--store", "pinned"], "needs a CUDA device"),
                                            (["calibrate-hw", "--store", "pinned", "--out", "hw.json"],
                                             "needs a CUDA device")]),
])
def test_options_that_need_no_model_are_refused_before_a_hub_model_downloads(argv, said, monkeypatch, capsys):
    """A Hub model is gigabytes: `--device cuda` on a machine without one, or a misspelt policy, was said after
    the whole download."""
    from expertcache.engine import checkpoint
    monkeypatch.setattr(checkpoint, "download", lambda repo: pytest.fail(f"{repo} downloaded before the check"))
    assert cli.main([argv[0], "--model", "org/some-moe", *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_a_hub_id_is_its_snapshot_folder_for_every_verb(tmp_path, monkeypatch):
    """A Hub id is read from, and written beside, its snapshot in huggingface_hub's cache, chat_template.jinja
    included: calibrate wrote into ./org/name (failing after the whole run), a warm start never found the counts,
    and the template was not downloaded. A folder given with ~ is the user's home's."""
    import fnmatch
    import shutil

    import huggingface_hub
    from hf_models import save_tiny

    from expertcache.engine.chat import ChatTemplate
    from expertcache.engine.engine import BUILTIN_MODEL, Engine
    src, snapshot = tmp_path / "release", tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    save_tiny("qwen3_moe", src, vocab_size=json.loads((BUILTIN_MODEL / "config.json").read_text())["vocab_size"])
    shutil.copy(BUILTIN_MODEL / "tokenizer.json", src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    # the weights again in other runtimes' layouts, as Mistral's and GPT-OSS's releases ship them: not fetched
    for copy in ("consolidated.safetensors", "original/model.safetensors", "metal/model.bin"):
        (src / copy).parent.mkdir(exist_ok=True)
        shutil.copy(src / "model.safetensors", src / copy)

    def snapshot_download(repo_id, allow_patterns, ignore_patterns):  # huggingface_hub's, offline: what it fetches
        assert repo_id == "org/tiny"
        for f in src.rglob("*"):
            name = f.relative_to(src).as_posix()
            if f.is_file() and any(fnmatch.fnmatch(name, p) for p in allow_patterns) and \
                    not any(fnmatch.fnmatch(name, p) for p in ignore_patterns):
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, snapshot / name)
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["calibrate", "--model", "org/tiny", "--max-tokens", "64"]) == 0
    assert (snapshot / "routing_counts.json").exists() and not (tmp_path / "org").exists()
    fetched = sorted(f.name for f in snapshot.rglob("*.safetensors"))
    assert fetched == ["default_vectors.safetensors", "model.safetensors"]  # the model's, and calibrate's own
    engine = Engine("org/tiny")
    assert engine.routing_counts is not None
    assert ChatTemplate.of(engine).render([{"role": "user", "content": "hi"}]) == "hi"
    from expertcache.engine.checkpoint import model_name
    assert model_name(engine.path) == "tiny"  # what chat and serve call it, not the snapshot's commit
    engine.close()
    monkeypatch.setenv("HOME", str(tmp_path))
    Engine("~/release").close()


def test_a_benchmark_scripts_bad_input_ends_in_one_line_and_exit_2(tmp_path):
    """The benchmark scripts end their bad input as the verbs do, whichever layer refuses it; a bug still shows
    its traceback."""
    script = [sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "prefetch_bound.py")]
    for argv, said in ((["--policy", "bogus"], "unknown policy 'bogus'"),
                       (["--model", str(tmp_path / "none")], "no such checkpoint folder")):
        out = subprocess.run([*script, *argv], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("prefetch_bound.py: error: ") and said in out.stderr

    def bug():
        raise ValueError("a bug")
    with pytest.raises(ValueError):
        cli.run_script(bug)
    with pytest.raises(SystemExit) as e:
        cli.run_script(lambda: None)
    assert e.value.code == 0


@pytest.mark.parametrize("threads", ["0", "two", ""])
def test_a_thread_count_numba_cannot_take_is_one_line(threads):
    """NUMBA_NUM_THREADS, which sets the compiled kernels' threads, is read by numba as it is first imported: 0
    ended in numba's traceback (exit 1), a word or an empty one (NUMBA_NUM_THREADS=$UNSET) was ignored with a
    warning and every core used."""
    import os
    out = subprocess.run([sys.executable, "-m", "expertcache.cli", "ppl", "--store", "ram", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NUMBA_NUM_THREADS": threads})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"NUMBA_NUM_THREADS={threads!r} is not a whole number >= 1" in out.stderr


def test_an_expertcache_home_that_cannot_be_a_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """EXPERTCACHE_HOME naming a file, or a folder that cannot be made, is refused before the run with the variable
    named, where the store's conversion failed on an errno naming a path; one that exists is used as it is."""
    from expertcache.commands.options import check_environment
    from expertcache.errors import BadInput
    (tmp_path / "file").write_text("")
    for home, what in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "stores", "is a file")):
        monkeypatch.setenv("EXPERTCACHE_HOME", str(home))
        with pytest.raises(BadInput, match=f"EXPERTCACHE_HOME=.* cannot be made .*{what}\\); set it to a folder"):
            check_environment()
    for home in (tmp_path / "new" / "home", tmp_path):
        monkeypatch.setenv("EXPERTCACHE_HOME", str(home))
        check_environment()
    assert not (tmp_path / "new").exists()  # checked, not made: verbs that convert nothing leave no folder


def test_an_empty_expertcache_home_is_the_default_not_the_working_folder(tmp_path, monkeypatch):
    """EXPERTCACHE_HOME set but empty (EXPERTCACHE_HOME=$UNSET) reads as unset, as XDG_CACHE_HOME does: stores
    were converted into ./stores of whatever folder the command ran in; a ~ in it is the home folder."""
    from expertcache.engine.checkpoint import open_checkpoint
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.engine.stores.convert import default_store_dir
    monkeypatch.setenv("EXPERTCACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_store_dir(open_checkpoint(BUILTIN_MODEL)).parent == tmp_path / ".cache" / "expertcache" / "stores"
    monkeypatch.setenv("EXPERTCACHE_HOME", "~/stores-here")  # quoted, the shell left ~: it made a folder named ~
    assert default_store_dir(open_checkpoint(BUILTIN_MODEL)).parent == tmp_path / "stores-here" / "stores"


@pytest.mark.parametrize("data", ["ROMEO.\n".encode("utf-16-le"), b"ROMEO.\0\n"], ids=["utf-16", "nul"])
def test_a_piped_prompt_of_utf16_or_nuls_is_refused_as_a_text_file_is(data, monkeypatch, capsys):
    """A prompt piped from a UTF-16 file without a byte-order mark reads as ASCII with a NUL beside each character:
    `--text` refuses such a file, and generate ran the NULs as the prompt. A UTF-8 byte-order mark is dropped."""
    import io
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape"))
    assert cli.main(["generate", "--store", "ram", "-n", "2", "-"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the prompt read from stdin is UTF-16 or binary" in err, err
    monkeypatch.setattr("sys.stdin", io.StringIO("\ufeffROMEO.\n"))
    assert cli.main(["generate", "--store", "ram", "-n", "2", "-"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO.\n")


def test_a_prompt_past_the_models_context_names_no_higher_max_seq(capsys):
    """A prompt that outgrows --max-seq: a higher --max-seq is named as a fix only up to the model's context,
    where it was named past it too (and then refused)."""
    long = "ROMEO. What light through yonder window breaks? " * 400
    assert cli.main(["generate", "--store", "ram", "-n", "4", "-p", long]) == 2
    err = capsys.readouterr().err.strip()
    assert "exceed --max-seq 2048" in err and "raise --max-seq" not in err and "whole context" in err, err
    assert cli.main(["generate", "--store", "ram", "--max-seq", "64", "-n", "4", "-p", long]) == 2
    assert "raise --max-seq (at most 2048, the model's context)" in capsys.readouterr().err


@pytest.mark.parametrize("argv,near", [(["generat"], "did you mean generate?"),
                                       (["generate", "--polcy", "fetch-all"], "did you mean --policy?"),
                                       (["generate", "--cache=0.5", "--stroe", "ram"], "did you mean --store?"),
                                       (["generate", "--policy", "treshold:tau=0.1"], "did you mean threshold?"),
                                       (["generate", "--eviction", "lruu"], "did you mean lru?"),
                                       (["generate", "--policy", "fetch-all+prefetch/lookahed"],
                                        "did you mean lookahead?"),
                                       (["generate", "--zzz"], None)])
def test_a_misspelt_verb_option_or_name_is_answered_with_the_nearest_spelling(argv, near, capsys):
    """A typo names what was meant, as the server's "did you mean" does for a misspelt field; nothing near, no
    guess."""
    try:  # argparse's errors exit, the engine's return
        code = cli.main([*argv, "-n", "1", "-p", "x"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert (near in err) if near else "did you mean" not in err, err


def test_help_shows_a_default_of_zero(capsys):
    """A default of 0 is shown as any other: `0 == False`, and the check for no default hid --temperature's."""
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "0 is greedy (default: 0.0)" in out and "sampling seed (default: 0)" in out
    assert "--ignore-eos" in out and "(default: False)" not in out  # a flag's off is no default to show


def test_study_speculation_and_tune_size_their_engines_to_the_context(monkeypatch):
    """A --context past the default max_seq was refused naming --max-seq, which study and tune do not take; their
    engines hold the context's positions."""
    from expertcache.lab import speculation, study, tune
    from expertcache.lab.study import StudyConfig
    from expertcache.lab.tune import TuneConfig
    made = []

    class Stop(Exception):
        pass

    def engine(model, config):
        made.append(config.max_seq)
        raise Stop
    for module in (study, speculation, tune):
        monkeypatch.setattr(module, "exact_engine", engine)
    for run in (lambda: study.run_study(None, StudyConfig(context=3000)),
                lambda: speculation.speculative_quality(None, StudyConfig(context=3000)),
                lambda: tune.slot_engine(None, TuneConfig(context=3000), "auto")):
        with pytest.raises(Stop):
            run()
    assert made == [3000, 3000, 3000]
