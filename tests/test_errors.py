"""Bad input: one clear line and exit code 2 from the CLI, a typed exception from the library."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import save_tiny

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.checkpoint import open_checkpoint
from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
from expertcache.engine.perplexity import perplexity
from expertcache.errors import BadInput, CacheTooSmall, CheckpointError, UnknownName, UnsupportedArchitecture
from expertcache.models import model_args


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def ckpt(tiny, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], path)
    return path


def expect_cli_error(capsys, ckpt, match, *extra):
    code, err = run_cli(capsys, "ppl", "--model", str(ckpt), "--text", __file__, *extra)
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("expertcache: error:") and match in err, err


def test_missing_folder(capsys, tmp_path):
    expect_cli_error(capsys, tmp_path / "nope", "no such checkpoint folder")
    with pytest.raises(CheckpointError):
        Engine(tmp_path / "nope")
    (tmp_path / "model.safetensors").write_bytes(b"")  # a file given for the folder that holds it
    expect_cli_error(capsys, tmp_path / "model.safetensors", "is a file, not a checkpoint folder")


def test_a_plain_number_for_a_memory_budget_is_said_to_be_bytes(capsys):
    code, err = run_cli(capsys, "generate", "--memory-budget", "128", "-n", "2", "-p", "ROMEO.")
    assert code == 2 and "128 bytes (a number without a unit is bytes; MiB are written e.g. 512M)" in err
    code, err = run_cli(capsys, "generate", "--memory-budget", "100K", "-n", "2", "-p", "ROMEO.")
    assert code == 2 and "102400 bytes" in err and "102400M" not in err  # a unit given: no hint that it is 1000x


@pytest.mark.parametrize("argv, said", [
    (["tune", "--budget", "1000%"], "from 0 up to (not including) 1000"),
    (["ppl", "--memory-budget", "1Q"], "a number of bytes, or of K, M, G or T"),
    # a value with a minus: its own check (it read as an unknown option, "expected one argument")
    (["ppl", "--memory-budget", "-1G"], "'-1G' is out of range: give a size of at least 1 byte"),
    (["tune", "--budget", "-5%"], "from 0 up to (not including) 1000"),
    (["ppl", "--text", "-"], "a text is read from a file, not stdin"),
    (["trace", "--out", "/dev/null"], "is not a regular file (a device or a pipe): the file written is read back"),
    # past the model's positions whatever the text's length (a trace recorded --context 5000 as its context)
    (["ppl", "--context", "5000", "--max-tokens", "64"], "--context 5000 is longer than the model's context of 2048"),
    (["trace", "--out", "t.ectrace", "--context", "5000", "--max-tokens", "64"], "longer than the model's context"),
])
def test_messages_name_what_the_option_takes(capsys, argv, said, tmp_path, monkeypatch):
    """A budget of 1000% was told to be >= 0; a size in T, that it was no size; --text - that there was no such
    file; trace --out /dev/null, that it was no trace file to read; a negative size, that it wanted a value."""
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's refusal of an option's value
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and said in err and err.count("\n") == 0, err


def test_a_warm_start_without_routing_counts_names_the_models_folder(capsys, ckpt):
    code, err = run_cli(capsys, "ppl", "--model", str(ckpt), "--initial", "warm", "--max-tokens", "8")
    assert code == 2 and f"run `expertcache calibrate --model {ckpt}` first" in err, err


def test_simulates_too_small_cache_names_no_option_it_lacks(capsys, tmp_path):
    trace = tmp_path / "t.ectrace"
    assert cli.main(["trace", "--out", str(trace), "--max-tokens", "64"]) == 0
    capsys.readouterr()
    code, err = run_cli(capsys, "simulate", str(trace), "--cache", "0.25", "0.01")
    assert code == 2 and "--cache 0.063" in err and "--quota global" not in err and "bytes" not in err, err


def test_missing_and_corrupt_config(capsys, ckpt):
    config = (ckpt / "config.json").read_text()
    for text in ("[]", '"qwen3_moe"'):  # valid JSON, no object: one line too, from a checkpoint or --config
        (ckpt / "config.json").write_text(text)
        expect_cli_error(capsys, ckpt, "not an object")
        assert run_cli(capsys, "info", "--config", str(ckpt / "config.json"))[0] == 2
    (ckpt / "config.json").write_text(config)
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")  # an index is read without it
    for index in ("[]", '{"weight_map": []}', '{"weight_map": {"a": 5}}'):
        (ckpt / "model.safetensors.index.json").write_text(index)
        expect_cli_error(capsys, ckpt, "not a safetensors index")
    (ckpt / "model.safetensors.index.json").unlink()
    (ckpt / "model-00001-of-00001.safetensors").rename(ckpt / "model.safetensors")
    (ckpt / "config.json").write_text("{not json")
    expect_cli_error(capsys, ckpt, "not valid JSON")
    (ckpt / "config.json").unlink()
    expect_cli_error(capsys, ckpt, "config.json is missing")


def test_corrupt_weights(capsys, ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 100)
    expect_cli_error(capsys, ckpt, "corrupt safetensors")


def test_weights_that_cannot_be_read_are_named(capsys, ckpt, monkeypatch):
    """A folder where a shard belongs, or a read the disk fails: one line naming the file (it was the bare
    "[Errno 21] Is a directory; check the path and the disk")."""
    import errno

    from expertcache.engine import tensor_file
    (ckpt / "model.safetensors").rename(ckpt / "weights")
    (ckpt / "model.safetensors").mkdir()
    expect_cli_error(capsys, ckpt, f"{ckpt / 'model.safetensors'}: cannot read (Is a directory)")
    (ckpt / "model.safetensors").rmdir()
    (ckpt / "weights").rename(ckpt / "model.safetensors")

    def failing(*a):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(tensor_file.os, "preadv", failing)
    expect_cli_error(capsys, ckpt, f"{ckpt / 'model.safetensors'}: cannot read tensor")


def test_pytorch_bin_weights_are_refused_naming_how_to_write_safetensors(capsys, ckpt):
    """A checkpoint of pytorch_model.bin only (older releases): one line naming the command that writes its
    safetensors, where "convert the checkpoint to safetensors" read as `expertcache convert`, which needs them too."""
    from safetensors.torch import load_file
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    expect_cli_error(capsys, ckpt, f"from_pretrained('{ckpt}', dtype='auto').save_pretrained('{ckpt}')")
    (ckpt / "pytorch_model.bin").unlink()
    expect_cli_error(capsys, ckpt, "no *.safetensors weights; pass --model the folder that holds")


def test_a_quantization_without_a_method_is_named_by_what_it_gives(capsys, ckpt):
    """An MLX-quantized checkpoint's quantization_config (group_size and bits, no quant_method): the refusal names
    it; it said the weights were "quantized with None"."""
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"group_size": 64, "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(config))
    expect_cli_error(capsys, ckpt, 'quantized with quantization_config {"group_size": 64, "bits": 4} cannot be read')


def test_missing_tensor(capsys, ckpt):
    from safetensors.torch import load_file, save_file
    sd = load_file(ckpt / "model.safetensors")
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, ckpt / "model.safetensors")
    expect_cli_error(capsys, ckpt, "is missing")


@pytest.mark.parametrize("family,name", [("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight"),
                                         ("gpt_oss", "model.layers.1.mlp.experts.down_proj_bias")])
def test_a_missing_expert_tensor_is_refused_at_load_not_at_its_first_fetch(tiny, tmp_path, family, name):
    """A ram store reads the experts on first use: a server opened on such a checkpoint started, then failed its
    first request."""
    from safetensors.torch import load_file, save_file
    path = tmp_path / "model"
    shutil.copytree(tiny[family][0], path)
    sd = load_file(path / "model.safetensors")
    del sd[name]
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        Engine(path, EngineConfig(store="ram"))


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.mlp.experts.3.up_proj.weight"])
def test_integer_weights_are_refused_not_read_as_numbers(capsys, ckpt, name):
    """A weight stored as integers (a corrupt export, or a quantization the engine does not read) was converted
    to float and run: another model's output. Dense or expert, it is one line naming the tensor."""
    from safetensors.torch import load_file, save_file
    sd = load_file(ckpt / "model.safetensors")
    sd[name] = (sd[name] * 100).to(torch.int32)
    save_file(sd, ckpt / "model.safetensors")
    expect_cli_error(capsys, ckpt, f"tensor '{name}' holds int32", "--store", "disk", "--store-dir",
                     str(ckpt / "store"))


def test_another_models_tokenizer_is_one_line(capsys, ckpt):
    """A tokenizer.json whose ids go beyond the model's embeddings (the built-in model's, 8,192 tokens, beside a
    96-token model) is named as such by every road text takes: the engine's verbs and the lab's."""
    from expertcache.engine.engine import BUILTIN_MODEL
    shutil.copy(BUILTIN_MODEL / "tokenizer.json", ckpt / "tokenizer.json")
    expect_cli_error(capsys, ckpt, "tokenizer.json is another model's")
    code, err = run_cli(capsys, "calibrate", "--model", str(ckpt), "--max-tokens", "64")
    assert code == 2 and "tokenizer.json is another model's" in err and err.count("\n") == 0, err


def test_unsupported_architecture(capsys, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect_cli_error(capsys, ckpt, "qwen3_moe")
    with pytest.raises(UnsupportedArchitecture, match="supported: qwen3_moe"):
        Engine(ckpt)


def test_a_releases_own_model_type_for_a_familys_architecture_loads_as_that_family(ckpt):
    """Kimi K2's config says model_type kimi_k2 and architectures DeepseekV3ForCausalLM: the architecture names
    the family where the model_type names none."""
    from expertcache.models import deepseek_v3, family_of
    assert family_of({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}) is deepseek_v3
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "my_finetune"}))
    engine = Engine(ckpt)
    assert engine.args.family == cfg["model_type"]
    engine.close()


def test_cache_too_small(capsys, ckpt):
    expect_cli_error(capsys, ckpt, "fewer than top-k=2", "--cache", "0.1")
    with pytest.raises(CacheTooSmall):
        Engine(ckpt, EngineConfig(cache=CacheConfig(fraction=0.1)))
    with pytest.raises(CacheTooSmall):
        Engine(ckpt, EngineConfig(cache=CacheConfig(bytes=1000)))


def test_the_default_cache_runs_a_model_with_few_experts(tmp_path):
    """The default size, 25% of the experts, is at least a token's top-k: a tiny model of 4 experts and top-2 runs
    without a flag (it was refused: 1 slot); a size asked for is taken as asked, and refused when too small."""
    from expertcache.engine.generate import generate
    path = tmp_path / "four"
    save_tiny("mixtral", path, num_local_experts=4, num_experts_per_tok=2)
    engine = Engine(path, EngineConfig(store="ram"))
    assert engine.cache.per_layer == 2 and len(list(generate(engine, [1, 2, 3], 3))) == 3
    engine.close()
    with pytest.raises(CacheTooSmall, match="a fraction of 0.25 gives 1 expert slot per layer"):
        Engine(path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25)))
    assert Engine(BUILTIN_MODEL, EngineConfig(store="ram")).cache.per_layer == 32  # 25% where that holds top-k


