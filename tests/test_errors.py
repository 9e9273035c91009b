"""Bad input: one clear line and exit code 2 from the CLI, a typed exception from the library."""
import json
import shutil

import pytest

from expertcache import cli
from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.perplexity import perplexity
from expertcache.errors import BadInput, CacheTooSmall, CheckpointError, UnknownName, UnsupportedArchitecture


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


def test_missing_and_corrupt_config(capsys, ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect_cli_error(capsys, ckpt, "not valid JSON")
    (ckpt / "config.json").unlink()
    expect_cli_error(capsys, ckpt, "config.json is missing")


def test_corrupt_weights(capsys, ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 100)
    expect_cli_error(capsys, ckpt, "corrupt safetensors")


def test_missing_tensor(capsys, ckpt):
    from safetensors.torch import load_file, save_file
    sd = load_file(ckpt / "model.safetensors")
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, ckpt / "model.safetensors")
    expect_cli_error(capsys, ckpt, "is missing")


def test_unsupported_architecture(capsys, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect_cli_error(capsys, ckpt, "qwen3_moe")
    with pytest.raises(UnsupportedArchitecture, match="supported: qwen3_moe"):
        Engine(ckpt)


def test_cache_too_small(capsys, ckpt):
    expect_cli_error(capsys, ckpt, "fewer than top-k=2", "--cache", "0.1")
    with pytest.raises(CacheTooSmall):
        Engine(ckpt, EngineConfig(cache=CacheConfig(fraction=0.1)))
    with pytest.raises(CacheTooSmall):
        Engine(ckpt, EngineConfig(cache=CacheConfig(bytes=1000)))


def test_unknown_names(capsys, ckpt):
    expect_cli_error(capsys, ckpt, "unknown policy 'nope'", "--policy", "nope")
    expect_cli_error(capsys, ckpt, "unknown store 'tape'", "--store", "tape")
    expect_cli_error(capsys, ckpt, "unknown eviction", "--eviction", "random")
    with pytest.raises(UnknownName):
        Engine(ckpt, EngineConfig(policy="fetch-all:tau=x"))


def test_missing_text_file(capsys, ckpt, tmp_path):
    code, err = run_cli(capsys, "ppl", "--model", str(ckpt), "--text", str(tmp_path / "none.txt"))
    assert code == 2 and "cannot read text" in err


def test_bad_input_is_typed_and_programming_errors_are_not_bad_input(capsys, ckpt, monkeypatch):
    code, err = run_cli(capsys, "generate", "--store", "ram", "--max-seq", "8", "-n", "16", "ROMEO.")
    assert code == 2 and "exceed max_seq=8" in err and err.count("\n") == 0, err
    with pytest.raises(BadInput, match="at least 2 tokens"):
        perplexity(Engine(ckpt), [1])
    from expertcache.commands import info

    def broken(a):
        raise ValueError("a bug, not bad input")
    monkeypatch.setattr(info, "run", broken)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["info"])


def test_os_errors_are_one_line(capsys, ckpt, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EXPERTCACHE_HOME", str(home))
    expect_cli_error(capsys, ckpt, "Not a directory", "--store", "disk")
    store = tmp_path / "store"
    store.mkdir()
    (store / "experts.bin.partial").symlink_to("/dev/full")  # every write: no space left on device
    code, err = run_cli(capsys, "convert", "--model", str(ckpt), "--out", str(store))
    assert code == 2 and err.count("\n") == 0 and "No space left on device" in err and "free disk space" in err, err
