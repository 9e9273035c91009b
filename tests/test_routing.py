"""Routing: the compiled top-k and gate weights against numpy and torch, for the engine's
float32 rows and a trace's float16 rows alike."""
import numpy as np
import pytest
import torch

from expertcache.kernel.routing import HALF_TO_FLOAT, route_logits, top_m


def select(row, table, m):
    E = len(row)
    idx, val = np.zeros(m, np.int64), np.zeros(m)
    top_m(row, table, m, idx, val, np.zeros(E, np.int64), np.zeros(E // 16 + 1, np.int64))
    return idx, val


@pytest.mark.parametrize("E,m", [(8, 3), (128, 8), (512, 10), (100, 16)])
def test_top_m_is_a_stable_descending_sort(E, m):
    rng = np.random.default_rng(E)
    for _ in range(50):
        row = rng.normal(0, 2, E).astype(np.float16)  # float16: many ties
        row[rng.integers(0, E, 4)] = row[0]  # and some forced ones
        expected = np.argsort(-row.astype(np.float32), kind="stable")[:m]
        idx, val = select(row.astype(np.float32), None, m)
        assert idx.tolist() == expected.tolist()
        np.testing.assert_array_equal(val, row[expected].astype(np.float32))
        idx16, _ = select(row.view(np.uint16), HALF_TO_FLOAT, m)
        assert idx16.tolist() == expected.tolist()  # the trace's rows rank like the engine's


@pytest.mark.parametrize("norm", [True, False])
def test_weights_match_torch(norm):
    logits = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, dim=-1)
    w, ids = probs.topk(8, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    _, weights, got = route_logits(logits.numpy(), 8, norm)
    assert (got == ids.numpy()).all()
    np.testing.assert_allclose(weights, w.numpy(), rtol=1e-5)