def test_unknown_names(capsys, ckpt):
    expect_cli_error(capsys, ckpt, "unknown policy 'nope'", "--policy", "nope")
    expect_cli_error(capsys, ckpt, "unknown store 'tape'", "--store", "tape")
    expect_cli_error(capsys, ckpt, "unknown eviction", "--eviction", "random")
    with pytest.raises(UnknownName):
        Engine(ckpt, EngineConfig(policy="fetch-all:tau=x"))


def test_missing_text_file(capsys, ckpt, tmp_path):
    code, err = run_cli(capsys, "ppl", "--model", str(ckpt), "--text", str(tmp_path / "none.txt"))
    assert code == 2 and "no such text file" in err
    code, err = run_cli(capsys, "ppl", "--model", str(ckpt), "--text", str(tmp_path))
    assert code == 2 and "cannot read text" in err


def test_a_text_is_scored_as_it_is(tmp_path):
    """\r\n line ends stay in the text that ppl scores (as a tokenizer or a server sees them); a leading
    byte-order mark does not."""
    from expertcache.lab.texts import read_text
    (tmp_path / "crlf.txt").write_bytes(b"ROMEO.\r\nWhat light\r\n")
    assert read_text(tmp_path / "crlf.txt") == "ROMEO.\r\nWhat light\r\n"
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfROMEO.\r\n\xef\xbb\xbf")  # a leading mark is no text
    assert read_text(tmp_path / "bom.txt") == "ROMEO.\r\n\ufeff"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-16"])
def test_a_utf16_text_is_refused_not_scored(tmp_path, encoding):
    """UTF-16 of ASCII decodes as UTF-8 with a NUL after each character: scored, it gave a perplexity of tens of
    thousands; without a byte-order mark only its NULs tell."""
    from expertcache.lab.texts import read_text
    (tmp_path / "t.txt").write_bytes("ROMEO.\nWhat light\n".encode(encoding))
    with pytest.raises(BadInput, match="UTF-16 or binary.*iconv"):
        read_text(tmp_path / "t.txt")


@pytest.mark.parametrize("segment", [{"domain": "past", "start_char": 10, "chars": 30},
                                     {"domain": "negative", "start_char": -1, "chars": 5},
                                     {"domain": "empty", "start_char": 0, "chars": 0}])
def test_a_segment_outside_its_text_is_refused(tmp_path, segment):
    """A segments file whose segment lies past its text gave an empty domain, scored as nothing."""
    import json
    from expertcache.lab.texts import domain_texts
    (tmp_path / "t.txt").write_text("ROMEO.\nWhat light\n")  # 18 characters
    (tmp_path / "t.json").write_text(json.dumps({"segments": [{"domain": "a", "start_char": 0, "chars": 6}, segment]}))
    with pytest.raises(BadInput, match=f"segment '{segment['domain']}'.*not inside the 18 characters"):
        domain_texts(tmp_path / "t.txt")
    (tmp_path / "t.json").write_text(json.dumps({"segments": []}))
    with pytest.raises(BadInput, match="lists no segments"):
        domain_texts(tmp_path / "t.txt")
    (tmp_path / "t.json").write_text(json.dumps({"segments": [{"domain": "a", "start_char": "x", "chars": 6}]}))
    with pytest.raises(BadInput, match="not a segments file .*give --domains"):
        domain_texts(tmp_path / "t.txt")
    # another file beside the text is not its segments: one domain, as without it (a `ppl --json` of it, a
    # transcript's segments, JSON Lines)
    for other in (json.dumps({"text": "t.txt", "ppl": 9.1}), json.dumps({"segments": [{"id": 0, "start": 0.0}]}),
                  '{"a": 1}\n{"b": 2}\n'):
        (tmp_path / "t.json").write_text(other)
        assert domain_texts(tmp_path / "t.txt") == [("t", "ROMEO.\nWhat light\n")]


def test_bad_input_is_typed_and_programming_errors_are_not_bad_input(capsys, ckpt, monkeypatch, tmp_path):
    code, err = run_cli(capsys, "generate", "--store", "ram", "--max-seq", "8", "-n", "16", "ROMEO.")
    assert code == 2 and "exceed --max-seq 8" in err and err.count("\n") == 0, err
    with pytest.raises(BadInput, match="at least 2 tokens"):
        perplexity(Engine(ckpt), [1])
    with pytest.raises(BadInput, match="--context 16 is longer than --max-seq 8; lower --context"):
        perplexity(Engine(ckpt, EngineConfig(max_seq=8)), list(range(20)), context=16)
    from expertcache.lab.trace import record_trace
    with pytest.raises(BadInput, match="--context 2100 is longer than the model's context of 2048 positions"):
        record_trace(ckpt, [0] * 2100, tmp_path / "t.ectrace", context=2100)  # was recorded past the positions
    from expertcache.commands import info

    def broken(a):
        raise ValueError("a bug, not bad input")
    monkeypatch.setattr(info, "run", broken)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["info"])


def test_ctrl_c_ends_quietly_also_while_the_verbs_load(capsys, monkeypatch):
    """The command line imports nothing heavy before `main` runs (an interrupt there would print torch's
    import traceback), and an interrupt inside main, the verbs' imports included, exits 130 in silence."""
    import subprocess
    import sys
    probe = "import sys, expertcache.cli; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert run_cli(capsys, "info") == (130, "")


def test_a_closed_stdin_or_stderr_reads_and_writes_as_dev_null(capsys, monkeypatch, tmp_path):
    """With fd 0 or 2 closed (`<&-`, `2>&-`) Python's stream is None: generate without a prompt ended in an
    AttributeError's traceback, its statistics were printed to stdout among the text, and convert failed in its
    progress bar with exit code 1 and no store."""
    def closed(name, *argv):
        monkeypatch.setattr(f"sys.{name}", None)
        try:
            return cli.main(list(argv))
        finally:
            if getattr(sys, name) is not None:  # the stand-in, open until the process exits
                getattr(sys, name).close()
            monkeypatch.setattr(f"sys.{name}", None)
    generate = ["generate", "--store", "ram", "-n", "2"]
    assert closed("stdin", *generate) == 0  # nothing piped: the default prompt
    assert closed("stdin", *generate, "-") == 2  # stdin asked for, and empty
    monkeypatch.undo()
    assert closed("stderr", *generate, "-p", "ROMEO.") == 0
    assert "hit rate" not in capsys.readouterr().out
    assert closed("stderr", "convert", "--out", str(tmp_path / "store")) == 0
    assert (tmp_path / "store" / "experts.json").exists()


def test_a_closed_stdout_is_refused_before_the_run(capsys, monkeypatch):
    """With fd 1 closed (`expertcache generate >&-`) Python's stdout is None: generate ended in an AttributeError's
    traceback after the whole generation, and ppl's result was printed nowhere with exit code 0."""
    monkeypatch.setattr("sys.stdout", None)
    for argv in (["generate", "--store", "ram", "-n", "2", "-p", "ROMEO."], ["ppl", "--store", "ram", "--max-tokens",
                                                                            "64", "--context", "32"]):
        code, err = run_cli(capsys, *argv)
        assert code == 2 and err == "expertcache: error: stdout is closed; run with stdout open (`> FILE`, or " \
                                    "`> /dev/null` to discard it)", err


def test_os_errors_are_one_line(capsys, ckpt, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EXPERTCACHE_HOME", str(home))
    expect_cli_error(capsys, ckpt, f"EXPERTCACHE_HOME='{home}' cannot be made", "--store", "disk")  # before the run
    monkeypatch.delenv("EXPERTCACHE_HOME")
    under_a_file = ("--store", "disk", "--store-dir", str(home / "store"))
    expect_cli_error(capsys, ckpt, "Not a directory", *under_a_file)
    expect_cli_error(capsys, ckpt, "give a folder that can be written (--store-dir or --out; store_dir in Python)",
                     *under_a_file)
    store = tmp_path / "store"
    store.mkdir()
    (store / "experts.bin.partial").symlink_to("/dev/full")  # every write: no space left on device
    code, err = run_cli(capsys, "convert", "--model", str(ckpt), "--out", str(store))
    assert code == 2 and err.count("\n") == 0 and "No space left on device" in err and "free disk space" in err and \
        f"'{store}'" in err, err  # where to free it: a full disk's error names no file


def test_a_full_disk_under_the_output_and_too_many_open_files_name_their_own_fix(capsys, monkeypatch):
    """A write that fails on a full disk names no file: `info > /dev/full` and `--json` on a full disk were told to
    choose another store folder (the fix of a store's write). The JSON's path is named now, and stdout among the
    places a run writes; a process out of file descriptors was told to check the path and the disk."""
    import errno

    from expertcache.cli import os_error_fix
    code, err = run_cli(capsys, "info", "--json", "/dev/full")
    assert code == 2 and err.strip() == "expertcache: error: cannot write /dev/full (No space left on device); free " \
        "space there, or give another path", err
    full = os_error_fix(OSError(errno.ENOSPC, "No space left on device"), {"--json"})
    assert "its output (stdout), its --json file" in full and "store" in full
    assert "ulimit -n" in os_error_fix(OSError(errno.EMFILE, "Too many open files", "/x/numpy/__init__.py"))


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["--version"]])
def test_help_that_cannot_be_written_fails_in_one_line(argv):
    """`expertcache --help > /dev/full` exited 0 with nothing written: argparse drops a failed write. It fails as
    a verb's write to a full stdout does, in one line and exit code 2."""
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "expertcache", *argv], stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("expertcache: error: ") and "No space left on device" in out.stderr
    shown = subprocess.run([sys.executable, "-m", "expertcache", *argv], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout and not shown.stderr


def test_a_map_the_system_refuses_is_out_of_memory_not_a_path_to_check(capsys):
    """An anonymous map refused (ENOMEM: the slots' region past ulimit -v) was reported as "check the path and the
    disk"; it is out of memory, with the memory fixes."""
    import errno

    from expertcache.cli import reported
    assert reported(OSError(errno.ENOMEM, "Cannot allocate memory"), "expertcache", {"--cache"}) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("expertcache: error: out of memory; give the run less: a smaller --cache"), err


@pytest.mark.parametrize("key,value,words", [("num_experts_per_tok", 0, "whole number >= 1"),
                                             ("num_experts_per_tok", "two", "whole number >= 1"),
                                             ("num_experts_per_tok", 100, "experts of only"),
                                             ("num_hidden_layers", 0, "whole number >= 1"),
                                             ("num_key_value_heads", 3, "that divides them"),
                                             ("max_position_embeddings", None, "whole number >= 1"),
                                             ("hidden_act", "gelu", "supported: silu"),
                                             # a truth value as a string or number: "false" renormalised the top-k
                                             ("norm_topk_prob", "false", "norm_topk_prob 'false'; each must be "
                                                                         "true or false (a JSON boolean"),
                                             ("use_sliding_window", "false", "use_sliding_window 'false'"),
                                             ("tie_word_embeddings", 0, "tie_word_embeddings 0; each must be"),
                                             # an id that can never be sampled let every generation run to its end
                                             ("eos_token_id", "2", "eos_token_id '2' must be a token id in [0, "),
                                             ("eos_token_id", [1, 99999], "eos_token_id [1, 99999] must be"),
                                             ("eos_token_id", True, "eos_token_id True must be")])
def test_impossible_config_values_are_one_line(capsys, ckpt, key, value, words):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect_cli_error(capsys, ckpt, words)


def test_an_end_of_turn_id_outside_the_vocabulary_is_refused_at_open(capsys, ckpt):
    """generation_config.json's eos_token_id list (where releases give their end-of-turn ids) is read as
    config.json's: an id outside the vocabulary, left out in silence, ran every reply to its max_tokens."""
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, -1]}))
    expect_cli_error(capsys, ckpt, "generation_config.json: eos_token_id [0, -1] must be a token id in [0, ")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    assert Engine(ckpt, EngineConfig(store="ram")).checkpoint.eos_token_ids(96) == {0, 1}


