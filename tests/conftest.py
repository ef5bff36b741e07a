"""Test-wide settings: nothing may reach for the network; one thread, as in CI."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


SPAWNING_FIXTURES = {"gloo_pool", "runs"}  # each starts a group of worker processes


def pytest_collection_modifyitems(items):
    """The quick tier (`-m "not spawn"`) leaves out every test that starts processes: those
    using a spawning fixture are marked here, the others carry @pytest.mark.spawn."""
    for item in items:
        if SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.spawn)


@pytest.fixture
def tiny_cfg(tmp_path):
    """Build a tiny config (configs/tiny.yaml) writing into tmp_path, with extra overrides."""
    from megapipe.config import load_config

    def make(*overrides: str):
        return load_config(TINY, [f"run.dir={tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture(scope="session")
def gloo_pool():
    """`gloo_pool(world)`: a tests.parity.WorkerPool of `world` gloo ranks, reused per size."""
    from tests.parity import Pools

    pools = Pools()
    yield pools
    pools.close()
