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


@pytest.fixture(scope="session")
def benchmark_script():
    """A loader of benchmarks/NAME.py as a module, for the tests of a script's functions."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(autouse=True)
def _store_home(tmp_path_factory, monkeypatch):
    # Disk stores converted by tests live in a temporary home, never in ~/.cache.
    monkeypatch.setenv("EXPERTCACHE_HOME", str(tmp_path_factory.getbasetemp() / "home"))


SERVED = "expertcache-builtin"  # the model id the server fixture serves the built-in model under


@pytest.fixture(scope="module")
def server():
    """An OpenAI-compatible server over the built-in model on a loopback port, one a test module."""
    from expertcache.engine.engine import Engine, EngineConfig
    from expertcache.serve.app import create_app
    from expertcache.serve.background import BackgroundServer
    from expertcache.serve.scheduler import Scheduler
    engine = Engine(None, EngineConfig(store="ram", max_seq=512))
    with BackgroundServer(create_app(Scheduler(engine), SERVED)) as s:
        yield s
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of `server`."""
    import openai
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