@pytest.mark.parametrize("family,key,value,words", [
    ("qwen3_moe", "num_key_value_heads", 1, "does not belong to these weights"),  # divides, but not wk's rows
    ("deepseek_v3", "kv_lora_rank", 3, "does not belong to these weights"),
    ("deepseek_v3", "qk_rope_head_dim", 0, "whole number >= 1"),
    ("deepseek_v3", "qk_nope_head_dim", -1, "whole number >= 0"),
    ("deepseek_v3", "v_head_dim", 3, "does not belong to these weights"),
    ("deepseek_v2", "num_attention_heads", 3, "does not belong to these weights"),
    ("deepseek_v2", "rms_norm_eps", -1, "must be a number >= 0"),
    ("deepseek_v2", "rms_norm_eps", "1e-6", "must be a number >= 0"),
    ("qwen3_next", "linear_key_head_dim", 3, "does not belong to these weights"),
    ("qwen3_next", "linear_num_key_heads", 3, "do not divide them"),
    ("deepseek_v3", "n_group", 3, "groups must divide the experts"),
    ("glm4_moe", "n_group", -1, "groups must divide the experts"),
    ("deepseek_v2", "mlp_bias", True, "mlp_bias true"),
    ("mixtral", "sliding_window", 0, "sliding_window 0"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "'llama3' is not"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "needs a factor > 0 and"),
    ("qwen3_moe", "rope_parameters", ["yarn"], "rope_parameters is a JSON list, not an object"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "default", "rope_theta": 0}, "rope_theta 0.0; it must be"),
    ("mixtral", "rope_parameters", {"rope_type": "default", "rope_theta": float("nan")}, "rope_theta nan"),
    ("glm4_moe", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2.0},
     "partial_rotary_factor 2.0"),
    ("olmoe", "clip_qkv", "3", "clip_qkv '3'"),
    ("gpt_oss", "layer_types", ["full_attention", "global"], "layer_types 'global'"),
    # values that ran silently to another model's output: no group allowed read as one, a scaling or a clamp below
    # zero, a MoE step of 0 (HF divides by it), weights of layers past the config's left unread
    ("deepseek_v3", "topk_group", 0, "groups must divide the experts"),
    ("deepseek_v3", "routed_scaling_factor", -1, "routed_scaling_factor -1.0; it must be a finite number > 0"),
    ("gpt_oss", "swiglu_limit", -1, "swiglu_limit -1.0; it must be"),
    ("qwen3_moe", "decoder_sparse_step", 0, "decoder_sparse_step 0"),
    ("qwen3_moe", "num_hidden_layers", 1, "the weights hold decoder layers up to 1, config.json gives "
                                          "num_hidden_layers 1"),
    ("qwen3_moe", "vocab_size", 10**12, "more than 16,777,216")])
def test_config_dimensions_that_do_not_fit_the_weights_or_each_other_are_one_line(capsys, tiny, tmp_path, family, key,
                                                                               value, words):
    """Each attention dimension of a config is checked against its tensors at load, and the router's groups against
    its experts: a wrong one crashed inside the first forward's reshapes (MLA's latent and head dimensions, a GQA's
    key-value heads, a DeltaNet's) or the router's grouping. Settings the engine does not compute (a RoPE scaling
    of another kind, MLP biases) or cannot (a zero window, a YaRN without its original length) are refused too, and
    values that failed in the first forward with a traceback (RoPE parameters that are no object, a rotary share past
    1, a string clip_qkv) or ran it to non-finite logits blamed on the weights (rope_theta 0 or NaN)."""
    path = tmp_path / "model"
    shutil.copytree(tiny[family][0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))
    expect_cli_error(capsys, path, words)



def test_damaged_checkpoint_files_are_named_in_one_line(capsys, ckpt):
    """A config found by its architecture (no model_type) and lacking a key failed in a KeyError's traceback; one
    without num_experts named num_local_experts, which Qwen releases do not use. A tokenizer_config.json whose
    eos_token is no text was a TypeError's traceback; a config.json not UTF-8 named no file; an integer of thousands
    of digits was a ValueError's traceback. Two tensors sharing bytes (one read as the other, a silent wrong model)
    are refused, as safetensors refuses them."""
    import struct
    config = json.loads((ckpt / "config.json").read_text())
    for edit, words in ((lambda c: {k: v for k, v in c.items() if k not in ("model_type", "hidden_size")},
                         "lacks 'hidden_size' required by qwen3_moe"),
                        (lambda c: {k: v for k, v in c.items() if k not in ("num_experts", "num_local_experts")},
                         "lacks 'num_experts' required by qwen3_moe")):
        (ckpt / "config.json").write_text(json.dumps(edit(config)))
        expect_cli_error(capsys, ckpt, words)
    (ckpt / "config.json").write_bytes(b"\xb0\xff" * 50)
    expect_cli_error(capsys, ckpt, "config.json is not valid JSON")
    (ckpt / "config.json").write_text(json.dumps(config).replace('"hidden_size": 32', '"hidden_size": 1' + "0" * 5000))
    expect_cli_error(capsys, ckpt, "config.json is not valid JSON")
    (ckpt / "config.json").write_text(json.dumps(config))
    tokenizer = ckpt / "tokenizer_config.json"
    saved = json.loads(tokenizer.read_text()) if tokenizer.exists() else {}
    tokenizer.write_text(json.dumps({**saved, "eos_token": ["<eos>"]}))
    from expertcache.engine.generate import eos_token_ids
    engine = Engine(ckpt, EngineConfig(store="ram"))
    with pytest.raises(CheckpointError, match=r"eos_token is \['<eos>'\], not a token's text"):
        eos_token_ids(engine)  # as every generation reads them
    engine.close()
    tokenizer.write_text(json.dumps(saved))
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k.endswith(("experts.0.up_proj.weight", "experts.1.up_proj.weight")))
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    weights.write_bytes(struct.pack("<Q", n) + text.ljust(n) + data[8 + n:])
    expect_cli_error(capsys, ckpt, "share bytes")


def test_a_forward_past_the_positions_the_cache_holds_is_refused():
    """A forward at position 100 of an engine whose cache held none attended to keys no forward wrote (zeros, or a
    run's before), a silent wrong answer; it is refused, naming the position to run next."""
    engine = Engine(None, EngineConfig(store="ram"))
    with pytest.raises(BadInput, match="the KV cache holds the first 0 positions; run position 0 next"):
        engine.forward(torch.tensor([5]), 100)
    engine.forward(torch.tensor([5, 6, 7]), 0)
    with pytest.raises(BadInput, match="holds the first 3 positions"):
        engine.forward(torch.tensor([5]), 4)
    engine.forward(torch.tensor([8]), 3)  # the next, and one before it, rewriting from there
    engine.forward(torch.tensor([9]), 1)
    engine.close()


def test_odd_values_of_the_python_api_are_named_or_taken():
    """A Fraction temperature passed the checks and failed in the sampler's tensor arithmetic; ids on the meta device
    failed in torch's .item(); a template's raise_exception said its words alone, not that the template refused."""
    from fractions import Fraction

    from expertcache.engine.chat import ChatTemplate, ChatTemplateError
    from expertcache.engine.sampling import SamplingParams
    assert SamplingParams(temperature=Fraction(1, 2)).temperature == 0.5
    engine = Engine(None, EngineConfig(store="ram"))
    with pytest.raises(BadInput, match="meta device hold no values"):
        engine.forward(torch.tensor([1, 2], device="meta"), 0)
    engine.close()
    template = ChatTemplate("{{ raise_exception('Only user roles supported') }}")
    with pytest.raises(ChatTemplateError, match="^the chat template refused these messages: Only user roles"):
        template.render([{"role": "system", "content": "x"}])


def test_the_built_in_models_predictor_files_carry_their_checksums(tmp_path, capsys):
    """The shipped estimator, lookahead and default vectors were written before checksums were: a flipped byte in
    them changed the predictions, and a speculative run's text, without a word."""
    from safetensors import safe_open

    from expertcache.engine.tensor_file import CHECKSUM
    for name in ("estimator.safetensors", "lookahead.safetensors", "default_vectors.safetensors"):
        with safe_open(str(BUILTIN_MODEL / name), "pt") as f:
            assert CHECKSUM in (f.metadata() or {}), name
    model = tmp_path / "m"
    shutil.copytree(BUILTIN_MODEL, model)
    estimator = model / "estimator.safetensors"
    data = bytearray(estimator.read_bytes())
    data[2_000_000] ^= 0xFF
    estimator.write_bytes(bytes(data))
    code, err = run_cli(capsys, "generate", "--model", str(model), "-n", "2", "--store", "ram", "-p", "a",
                        "--policy", "fetch-all+speculative/estimator")
    assert code == 2 and "do not match the checksum" in err, err


def test_a_config_of_another_number_of_experts_is_named_before_the_files_beside_it(capsys, tmp_path):
    """A config.json giving fewer experts than the weights route: `info` reported the config's figures as the
    model's, and a run blamed routing_counts.json beside it; both now name the router that does not fit. A number
    of experts no model has (10^9) is refused before a name is made for each (they ate the memory)."""
    from expertcache.engine.engine import BUILTIN_MODEL
    path = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL, path)
    cfg = json.loads((path / "config.json").read_text())
    assert (path / "routing_counts.json").exists() and cfg["num_experts"] == 128
    (path / "config.json").write_text(json.dumps({**cfg, "num_experts": 64}))
    words = "tensor model.layers.0.mlp.gate.weight has shape (128, 160), config.json implies (64, 160)"
    expect_cli_error(capsys, path, words)
    code, err = run_cli(capsys, "info", "--model", str(path))
    assert code == 2 and err.count("\n") == 0 and words in err and "does not belong to these weights" in err, err
    (path / "config.json").write_text(json.dumps({**cfg, "num_experts": 10**9}))
    code, err = run_cli(capsys, "info", "--model", str(path))
    assert code == 2 and err.count("\n") == 0 and "gives 1,000,000,000 experts per layer, more than 65,536" in err


