import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import FAMILIES, save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """family -> (checkpoint folder, HF reference model)."""
    out = {}
    for fam in FAMILIES:
        path = tmp_path_factory.mktemp(fam)
        out[fam] = (path, save_tiny(fam, path))
    return out


@pytest.fixture(autouse=True)
def _store_home(tmp_path_factory, monkeypatch):
    # Disk stores converted by tests live in a temporary home, never in ~/.cache.
    monkeypatch.setenv("EXPERTCACHE_HOME", str(tmp_path_factory.getbasetemp() / "home"))
