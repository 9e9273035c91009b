"""`info --config` sizes a checkpoint from its config.json alone: its counts equal the HF
model's own, and a config that is not JSON is one clear error."""
import json

import pytest
from hf_models import hf_config

from expertcache import cli


def test_info_sizes_a_config_without_weights(tmp_path, capsys, tiny):
    path, hf = tiny["qwen2_moe"]
    out = tmp_path / "info.json"
    assert cli.main(["info", "--config", str(path / "config.json"), "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n and "shared" not in n)
    assert s["params"] == sum(p.numel() for p in hf.parameters())
    assert s["expert_params"] * s["moe_layers"] * s["experts"] == experts
    assert s["expert_bytes"]["fp16"] == 2 * s["expert_params"] > s["expert_bytes"]["int4"]
    assert s["fits"]["8"]["experts_per_layer"] == s["experts"]  # a tiny model fits whole
    assert "experts per layer" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert cli.main(["info", "--config", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert hf_config("qwen2_moe").num_experts == s["experts"]
    # the folder that holds it sizes the same (it was "Is a directory"); a folder without one is one line
    assert cli.main(["info", "--config", str(path), "--json", str(tmp_path / "folder.json")]) == 0
    assert json.loads((tmp_path / "folder.json").read_text()) == s
    (tmp_path / "empty").mkdir()
    assert cli.main(["info", "--config", str(tmp_path / "empty")]) == 2
    assert "holds no config.json" in capsys.readouterr().err


def test_a_hub_id_that_cannot_be_downloaded_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["info", "--model", "no-such-org/no-such-moe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Hub download" in err and "--model a local folder" in err


def test_kv_bytes_per_token_are_the_engines_cache(tiny):
    """The KV cache per token that `info` budgets is what the engine allocates per position: keys and values
    per head for GQA, a latent and one rotary key for latent attention (DeepSeek-V2/V3)."""
    import torch

    from expertcache.commands.info import size_config
    from expertcache.engine.engine import Engine, EngineConfig
    for family in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
        path, _ = tiny[family]
        config = json.loads((path / "config.json").read_text())
        engine = Engine(path, EngineConfig(max_seq=16))
        m = engine.model
        fp16_per_position = m.kv_bytes(16) // 16 * 2 // torch.finfo(m.dtype).bits * 8  # info counts fp16
        engine.close()
        assert size_config(config)["kv_bytes_per_token"] == fp16_per_position, family


def test_info_sizes_slots_of_the_dtype_asked_for_and_takes_sizes(tmp_path, capsys, tiny):
    """`--config` with `--slot-dtype int4` budgets int4 slots, not fp16 ones; `--budget` takes sizes like every
    other size flag (16G, 64M) and a plain number as MiB, as before."""
    config = str(tiny["qwen2_moe"][0] / "config.json")
    whole = tmp_path / "whole.json"
    assert cli.main(["info", "--config", config, "--json", str(whole)]) == 0
    s = json.loads(whole.read_text())
    budget = 2 * s["expert_bytes"]["fp16"] * s["moe_layers"]  # two fp16 experts a layer
    sized = {}
    for slot in ("fp16", "int4"):
        out = tmp_path / f"{slot}.json"
        assert cli.main(["info", "--config", config, "--slot-dtype", slot, "--budget", f"{budget}B",
                         "--json", str(out)]) == 0
        sized[slot] = json.loads(out.read_text())
        assert f"for {slot} experts" in capsys.readouterr().out
    assert sized["int4"]["slot"] == "int4"
    assert sized["int4"]["budget"]["experts_per_layer"] > sized["fp16"]["budget"]["experts_per_layer"]
    assert sized["fp16"]["budget"]["experts_per_layer"] == 2
    by_mib, by_size = tmp_path / "mib.json", tmp_path / "size.json"
    assert cli.main(["info", "--budget", "2", "--json", str(by_mib)]) == 0
    assert cli.main(["info", "--budget", "2M", "--json", str(by_size)]) == 0
    assert json.loads(by_mib.read_text())["budget_slots_per_layer"] == \
        json.loads(by_size.read_text())["budget_slots_per_layer"]
    with pytest.raises(SystemExit) as bad:
        cli.main(["info", "--budget", "lots"])
    assert bad.value.code == 2 and "not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # bytes without a unit: read as MiB, everything would fit
        cli.main(["info", "--budget", "16000000000"])
    assert bad.value.code == 2 and "16000000000B" in capsys.readouterr().err


def test_configs_of_too_many_layers_or_a_dense_model_type_are_one_line(tmp_path, capsys):
    """info --config ran for minutes naming 3,000,000 layers, ended in a ZeroDivisionError where transformers built
    a dense model of the config's model_type, and called num_experts 0 a missing num_local_experts."""
    import json

    from expertcache import cli
    from expertcache.engine.engine import BUILTIN_MODEL
    cfg = json.loads((BUILTIN_MODEL / "config.json").read_text())
    for over, words in [({"num_hidden_layers": 3 * 10**6}, "more than 10,000"),
                        ({"model_type": "llama"}, "without routed experts"),
                        ({"num_experts": 0}, "number of experts 0")]:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**cfg, **over}))
        assert cli.main(["info", "--config", str(path)]) == 2
        assert words in capsys.readouterr().err.strip().splitlines()[-1]