def test_a_text_from_a_device_or_an_endless_pipe_is_refused_before_the_memory_runs_out(capsys, ckpt, tmp_path,
                                                                                       monkeypatch):
    """`ppl --text /dev/zero` read the device until the kernel killed the process (22 GB): a text is read in parts,
    refused at its first NUL, and past MAX_TEXT_BYTES (1 GiB; lowered here) refused as endless."""
    from expertcache.lab import texts
    expect_cli_error(capsys, ckpt, "/dev/zero is UTF-16 or binary", "--text", "/dev/zero")
    monkeypatch.setattr(texts, "MAX_TEXT_BYTES", 2**20)
    long = tmp_path / "long.txt"
    long.write_text("to be or not to be\n" * 2**17)  # 2.4 MiB, read 16 MiB at a time
    expect_cli_error(capsys, ckpt, "long.txt goes on past", "--text", str(long))

@pytest.mark.parametrize("family,over", [("mixtral", dict(hidden_size=100)), ("deepseek_v3", dict(qk_rope_head_dim=3))])
def test_an_odd_number_of_rotary_channels_is_refused_at_load(tmp_path, family, over):
    """A checkpoint whose weights fit its config but whose heads rotate an odd number of channels (hidden_size 100
    over 4 heads, MLA's rope part): RoPE turns pairs, so HF's forward fails on it, and the engine's failed inside its
    first forward with a traceback. (An odd partial rotary, GLM-4.5's head_dim 6 x 0.5, runs as HF's: rounded up.)"""
    save_tiny(family, tmp_path, **over)
    with pytest.raises(CheckpointError, match="an odd number of rotary channels per head"):
        Engine(tmp_path, EngineConfig(store="ram")).forward(torch.arange(4), 0)


def test_a_missing_tokenizer_names_how_to_make_one(capsys, ckpt):
    """Text input without tokenizer.json: one line naming the fix; from the SentencePiece tokenizer.model where
    the release has one in its place (ERNIE 4.5's)."""
    expect_cli_error(capsys, ckpt, "put the model's own tokenizer.json")
    (ckpt / "tokenizer.model").write_bytes(b"\x00")
    expect_cli_error(capsys, ckpt, "write one from its tokenizer.model")


def test_unreadable_side_files_are_one_line(capsys, ckpt):
    """A garbage tokenizer, a routing-counts file without its table, one expert of another shape."""
    from safetensors.torch import load_file, save_file
    (ckpt / "tokenizer.json").write_text("not a tokenizer")
    expect_cli_error(capsys, ckpt, "not a readable tokenizer")
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "routing_counts.json").write_text(json.dumps({"rows": []}))
    expect_cli_error(capsys, ckpt, "not a routing-counts file")
    (ckpt / "routing_counts.json").unlink()
    sd = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.up_proj.weight"  # the first of its group: named, not its neighbour
    sd[name] = sd[name][:-1].clone()
    save_file(sd, ckpt / "model.safetensors")
    expect_cli_error(capsys, ckpt, f"tensor {name} has shape")


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.o_proj.weight",
                                  "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.k_norm.weight",
                                  "model.norm.weight", "lm_head.weight"])
def test_a_dense_tensor_of_another_shape_in_any_layer_is_refused_at_load(ckpt, name):
    """Only the first layer's dense tensors were checked: a later layer's of another shape failed inside the first
    forward with a traceback, or (a router of more experts) crashed the process in the compiled kernels."""
    from safetensors.torch import load_file, save_file
    sd = load_file(ckpt / "model.safetensors")
    sd[name] = torch.cat([sd[name], sd[name][:1]])
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \({sd[name].shape[0]},.*config.json implies"):
        Engine(ckpt)


def test_bad_cli_values_are_one_line(capsys, ckpt, tmp_path):
    """An unknown device, a prompt that is not UTF-8, two prompts, a port out of range, an infinite
    temperature, an output folder under a file: one line each, before any work."""
    for argv, words in ((["generate", "--model", str(ckpt), "--device", "tpu", "hi"], "unknown device 'tpu'"),
                        (["generate", "--model", str(ckpt), "--device", "mps", "hi"], "unknown device 'mps'"),
                        (["generate", "--model", str(ckpt), "--device", "cpu:5", "hi"], "unknown device 'cpu:5'"),
                        (["generate", "--model", str(ckpt), "--max-seq", "1000000000", "hi"], "outside the model's"),
                        (["predict", "--model", str(ckpt), "--predictors"], "expected at least one argument"),
                        (["ppl", "--model", str(ckpt), "--store", "ram", "--read-mode", "direct"],
                         "--read-mode direct is how the disk store reads"),
                        (["tune", "--model", str(ckpt), "--cache-bytes", "lots"], "is not a size"),
                        (["generate", "--store", "ram", "caf\udce9"], "not UTF-8 text"),  # bytes not UTF-8
                        (["generate", "--model", str(ckpt), "-p", "a", "b"], "two prompts"),
                        (["generate", "--model", str(ckpt), "--temperature", "inf", "hi"], "--temperature inf"),
                        (["serve", "--model", str(ckpt), "--port", "70000"], "not a port"),
                        (["serve", "--model", str(ckpt), "--read-timeout", "0"], "give seconds in (0, 86400]"),
                        (["ppl", "--model", str(ckpt), "--json", str(ckpt / "config.json" / "x.json")],
                         "is a file; give a folder"),
                        (["convert", "--model", str(ckpt), "--dtype", "int4", "--group-size", "1"], "multiple of 8"),
                        (["chat", "--model", str(ckpt), "--max-tokens", "16"],  # the verb's own help is named
                         "unrecognized arguments: --max-tokens 16 (did you mean --max-new-tokens?); see "
                         "`expertcache chat --help`"),
                        (["study", "--model", str(ckpt), "--tokens-per-domain", "256", "--out", str(tmp_path / "s")],
                         "holds no window of --context 512")):
        try:
            code, err = run_cli(capsys, *argv)
        except SystemExit as e:  # argparse's own check of the value
            code, err = e.code, capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and err.count("\n") == 0 and words in err, (argv, err)


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot write into: read-only by its mode, or for root (whom modes do not stop) a
    read-only tmpfs mounted on it."""
    import subprocess
    path = tmp_path / "unwritable"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield path
    subprocess.run(["umount", str(path)])


def test_plots_without_matplotlib_are_refused_before_the_run(capsys, ckpt, tmp_path, monkeypatch):
    """Where matplotlib is not installed (the plain install leaves it out), a verb that would plot ends in one line
    naming the extra to install, before its run: not with a traceback once the run is done."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails; find_spec finds none
    png = str(tmp_path / "x.png")
    for argv in (["predict", "--model", str(ckpt), "--plot", png], ["study", "--model", str(ckpt), "--out",
                                                                   str(tmp_path / "s")]):
        try:
            code, err = run_cli(capsys, *argv)
        except SystemExit as e:  # argparse's own check of the value
            code, err = e.code, capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and err.count("\n") == 0 and "pip install 'expertcache[study]'" in err, (argv, err)
        assert not (tmp_path / "s").exists()


def test_a_plot_path_without_an_image_suffix_is_refused_before_the_run(capsys, tmp_path):
    """--plot's format is its suffix: an unknown one ended in matplotlib's traceback after the run, and none at all
    wrote NAME.png beside the path given; both are one line before any work."""
    for verb in (["simulate", str(tmp_path / "none.ectrace")], ["tune"], ["predict"]):
        for name in ("frontier.xyz", "frontier"):
            with pytest.raises(SystemExit) as e:
                cli.main([*verb, "--plot", str(tmp_path / name)])
            err = capsys.readouterr().err.strip()
            assert e.value.code == 2 and err.count("\n") == 0 and "ending in .png" in err, (verb, name, err)
    assert not list(tmp_path.iterdir())


def test_a_predictors_missing_file_is_named_before_the_text_is_recorded(capsys, tmp_path, monkeypatch):
    """predict --train needs calibrate's default vectors, and predict and tune's prediction runs need the trained
    nets: a missing one is named with the command that writes it before the text's states are recorded (at real
    scale, minutes in)."""
    from expertcache.lab import prediction
    ckpt = tmp_path / "model"  # the built-in model's weights and tokenizer, none of its predictors' files
    shutil.copytree(BUILTIN_MODEL, ckpt, ignore=shutil.ignore_patterns("default_vectors.*", "estimator.*",
                                                                       "lookahead.*"))

    def recorded(*a, **k):
        raise AssertionError("the text was recorded first")
    monkeypatch.setattr(prediction, "record_states", recorded)
    for argv, words in ((["predict", "--train"], "expertcache calibrate --model"),
                        (["predict", "--predictors", "quasi-hidden"], "expertcache calibrate --model")):
        code, err = run_cli(capsys, *argv, "--model", str(ckpt), "--max-tokens", "64")
        assert code == 2 and err.count("\n") == 0 and "default_vectors.safetensors is missing" in err and words in err
    assert cli.main(["calibrate", "--model", str(ckpt), "--max-tokens", "64"]) == 0
    capsys.readouterr()
    for name in ("estimator", "lookahead"):
        code, err = run_cli(capsys, "predict", "--predictors", name, "--model", str(ckpt), "--max-tokens", "64")
        assert code == 2 and err.count("\n") == 0 and "is missing" in err and "predict --train" in err, err


def test_outputs_that_cannot_be_written_are_refused_before_the_run(capsys, ckpt, unwritable):
    """A --json file or an --out folder that cannot be written (permission, a read-only filesystem) is refused in
    one line before any work, not found when the run ends and its results are written."""
    for argv, words in ((["ppl", "--model", str(ckpt), "--json", str(unwritable / "x.json")], "cannot be written"),
                        (["study", "--model", str(ckpt), "--out", str(unwritable / "study")], "cannot be made"),
                        # where permissions let root write but the filesystem makes no file (os.access said yes)
                        *((["trace", "--model", str(ckpt), "--out", "/proc/ec.npz"], "cannot be written"),
                          (["convert", "--model", str(ckpt), "--out", "/proc/ec"], "cannot be made"))[
                            :2 * os.path.isdir("/proc/self")]):
        with pytest.raises(SystemExit) as e:
            run_cli(capsys, *argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and words in err, (argv, err)


@pytest.fixture
def read_only_model(tmp_path):
    """The built-in model as a folder of links to its files that this process cannot write into: read-only by its
    mode, or for root (whom modes do not stop) a read-only bind mount of it."""
    import subprocess
    path = tmp_path / "read_only"
    path.mkdir()
    for f in BUILTIN_MODEL.iterdir():
        (path / f.name).symlink_to(f)
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "--bind", str(path), str(path)]).returncode:
        pytest.skip("cannot bind-mount here")
    if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)]).returncode == 0:
        yield path
    subprocess.run(["umount", str(path)])


