"""`info --config` sizes a checkpoint from its config.json alone: its counts equal the HF
model's own, and a config that is not JSON is one clear error."""
import json

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


def test_a_hub_id_that_cannot_be_downloaded_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["info", "--model", "no-such-org/no-such-moe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Hub download" in err and "--model a local folder" in err
