"""Mesh errors: one line each, naming the keys, raised before any collective could hang."""

import pytest

import train
from megapipe.config import ConfigError, load_config
from tests.conftest import TINY
from tests.parity import tiny_config


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=8"], "model.n_heads=4 must be divisible by parallel.tp=8"),
        (["model.n_heads=8", "model.n_kv_heads=2", "parallel.tp=8"], None),  # replicated kv: ok
        (["model.n_heads=12", "model.d_model=48", "model.n_kv_heads=3", "parallel.tp=2"],
         "model.n_kv_heads=3 and parallel.tp=2: one must divide the other"),
        (["model.n_heads=12", "model.d_model=48", "model.n_kv_heads=6", "parallel.tp=4"],
         "model.n_kv_heads=6 and parallel.tp=4"),
        (["parallel.dp=4", "parallel.microbatches=4"],
         "train.global_batch=8 must be divisible by parallel.dp·parallel.microbatches=16"),
        (["parallel.dp=3"], "train.global_batch=8 must be divisible by"),
        (["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=18"],
         "parallel.sequence_parallel needs model.seq_len=18 divisible by parallel.tp=4"),
    ],
)  # fmt: skip
def test_mesh_config_errors(overrides, expected):
    if expected is None:
        load_config(TINY, overrides)
        return
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_world_size_mismatch_before_any_collective(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun --nproc_per_node=3 would set
    code = train.main(["--config", TINY, f"--run.dir={tmp_path}", "--parallel.dp=2",
                       "--parallel.tp=2"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "world size 3 != dp·pp·cp·tp = 4" in err and "dp=2" in err and "tp=2" in err
    assert not dist.is_initialized()  # refused before the process group existed


def other_mesh_case(root: str) -> dict:
    """Write a checkpoint under dp=2 tp=2; resume it under tp=4 (resharded), and under tp=4
    with another model (the error message, on every rank alike)."""
    from megapipe.train.checkpoint import CheckpointError

    common = ["train.steps=3", "log.progress=false"]
    train.run(
        tiny_config([*common, "parallel.dp=2", "parallel.tp=2", "train.stop_at_step=1"], root)
    )
    out = {}
    try:
        train.run(tiny_config([*common, "parallel.tp=4", "model.n_layers=3"], root))
        out["error"] = "no error"
    except CheckpointError as e:
        out["error"] = str(e)
    resumed = train.run(tiny_config([*common, "parallel.tp=4", "train.stop_at_step=2"], root))
    out["steps"] = [r["step"] for r in resumed]
    return out


@pytest.mark.spawn
def test_checkpoint_from_other_mesh_under_torchrun(gloo_pool, tmp_path):
    for got in gloo_pool(4).run(other_mesh_case, str(tmp_path)):
        assert "\n" not in got["error"]
        assert "written with model.n_layers=2 but this run has model.n_layers=3" in got["error"]
        assert got["steps"] == [2]  # dp=2 × tp=2 resumed under tp=4