def test_verbs_that_write_beside_the_weights_refuse_a_read_only_checkpoint_first(capsys, read_only_model,
                                                                                 monkeypatch):
    """calibrate and predict --train write beside the weights: a checkpoint folder they cannot write (a read-only
    mount, another user's) is refused before the work, naming what to do, not when its results are written
    (minutes in at real size) with a fix naming flags they do not have."""
    from expertcache.lab import calibrate, prediction

    def work(*a, **k):
        raise AssertionError("the work ran first")
    monkeypatch.setattr(calibrate, "run_exact", work)
    monkeypatch.setattr(prediction, "record_states", work)
    for argv, files in ((["calibrate"], "routing_counts.json"), (["predict", "--train"], "estimator.safetensors")):
        code, err = run_cli(capsys, *argv, "--model", str(read_only_model), "--max-tokens", "64")
        assert code == 2 and err.count("\n") == 0 and "cannot be written" in err and files in err, err
        assert "ln -s" in err and "--store-dir" not in err, err



def test_verbs_that_write_beside_the_weights_take_no_default_model(capsys, monkeypatch):
    """`calibrate` and `predict --train` without --model rewrote the built-in model's shipped files (a newcomer's
    first try changed the package): refused before any work, naming a copy to give instead."""
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.lab import calibrate, prediction

    def work(*a, **k):
        raise AssertionError("the work ran first")
    monkeypatch.setattr(calibrate, "run_exact", work)
    monkeypatch.setattr(prediction, "record_states", work)
    before = {f.name: f.stat().st_mtime_ns for f in BUILTIN_MODEL.iterdir()}
    for argv, files in ((["calibrate"], "routing_counts.json"), (["predict", "--train"], "lookahead.safetensors")):
        code, err = run_cli(capsys, *argv, "--max-tokens", "64")
        assert code == 2 and err.count("\n") == 0 and files in err and "without --model" in err, err
        assert f"cp -r {BUILTIN_MODEL} build/model" in err, err
    assert {f.name: f.stat().st_mtime_ns for f in BUILTIN_MODEL.iterdir()} == before


def test_a_text_too_short_to_fit_from_is_refused_before_the_models_files_change(tmp_path, capsys):
    """`predict --train` on a 5-token text reported a recall of 100% for every predictor (on those 5 tokens) and
    replaced the model's predictors with what it learned from one sentence; `calibrate` wrote default vectors of
    the few experts 5 tokens route to. Both are refused in one line, the files as they were."""
    from expertcache.lab.calibrate import MIN_FIT_TOKENS, calibrate
    from expertcache.lab.prediction import fit_estimator
    model = tmp_path / "m"
    shutil.copytree(BUILTIN_MODEL, model)
    text = tmp_path / "short.txt"
    text.write_text("hello world. ")
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    for verb in (["calibrate"], ["predict", "--train"]):
        code, err = run_cli(capsys, *verb, "--model", str(model), "--text", str(text))
        assert code == 2 and err.count("\n") == 0 and f"at least {MIN_FIT_TOKENS} tokens" in err, err
        assert "the text gave 5" in err and "longer --text" in err, err
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before
    for fit in (calibrate, fit_estimator):  # the Python API's road
        with pytest.raises(BadInput, match=f"at least {MIN_FIT_TOKENS} tokens"):
            fit(model, list(range(MIN_FIT_TOKENS - 1)))
    text.write_text("ha " * 2000)  # long enough, but a few tokens repeated: nets fit to it replaced the model's
    for verb in (["calibrate"], ["predict", "--train"]):
        code, err = run_cli(capsys, *verb, "--model", str(model), "--text", str(text))
        assert code == 2 and err.count("\n") == 0 and "distinct ones repeated" in err, err
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before


def test_token_ids_outside_the_vocabulary_are_refused_by_the_engine(ckpt):
    """The Python API's road: Engine.forward and generate refuse an id outside the vocabulary in one line. A
    negative one indexed the embeddings from their end (another token's output); one past them was an IndexError
    inside the forward. A stop token outside it, which could never end the output, is refused too, and so is a
    logit bias on a token that does not exist."""
    from expertcache import generate
    engine = Engine(ckpt, EngineConfig(store="ram"))
    for ids in ([-1], [3, 96], [10**6]):
        with pytest.raises(BadInput, match="outside the model's vocabulary"):
            engine.forward(torch.tensor(ids), 0)
    with pytest.raises(BadInput, match="outside the model's vocabulary"):
        list(generate(engine, [5, -2], 2))
    for stop in ("x", 1.0, 96, -1):  # a stop never met: the generation ran on as though none was given
        with pytest.raises(BadInput, match="stop"):
            list(generate(engine, [5, 2], 2, stop=stop))
    from expertcache.engine.generate import TextGeneration
    from expertcache.engine.sampling import SamplingParams
    with pytest.raises(BadInput, match=r"stop_token_ids \[96\] must be token ids in \[0, 96\)"):
        TextGeneration(engine, [1, 2], SamplingParams(max_tokens=2, stop_token_ids=(96,)))
    with pytest.raises(BadInput, match=r"logit_bias names token 96; token ids are in \[0, 96\)"):
        TextGeneration(engine, [1, 2], SamplingParams(max_tokens=2, logit_bias=((5, 1.0), (96, -100.0))))
    with pytest.raises(BadInput, match="1-D integer tensor"):
        engine.forward(torch.tensor([1.0, 2.0]), 0)
    with pytest.raises(BadInput, match="position -1 is negative"):
        engine.forward(torch.tensor([1, 2]), -1)
    assert engine.forward(torch.tensor([0, 95]), 0).shape[0] == 2  # the vocabulary's ends are ids
    engine.close()


def test_token_ids_of_any_form_are_checked_once_on_every_road(ckpt):
    """Token ids as a list, an array or a tensor are taken by forward, generate, perplexity and decode; anything
    else is one BadInput naming it. A prompt as an array or a tensor failed on its truth value, text or None with a
    TypeError; float ids were truncated (1.5 scored as 1); uint8 ids indexed the embeddings as a mask; perplexity's
    last id, a target only, reached cross_entropy unchecked (an IndexError); a float position failed inside RoPE;
    an array of uint16, uint32 or uint64 ids in torch's min (a NotImplementedError)."""
    import numpy as np
    from expertcache import generate
    engine = Engine(ckpt, EngineConfig(store="ram"))
    ids = [5, 17, 3, 40]
    want = list(generate(engine, ids, 2))
    for form in (np.array(ids), torch.tensor(ids), tuple(np.int64(i) for i in ids)):
        assert list(generate(engine, form, 2)) == want
    assert torch.equal(engine.forward(torch.tensor(ids, dtype=torch.uint8), 0), engine.forward(torch.tensor(ids), 0))
    for dtype in (np.uint16, np.uint32, np.uint64):  # torch has no min or max of them: a NotImplementedError
        assert list(generate(engine, np.array(ids, dtype=dtype), 2)) == want
        with pytest.raises(BadInput, match="outside the model's vocabulary"):
            perplexity(engine, np.array([1, 2, 96 if dtype != np.uint64 else 2**64 - 1], dtype=dtype))
    assert engine.decode(torch.tensor(ids)) == engine.decode(ids)
    ppl = perplexity(engine, ids, context=2).ppl
    for bad, words in [("ROMEO.", "Engine.encode"), (None, "Engine.encode"), ([1.5, 2.0, 3.0], "integer tensor"),
                       ([[1, 2], [3, 4]], "1-D integer"), ([1, 2, 96], "token id 96 is outside"),
                       ([1, 2, -1], "token id -1 is outside")]:
        with pytest.raises(BadInput, match=words):
            perplexity(engine, bad)
        with pytest.raises(BadInput, match=words):
            list(generate(engine, bad, 2))
    with pytest.raises(BadInput, match="token id -1"):
        engine.decode([-1])
    for pos in (1.5, "1", None):
        with pytest.raises(BadInput, match="position"):
            engine.forward(torch.tensor(ids), pos)
    for context in (2.5, "2", None, float("inf")):
        with pytest.raises(BadInput, match="context"):
            perplexity(engine, ids, context=context)
    with pytest.raises(BadInput, match="progress=1 must be a function"):  # a TypeError after the first window
        perplexity(engine, ids, context=2, progress=1)
    for text in (None, b"ROMEO.", 5):
        with pytest.raises(BadInput, match="encode takes text"):
            engine.encode(text)
    for n in (-1, 1.5):  # -1 dropped the last token
        with pytest.raises(BadInput, match="max_tokens"):
            engine.encode("ROMEO. What light", max_tokens=n)
    with pytest.raises(BadInput, match="prefetch must be a PrefetchConfig"):
        engine.set_prefetch("lookahead")
    assert perplexity(engine, ids, context=2).ppl == ppl  # nothing refused left the engine changed
    engine.close()


def test_a_text_generation_refuses_arguments_of_the_wrong_type(ckpt):
    """TextGeneration refuses params that are no SamplingParams (a dict, None: an AttributeError), an engine that is
    none, and a `cached` that is no whole number (1.0 failed at the prefill's slice, '1' in a comparison)."""
    from expertcache.engine.generate import TextGeneration
    from expertcache.engine.sampling import SamplingParams
    engine = Engine(ckpt, EngineConfig(store="ram"))
    for bad_engine, params in ((engine, {"max_tokens": 2}), (engine, None), (None, SamplingParams())):
        with pytest.raises(BadInput, match="takes an Engine and a SamplingParams"):
            TextGeneration(bad_engine, [1, 2], params)
    for cached in (1.0, "1"):
        with pytest.raises(BadInput, match="cached"):
            TextGeneration(engine, [1, 2, 3], SamplingParams(max_tokens=2), cached=cached)
    assert len(list(TextGeneration(engine, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))) == 2
    engine.close()


def test_a_forward_past_max_seq_is_refused_before_any_pass_runs(ckpt, monkeypatch):
    """A forward longer than max_seq is refused whole, naming its length; it ran the passes before the one that
    crossed max_seq (their decisions and fetches) and named that pass's end."""
    from expertcache.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "FORWARD_CHUNK", 4)
    engine = Engine(ckpt, EngineConfig(store="ram", max_seq=8))
    with pytest.raises(BadInput, match="sequence of 13 tokens exceeds max_seq=8"):
        engine.forward(torch.arange(1, 14), 0)
    assert engine.stats.moe_calls == 0
    engine.close()


