"""Speculative prefetch: prefetch-only keeps the output exact; predictors and the estimator
work end to end on a tiny model calibrated in the test."""
import shutil

import pytest
import torch

from expertcache.engine.cache import CacheConfig
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.moe import PrefetchConfig
from expertcache.lab.calibrate import calibrate, save_calibration
from expertcache.lab.prediction import fit_estimator, recall_table


@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrated") / "model"
    shutil.copytree(tiny["qwen3_moe"][0], path)
    ids = torch.randint(0, 96, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    c = calibrate(path, ids, context=128)
    assert c.counts.sum() == 600 * 2 * 2  # tokens x layers x top-k
    save_calibration(c, path, "random ids")
    fit_estimator(path, ids)
    return path, tiny["qwen3_moe"][1]


def decode(engine, ids, prompt=6):
    out = [engine.forward(ids[:prompt], 0)]
    for pos in range(prompt, len(ids)):
        out.append(engine.forward(ids[pos:pos + 1], pos))
    return torch.cat(out)


@pytest.mark.parametrize("predictor", ["router-ahead", "quasi-hidden", "estimator", "hybrid"])
@pytest.mark.parametrize("store", ["ram", "disk"])
def test_prefetch_only_is_exact(calibrated, predictor, store):
    path, hf = calibrated
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    engine = Engine(path, EngineConfig(store=store, cache=CacheConfig(fraction=0.25),
                                       prefetch=PrefetchConfig(predictor, "prefetch")))
    torch.testing.assert_close(decode(engine, ids), ref, atol=1e-4, rtol=0)
    assert engine.stats.prefetch_fetches > 0
    engine.close()


def test_speculative_runs_predicted_experts(calibrated):
    path, hf = calibrated
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(6))
    exact = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25)))
    spec = Engine(path, EngineConfig(cache=CacheConfig(fraction=0.25),
                                     prefetch=PrefetchConfig("quasi-hidden", "speculative")))
    a, b = decode(exact, ids), decode(spec, ids)
    assert torch.isfinite(b).all() and not torch.allclose(a, b)
    assert spec.stats.prefetch_fetches > 0


def test_recall_table(calibrated):
    path, _ = calibrated
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    table = recall_table(path, ids)
    assert set(table) == {"router-ahead", "quasi-hidden", "estimator", "hybrid"}
    assert all(len(r) == 1 and 0 <= r[0] <= 1 for r in table.values())