def test_config_values_of_the_wrong_type_are_one_line():
    """EngineConfig, CacheConfig and PrefetchConfig refuse a value of the wrong type when made, whichever road
    makes them: a float max_seq or cache bytes failed inside torch, a string inside a comparison, a string
    confidence inside the compiled prefetch mid-decode, a negative io_workers in the reads."""
    from expertcache.engine.moe import PrefetchConfig
    for kw in [dict(max_seq=64.0), dict(max_seq="64"), dict(max_seq=None), dict(kv_positions=4096.5),
               dict(memory_budget="64M"), dict(memory_budget=float("nan")), dict(cache=0.25),
               dict(prefetch="lookahead")]:
        with pytest.raises(BadInput, match=next(iter(kw))):
            EngineConfig(**kw)
    for kw in [dict(fraction="0.25"), dict(fraction=True), dict(bytes=1.5e7), dict(bytes="1M"), dict(io_workers=-1),
               dict(io_workers=1.5), dict(io_workers=None), dict(io_workers=10**5)]:  # 10**5 threads failed to start
        with pytest.raises(BadInput, match=f"{'io_workers' if 'io_workers' in kw else 'cache'}"):
            CacheConfig(**kw)
    for kw in [dict(budget=2.5), dict(budget="2"), dict(confidence="0.1"), dict(confidence=float("nan")),
               dict(confidence=-1), dict(confidence=2)]:
        with pytest.raises(BadInput, match=f"prefetch {next(iter(kw))}"):
            PrefetchConfig(**kw)
    assert EngineConfig(max_seq=torch.tensor(64).numpy()[()]).max_seq == 64  # a NumPy integer is an int
    assert CacheConfig(fraction=0.5, io_workers=0).io_workers == 0
    with pytest.raises(UnknownName, match="device None"):
        Engine(config=EngineConfig(device=None))
    with pytest.raises(BadInput, match="config must be an EngineConfig"):
        Engine(config={"store": "ram"})
    with pytest.raises(BadInput, match="model_path must be"):
        Engine(123)
    with pytest.raises(BadInput, match="model_path='' names no checkpoint"):  # it ran the built-in model
        Engine("")


def test_store_formats_folders_and_flags_are_checked_when_the_config_is_made(ckpt):
    """A store or small format given by its name is read as ExpertFormat.parse reads it (it failed deep in the load
    with an AttributeError); a format made by hand that is none, another type, or a small_format of None (a lowbit
    policy then fetched full copies and counted them as low-precision ones) is one BadInput naming the field, and so
    are a store_dir of another type or '' (the working directory) and a verify that is no bool ("no" read as true)."""
    from expertcache.engine.quant import ExpertFormat
    config = EngineConfig(store_format="int8", small_format="int4")
    assert config.store_format == ExpertFormat.parse("int8") and config.small_format == ExpertFormat.parse("int4")
    for kw in [dict(store_format=ExpertFormat("int3")), dict(store_format=ExpertFormat("int4")),
               dict(store_format="int3"), dict(store_format=8), dict(small_format=None), dict(store_dir=3),
               dict(store_dir=""), dict(verify="no"), dict(verify=None)]:
        with pytest.raises(BadInput, match=next(iter(kw))):
            EngineConfig(**kw)
    with Engine(ckpt, EngineConfig(store="disk", store_format="int8", initial="cold")) as engine:
        assert engine.store.stored_format == ExpertFormat.parse("int8")


def test_a_flag_given_where_a_number_belongs_and_a_number_where_a_flag_does_are_refused():
    """A policy's tau or beta given as True ran as 1.0 (float(True)); encode's special given as "no" failed in the
    tokenizer with a TypeError that named no argument."""
    from expertcache.policies import ThresholdRule
    for kw in [dict(tau=True), dict(beta=True), dict(tau=False)]:
        with pytest.raises(BadInput, match=f"{next(iter(kw))}=(True|False) is not a number"):
            ThresholdRule(**kw)
    with Engine(None, EngineConfig(max_seq=64)) as engine:
        assert engine.encode("hello", special=False)
        with pytest.raises(BadInput, match="special='no' must be True or False"):
            engine.encode("hello", special="no")


def test_flags_of_the_cache_and_prefetch_configs_are_bools():
    """PrefetchConfig's drop and fetched and CacheConfig's caller_reads refuse what is no bool: "no" read as true, and
    a prefetch's failed with a ValueError where the engine names its variant (PrefetchConfig.__str__)."""
    from expertcache.engine.moe import PrefetchConfig
    for kw in [dict(drop="no"), dict(drop=None), dict(fetched="yes")]:
        with pytest.raises(BadInput, match=f"prefetch {next(iter(kw))}"):
            PrefetchConfig(**kw)
    with pytest.raises(BadInput, match="caller_reads"):
        CacheConfig(caller_reads="no")
    assert str(PrefetchConfig(drop=False, fetched=True)) == "prefetch/quasi-hidden:drop=0,fetched=1"


def test_truncated_trace_is_one_line(capsys, tmp_path):
    from expertcache.engine.engine import BUILTIN_MODEL
    from expertcache.lab.trace import record_trace
    path = tmp_path / "t.ectrace"
    record_trace(BUILTIN_MODEL, list(range(1, 40)), path, 32, "float32")
    path.write_bytes(path.read_bytes()[:-100])
    code, err = run_cli(capsys, "simulate", str(path))
    assert code == 2 and err.count("\n") == 0 and "truncated" in err, err


def test_an_index_that_misplaces_a_tensor_is_one_line(capsys, ckpt):
    """A sharded checkpoint whose index names a shard that does not hold the tensor: the message says so."""
    from safetensors.torch import load_file, save_file
    sd = load_file(ckpt / "model.safetensors")
    names = sorted(sd)
    save_file({n: sd[n] for n in names[::2]}, ckpt / "model-00001-of-00002.safetensors")
    save_file({n: sd[n] for n in names[1::2]}, ckpt / "model-00002-of-00002.safetensors")
    (ckpt / "model.safetensors").unlink()
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    other = 2 - names.index("model.embed_tokens.weight") % 2  # the shard that does not hold it
    weight_map["model.embed_tokens.weight"] = f"model-0000{other}-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_cli_error(capsys, ckpt, "has no tensor 'model.embed_tokens.weight', where the index puts it")


def test_a_tensor_that_the_index_omits_is_read_from_its_shard_as_hf_reads_it(ckpt):
    """An index whose weight_map leaves out a tensor that one of its shards holds (edited by hand or by a merge
    tool): HF transformers loads every tensor of the listed shards, and so does the engine; it was refused as
    missing the tensor."""
    from safetensors.torch import load_file, save_file
    ids = torch.tensor([3, 1, 4, 1, 5])
    with Engine(ckpt, EngineConfig(store="ram")) as engine:
        want = engine.forward(ids, 0)
    sd = load_file(ckpt / "model.safetensors")
    names = sorted(sd)
    save_file({n: sd[n] for n in names[::2]}, ckpt / "model-00001-of-00002.safetensors")
    save_file({n: sd[n] for n in names[1::2]}, ckpt / "model-00002-of-00002.safetensors")
    (ckpt / "model.safetensors").unlink()
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)
                  if n not in ("model.norm.weight", "model.layers.1.mlp.experts.3.up_proj.weight")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for store in ("ram", "disk"):
        with Engine(ckpt, EngineConfig(store=store, store_dir=ckpt / "store")) as engine:
            assert torch.equal(engine.forward(ids, 0), want)


def test_a_single_file_beside_an_index_is_read_as_hf_reads_it(ckpt):
    """A folder holding model.safetensors and an index of other shards (a re-save beside the release, or the
    reverse): HF transformers loads the single file, and so does the engine, on every road."""
    from safetensors.torch import load_file, save_file
    sd = load_file(ckpt / "model.safetensors")
    ids = [3, 1, 4, 1, 5]
    with Engine(ckpt, EngineConfig(store="ram")) as engine:
        want = engine.forward(torch.tensor(ids), 0)
    other = {n: t * 2 if "experts" in n else t for n, t in sd.items()}
    save_file(other, ckpt / "model-00001-of-00001.safetensors")
    weight_map = {n: "model-00001-of-00001.safetensors" for n in other}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (ckpt / "stray.safetensors").write_bytes(b"not weights")  # neither does a stray file beside it count
    with Engine(ckpt, EngineConfig(store="ram")) as engine:
        assert torch.equal(engine.forward(torch.tensor(ids), 0), want)


def test_a_failed_conversion_leaves_no_partial_file(tiny, tmp_path, monkeypatch):
    """A conversion that fails midway (a full disk, an interrupt) removes what it wrote, so the disk is not left
    full and the next run converts afresh."""
    import expertcache.engine.stores as stores
    path, _ = tiny["qwen3_moe"]
    ckpt = open_checkpoint(path)
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return real(*a, **k)
    real = stores.convert.encode
    monkeypatch.setattr(stores.convert, "encode", failing)
    with pytest.raises(OSError):
        stores.convert_to_disk(ckpt, model_args(ckpt.config), tmp_path / "store")
    assert not list((tmp_path / "store").glob("*.partial")) and not (tmp_path / "store" / "experts.json").exists()


def test_one_scored_token_has_no_standard_error(capsys):
    assert cli.main(["ppl", "--store", "ram", "--max-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "(one token: no standard error) over 1 token " in out and "\n1 token, " in out  # not "1 tokens"


def test_one_scored_tokens_json_has_no_standard_error(capsys, tmp_path):
    """The JSON says what the line says: no standard error (null) for one token, not a standard error of 0."""
    out = tmp_path / "ppl.json"
    assert cli.main(["ppl", "--store", "ram", "--max-tokens", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 1 and r["stderr"] is None and r["ppl"] > 1, r


def test_an_engine_that_fails_to_load_leaves_no_file_or_thread_open(tiny, tmp_path, monkeypatch):
    """A step after the store is opened fails: the store's descriptor, the ring and the transfer threads
    are released, not leaked with each failed attempt."""
    import os
    import threading

    from expertcache.engine import engine as engine_module
    from expertcache.engine.engine import Engine, EngineConfig
    cfg = EngineConfig(store="disk", store_dir=tmp_path / "store", initial="cold")
    Engine(tiny["qwen3_moe"][0], cfg).close()  # converts the store once
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()

    def broken(*a, **k):
        raise RuntimeError("a later step fails")
    monkeypatch.setattr(engine_module.ExpertCache, "warm", broken)
    monkeypatch.setattr(engine_module.Engine, "reset", broken)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="later step"):
            Engine(tiny["qwen3_moe"][0], cfg)
    assert len(os.listdir("/proc/self/fd")) == fds and threading.active_count() == threads


def test_a_closed_engine_refuses_to_run_and_closes_once(tiny, tmp_path):
    """An engine used after close() is refused in one line (its forward, a perplexity's reset, set_policy), not a
    TypeError from the ring it released; a second close() does nothing (it failed the same way)."""
    import os
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(store="disk", store_dir=tmp_path / "store", initial="cold"))
    engine.forward(torch.tensor([1, 2, 3]), 0)
    fds = len(os.listdir("/proc/self/fd"))
    engine.close()
    assert len(os.listdir("/proc/self/fd")) < fds
    for use in (lambda: engine.forward(torch.tensor([1, 2, 3]), 0), lambda: perplexity(engine, [1, 2, 3]),
                lambda: engine.set_policy("lowbit")):  # refused before it opened the small copies' store
        with pytest.raises(BadInput, match="engine is closed"):
            use()
    engine.close()


def test_a_call_from_another_thread_while_one_runs_is_refused(tiny):
    """Two threads on one engine: a forward (or a reset, or a policy's change) while another thread's forward runs is
    refused in one line, not run over the same cache and KV cache (the process aborted: a double free); the running
    forward's logits are those it computes alone, and close() waits for it."""
    import threading
    engine = Engine(tiny["qwen3_moe"][0], EngineConfig(initial="cold"))
    ids = torch.tensor([1, 2, 3, 4])
    alone = engine.forward(ids, 0)
    running, release, out = threading.Event(), threading.Event(), []
    real = engine.model.forward

    def held(*a, **k):
        running.set()
        release.wait(10)
        return real(*a, **k)
    engine.model.forward = held
    worker = threading.Thread(target=lambda: out.append(engine.forward(ids, 0)))
    worker.start()
    assert running.wait(10)
    for use in (lambda: engine.forward(ids, 0), engine.reset, lambda: engine.set_policy("fetch-all"),
                lambda: engine.forward_batch(ids[:1], [0], [(engine.model.k_cache, engine.model.v_cache)])):
        with pytest.raises(BadInput, match="another thread"):
            use()
    closing = threading.Thread(target=engine.close)
    closing.start()
    release.set()
    worker.join(10)
    closing.join(10)
    assert torch.equal(out[0], alone) and engine.closed


def test_an_engine_closes_every_file_it_opened_and_serves_a_with_block(tiny, tmp_path):
    """close() closes the low-precision copies' store a lowbit policy opened, which it left open (a file and its
    reads a closed engine, kept for as long as the process ran); `with Engine(...)` closes the engine at its end."""
    import os
    fds = len(os.listdir("/proc/self/fd"))
    with Engine(tiny["qwen3_moe"][0], EngineConfig(store="disk", store_dir=tmp_path / "store", initial="cold",
                                                  policy="lowbit:tau=0.3")) as engine:
        assert engine.small_store is not None
        engine.forward(torch.tensor([1, 2, 3]), 0)
    assert engine.closed and len(os.listdir("/proc/self/fd")) == fds


def test_time_runs_closes_its_engines_when_a_run_fails(tiny, tmp_path):
    import os
    import threading

    from expertcache.errors import UnknownName
    from expertcache.lab.costmodel import time_runs
    model = tiny["qwen3_moe"][0]
    time_runs(model, [(0.5, "fetch-all")], list(range(1, 12)), repeats=1, store_dir=tmp_path / "s", prompt=4)
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    with pytest.raises(UnknownName):
        time_runs(model, [(0.5, "fetch-all"), (0.5, "nope")], list(range(1, 12)), repeats=1,
                  store_dir=tmp_path / "s", prompt=4)
    assert len(os.listdir("/proc/self/fd")) == fds and threading.active_count() == threads


@pytest.mark.parametrize("fail", ["cpu", "cuda"])
def test_running_out_of_memory_is_one_line_naming_the_fixes(capsys, monkeypatch, fail):
    """An allocation the machine refuses (the CPU allocator's, numpy's, or CUDA's OutOfMemoryError, the usual
    failure of a too large run on a GPU) ends in one line with the sizes and what to lower, not a traceback."""
    from expertcache.commands import ppl

    def run(_):
        if fail == "cpu":
            torch.empty(2**62, dtype=torch.uint8)  # a real refusal of the CPU allocator
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "7.60 GiB of which 512.00 MiB is free. Of the allocated memory 6.1 GiB ...")
    monkeypatch.setattr(ppl, "run", run)
    code, err = run_cli(capsys, "ppl")
    assert code == 2 and len(err.splitlines()) == 1 and "out of memory" in err and "--memory-budget" in err
    assert ("allocate" in err) and ("2.00 GiB" in err if fail == "cuda" else "bytes" in err)
    from expertcache.commands import trace
    monkeypatch.setattr(trace, "run", run)  # a verb without the engine's flags is told what it takes
    code, err = run_cli(capsys, "trace", "--out", "x.ectrace")
    assert code == 2 and "give the run less: fewer --max-tokens" in err and "--cache" not in err, err


def test_a_file_whose_write_is_interrupted_is_left_as_it_was(tmp_path, ckpt):
    """calibrate's and predict --train's files beside the model, profiles and --json outputs are written whole or
    not at all: an interrupt (or a full disk) mid-write leaves the earlier file, not a cut one that the next run
    (or a server loading it meanwhile) would refuse."""
    from expertcache.atomic import _umask, replaced, write_text
    from expertcache.lab.calibrate import Calibration, save_calibration
    f = tmp_path / "out.json"
    write_text(f, "earlier")
    with pytest.raises(KeyboardInterrupt):
        with replaced(f) as tmp:
            tmp.write_text("half of a")
            raise KeyboardInterrupt
    assert f.read_text() == "earlier" and not list(tmp_path.glob(".*.partial"))
    args = model_args(open_checkpoint(ckpt).config)
    c = Calibration(torch.ones(args.num_moe_layers, args.num_experts), torch.zeros(args.num_moe_layers,
                    args.num_experts, args.hidden_size), 5)
    save_calibration(c, ckpt, "text")
    assert json.loads((ckpt / "routing_counts.json").read_text())["tokens"] == 5
    assert not list(ckpt.glob(".*.partial"))
    # readable by whoever could read the folder's other files: safetensors writes its own files 0600
    assert (ckpt / "default_vectors.safetensors").stat().st_mode & 0o777 == \
        (ckpt / "routing_counts.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_an_output_that_is_a_pipe_or_a_link_is_written_through_not_replaced(tmp_path):
    """--json /dev/stdout, a FIFO or a link to a file: the data goes where the path leads. Renaming a finished
    file over such a path replaced the node itself (as root, /dev/full or /dev/stdout became a plain file)."""
    import threading

    from expertcache.atomic import write_text
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)  # a regression: no hang
    reader.start()
    write_text(fifo, "through the pipe")
    reader.join(10)
    assert got == ["through the pipe"] and fifo.is_fifo()
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("earlier")
    link.symlink_to(target)
    write_text(link, "later")
    assert link.is_symlink() and target.read_text() == "later" and not list(tmp_path.glob(".*.partial"))


def test_training_files_cut_by_an_interrupt_are_not_reused(tmp_path, monkeypatch):
    """`train` resumes from the files its work folder holds (the token cache, the tokenizer, the training state):
    an interrupt while one is written leaves none, not a cut one that every later run would load and fail on."""
    from expertcache.train import corpus, train
    from expertcache.train.tokenizer import train_tokenizer
    text = tmp_path / "train.txt"
    text.write_text(corpus.EOT.join(["the cat sat on the mat. " * 20, "a dog ran. " * 30]), encoding="utf-8")
    tok = train_tokenizer(text, tmp_path / "tok", vocab_size=300)
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["eos_token"] == corpus.EOT
    cache, save = tmp_path / "train_tokens.npy", np.save

    def cut(f, arr):
        f.write(b"\x93NUMPY")  # the header's start, then the interrupt
        raise KeyboardInterrupt
    monkeypatch.setattr(np, "save", cut)
    with pytest.raises(KeyboardInterrupt):
        train.tokenize(tok, text, cache)
    assert not cache.exists() and not list(tmp_path.glob(".*.partial"))
    monkeypatch.setattr(np, "save", save)
    ids = train.tokenize(tok, text, cache)
    assert cache.exists() and np.array_equal(ids, train.tokenize(tok, text, cache)) and len(ids) > 20


def test_the_first_tokens_of_a_large_text_are_the_whole_texts_without_tokenizing_it_all():
    """`ppl --max-tokens`, calibrate, predict and tune ask for a text's first tokens: they are the whole text's
    first tokens, cut ends included (a word run over the cut, a repeated text), and the tokenizer reads a prefix
    a few times their length, not the file (60 MB of text took 79 s and 10 GB)."""
    from expertcache.engine.checkpoint import encode_prefix
    engine = Engine(BUILTIN_MODEL, EngineConfig(store="ram"))
    text = (BUILTIN_MODEL.parent / "eval.txt").read_text() * 4 + "x" * 50_000 + " tail"
    whole = engine.encode(text)
    read = []

    def encode(t):
        read.append(len(t))
        return engine.tokenizer.encode(t).ids
    for n in (1, 64, 1000, 40_000, len(whole) - 3, len(whole) + 5):
        read.clear()
        assert encode_prefix(encode, text, n) == whole[:n], n
        if n <= 40_000:  # two prefixes, of 8 and 16 characters a token asked for (at least 4,096)
            assert sum(read) <= 24 * max(n, 512) < len(text)
    assert engine.encode(text, max_tokens=500) == whole[:500]
    engine.close()


@pytest.mark.parametrize("counts, words", [([[5] * 8, [-3] + [5] * 7], "a negative count, -3"),
                                           ([[10**30] * 8] * 2, "OverflowError"), (None, "Is a directory")])
def test_routing_counts_that_are_no_counts_are_one_line(capsys, ckpt, counts, words):
    """A negative count reordered a warm start silently; one too large for 64 bits, or a folder in the file's place,
    failed with a traceback."""
    path = ckpt / "routing_counts.json"
    if counts is None:
        path.mkdir()
    else:
        path.write_text(json.dumps({"counts": counts}))
    code, err = run_cli(capsys, "ppl", "--model", str(ckpt), "--text", __file__)
    assert code == 2 and err.count("\n") == 0 and "not a routing-counts file" in err and words in err, err
    assert "expertcache calibrate" in err


def test_measured_json_is_strict_and_signless_at_zero(tmp_path):
    """What the verbs write with --json: numpy values as Python ones, an undefined figure as null (strict parsers
    refuse NaN), and a difference that rounds to -0.0 as 0.0."""
    from expertcache.jsonout import dump_json
    dump_json(tmp_path / "o.json", {"nan": float("nan"), "inf": np.float32("inf"), "zero": -0.0,
                                    "arr": np.array([-0.0, 2]), "n": np.int64(3)})
    text = (tmp_path / "o.json").read_text()
    assert json.loads(text) == {"nan": None, "inf": None, "zero": 0.0, "arr": [0.0, 2.0], "n": 3} and "-0" not in text


def test_names_folders_and_ids_of_the_python_api_are_refused_before_anything_loads(tmp_path, monkeypatch):
    """What the command line checked for its own users, checked where every road goes: an initial residency, a quota
    or an I/O backend misspelt was named only after the store was converted and the weights loaded; a store_dir that
    is a file, or under one, was a bare OSError; '~' in store_dir made a folder named '~'; a budget or cache size of
    0 or less a message about units; './org/name' was looked up on the Hub; bools were token ids; an id past int64
    was called no list of ints; a policy spelt as the command line spells prefetching named no way to give it."""
    for kw, words in [(dict(initial="hot"), "unknown initial residency 'hot'"),
                      (dict(memory_budget=0), "memory_budget=0 must be a positive number of bytes"),
                      # a size asked for, replaced without a word by what the budget left
                      (dict(memory_budget=2**27, cache=CacheConfig(fraction=0.1)), "give it or a cache size"),
                      (dict(memory_budget=2**27, cache=CacheConfig(bytes=2**22)), "not both")]:
        with pytest.raises((BadInput, UnknownName), match=words):
            EngineConfig(**kw)
    for kw, words in [(dict(quota="Layer"), "unknown quota 'Layer'"), (dict(io="fast"), "unknown I/O backend"),
                      (dict(bytes=-1), "must be a positive number of bytes")]:
        with pytest.raises((BadInput, UnknownName), match=words):
            CacheConfig(**kw)
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="the store folder .* is a file"):
        EngineConfig(store="disk", store_dir=tmp_path / "file")
    with pytest.raises(BadInput, match="cannot make the store folder .*file/sub"):
        Engine(None, EngineConfig(store="disk", store_dir=tmp_path / "file" / "sub"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert EngineConfig(store_dir="~/store").store_dir == tmp_path / "home" / "store"
    (tmp_path / "org").mkdir()
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):  # not "no Hub download of it"
        Engine("./org/model")
    with pytest.raises(UnknownName, match="parse_variant"):
        Engine(None, EngineConfig(policy="fetch-all+prefetch/lookahead"))
    with Engine(None, EngineConfig(max_seq=64)) as engine:
        with pytest.raises(BadInput, match="not bools"):
            engine.decode([True, 5])
        with pytest.raises(BadInput, match=f"token id {2**70} is outside"):
            engine.decode([5, 2**70])
        with pytest.raises(BadInput, match="last='no' must be True or False"):  # it ran as True
            engine.forward([1, 2], 0, last="no")
        with pytest.raises(BadInput, match="reset='no'"):
            perplexity(engine, [1, 2, 3], reset="no")
        with pytest.raises(BadInput, match="perplexity takes an Engine, not str"):  # an AttributeError inside
            perplexity("model", [1, 2, 3])
        from expertcache.engine.generate import generate
        with pytest.raises(BadInput, match="max_new_tokens=0 must be >= 1"):  # at the call, not at next()
            generate(engine, [1, 2], 0)


def test_a_read_only_models_advice_leaves_no_link_to_a_file_the_verb_writes(tmp_path, monkeypatch, capsys):
    """The folder of links the refusal names ends with the links to the files the verb writes removed: kept, the
    writes followed them into the read-only folder (EROFS after the verb's work). Followed, calibrate runs."""
    import re
    import subprocess
    from expertcache.engine import checkpoint
    model = tmp_path / "ro"
    shutil.copytree(BUILTIN_MODEL, model)
    monkeypatch.setattr(checkpoint, "writable_folder", lambda folder: Path(folder).resolve() != model.resolve())
    code, err = run_cli(capsys, "calibrate", "--model", str(model), "--max-tokens", "64")
    assert code == 2 and "rm -f MODEL/routing_counts.json MODEL/default_vectors.safetensors" in err, err
    advice = re.search(r"mkdir MODEL && .*", err).group(0).replace("MODEL", str(tmp_path / "links"))
    subprocess.run(advice, shell=True, check=True)
    assert not (tmp_path / "links" / "routing_counts.json").exists() and (tmp_path / "links" / "config.json").exists()
    assert run_cli(capsys, "calibrate", "--model", str(tmp_path / "links"), "--max-tokens", "64")[0] == 0
    assert (tmp_path / "links" / "routing_counts.json").is_file() and not \
        (tmp_path / "links" / "routing_counts.json").is_symlink()


def test_an_out_of_range_parameters_example_is_inside_its_bounds():
    """band:lo=0.9,hi=0.1 suggested hi=0.3, which the same check refuses; the example now lies inside the bounds."""
    from expertcache.policies import make_policy
    with pytest.raises(BadInput, match=r"hi > 0.9, e.g. band:hi=1\b") as e:
        make_policy("band:lo=0.9,hi=0.1")
    make_policy("band:lo=0.9," + str(e.value).rsplit("band:", 1)[1])  # the example, followed
    with pytest.raises(BadInput, match=r"e.g. band:hi=0.3"):  # the usual example where it fits
        make_policy("band:lo=0.2,hi=0.1")


def test_a_full_disk_while_calibration_saves_leaves_the_old_pair_and_one_line(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk in its own error type: it ended in a traceback, with routing_counts.json
    already replaced beside the old default vectors. Both files are written before either replaces its own, and the
    line names their folder, where a full disk's error names no file."""
    from safetensors import SafetensorError
    from expertcache.lab import calibrate
    model = tmp_path / "m"
    shutil.copytree(BUILTIN_MODEL, model)
    before = {n: (model / n).read_bytes() for n in ("routing_counts.json", "default_vectors.safetensors")}

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(calibrate, "save_file", full)
    code, err = run_cli(capsys, "calibrate", "--model", str(model), "--max-tokens", "64")
    last = err.splitlines()[-1]  # after the progress bar
    assert code == 2 and last.startswith("expertcache: error:") and "No space left on device" in last and \
        "free disk space" in last and f"'{model}'" in last, err
    assert {n: (model / n).read_bytes() for n in before} == before and not list(model.glob(".*.partial"))


def test_a_failed_write_names_the_file_it_was_for(tmp_path):
    """A full disk's error is the write's, which names no file, and a refused open names the temporary beside the
    file: the line of `expertcache: error:` named neither the file nor where to free space. Both name the file now;
    an error that names another file keeps it."""
    import errno

    from expertcache.atomic import replaced
    path = tmp_path / "out.json"
    with pytest.raises(OSError) as e, replaced(path):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    with pytest.raises(PermissionError) as e, replaced(path) as tmp:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp))
    assert e.value.filename == str(path) and not path.exists()
    with pytest.raises(FileNotFoundError) as e, replaced(path):
        open(tmp_path / "gone" / "input.txt")
    assert e.value.filename == str(tmp_path / "gone" / "input.txt")


def test_two_writers_of_one_file_write_their_own_temporaries(tmp_path):
    """Two writes of one file at once shared one temporary name: one failed with FileNotFoundError and the other
    could publish both writers' bytes mixed. Each now writes a file of its own, and the last to finish wins whole."""
    from expertcache.atomic import replaced
    path = tmp_path / "out.json"
    with replaced(path) as first, replaced(path) as second:
        assert first != second
        first.write_text('{"a": 1}')
        second.write_text('{"b": 2}')
    assert json.loads(path.read_text()) == {"a": 1} and not list(tmp_path.glob(".*.partial"))


def test_a_plot_whose_write_fails_leaves_the_one_it_replaces(tmp_path, monkeypatch):
    """Plots were saved in place: a full disk mid-write left a truncated PNG where a good one was."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from expertcache.lab.plots import lines
    path = tmp_path / "recall.png"
    lines({"a": [0.5, 0.6]}, ["0->1", "1->2"], "x", "y", path)
    good = path.read_bytes()

    def full(self, fname, **kw):
        Path(fname).write_bytes(good[:100])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(OSError):
        lines({"a": [0.1, 0.2]}, ["0->1", "1->2"], "x", "y", path)
    assert path.read_bytes() == good and not list(tmp_path.glob(".*.partial"))


def test_a_pipe_given_as_a_trace_or_a_profile_is_refused_not_waited_on(tmp_path):
    """A FIFO's open waited for a writer forever (simulate hung, printing nothing)."""
    import subprocess
    from expertcache.lab.costmodel import load_profile
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = subprocess.run([sys.executable, "-m", "expertcache.cli", "simulate", str(fifo), "--policies", "fetch-all"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "is not a regular file" in run.stderr.splitlines()[-1], run.stderr
    with pytest.raises(UnknownName, match="not a regular file"):
        load_profile(str(fifo))


def test_options_another_mode_reads_are_refused(capsys):
    """predict's training options without --train and --plot with --train or --speculative were dropped in silence;
    simulate's refusal of a prefetching variant named a Python function."""
    for argv, words in ((["predict", "--hybrid-below", "1"], "--hybrid-below set how --train fits"),
                        (["predict", "--epochs", "3"], "--epochs set how --train fits"),
                        (["predict", "--train", "--plot", "r.png"], "--plot draws the recall table"),
                        (["predict", "--speculative", "--plot", "r.png"], "--plot draws the recall table")):
        code, err = run_cli(capsys, *argv)
        assert code == 2 and words in err, err


def test_an_output_that_is_an_input_of_the_run_is_refused(tmp_path, capsys):
    """`trace --text F --out F` wrote a trace over the text it read, `simulate T --json T` JSON over the trace."""
    text = tmp_path / "text.txt"
    text.write_text("ROMEO. But soft, what light through yonder window breaks?\n" * 20)
    code, err = run_cli(capsys, "trace", "--text", str(text), "--out", str(text), "--max-tokens", "32")
    assert code == 2 and "is both an input of this run and where it writes" in err, err
    assert text.read_text().startswith("ROMEO.")


def test_sketches_or_a_net_past_the_models_sizes_are_refused_before_training(tmp_path, capsys):
    """--sketch-rank 100000 ran out of memory after recording, told to give fewer --max-tokens."""
    model = tmp_path / "m"
    shutil.copytree(BUILTIN_MODEL, model)
    for flag, words in (("--sketch-rank", "hidden size"), ("--sketch-neurons", "an expert's neurons"),
                        ("--lookahead-width", "eight times its hidden size")):
        code, err = run_cli(capsys, "predict", "--train", "--model", str(model), "--max-tokens", "64", flag,
                            "100000")
        assert code == 2 and words in err.splitlines()[-1], err


def test_a_model_that_predicts_nothing_has_an_infinite_perplexity_not_a_traceback(tiny, tmp_path):
    """A mean negative log-likelihood past ~710 nats (a damaged or scaled model) overflowed math.exp: ppl ended in
    OverflowError. Its perplexity is inf, null in --json."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from expertcache.jsonout import json_ready
    path = tmp_path / "model"
    shutil.copytree(tiny["qwen3_moe"][0], path)
    file = path / "model.safetensors"
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    sd = load_file(file)
    head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
    sd[head] = sd[head] * 1e5
    save_file(sd, file, metadata)
    result = perplexity(Engine(path, EngineConfig(store="ram")), list(range(1, 33)), context=16)
    assert result.nll > 710 and result.ppl == float("inf")
    assert json_ready(result.to_dict())["ppl"] is None


def test_a_chat_template_that_loops_past_any_need_is_stopped_with_one_line(monkeypatch):
    """The sandbox bounds each `range` to 100,000, not loops within loops: such a template hung `chat` (and would
    hold a server's thread) for ever. It is stopped after RENDER_SECONDS with a ChatTemplateError naming the fix, and
    a template that renders in time is untouched by the timer, also once its deadline has passed."""
    import time

    from expertcache.engine import chat
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    looping = chat.ChatTemplate("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}")
    start = time.perf_counter()
    with pytest.raises(chat.ChatTemplateError, match="still rendering after 0.5 s.*chat_template.jinja"):
        looping.render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 5
    plain = chat.ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert plain.render([{"role": "user", "content": "hi"}]) == "hi"
    time.sleep(1.0)  # its timer, cancelled, raises nothing later in this thread
    assert sum(range(10**6)) and plain.render([{"role": "user", "content": "ok"}]) == "ok"
