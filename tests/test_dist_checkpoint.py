"""Checkpoints under a dp × cp × tp mesh: sharded by logical name, resume bitwise, read whole."""

import os

import pytest
import torch

from megapipe.train import checkpoint
from tests.parity import tiny_config

COMMON = ["model.dropout=0.1", "train.steps=4", "train.warmup=1", "log.progress=false"]
MESHES = {
    "dp2-tp2-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp4-llama-kv-replicated-v97": [
        "parallel.tp=4",
        "model.arch=llama",
        "model.n_kv_heads=2",
        "model.vocab_size=97",
        "model.tie_embeddings=false",
        "recompute.mode=full",
    ],  # fmt: skip
    "cp2-tp2-sp-gqa": [  # ring attention has no dropout: cp runs need model.dropout=0
        "parallel.cp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "model.dropout=0.0",
        "model.arch=llama",
        "model.n_kv_heads=2",
        "model.tie_embeddings=false",
    ],  # fmt: skip
}


def resume_case(overrides: list[str], root: str) -> dict:
    """Run 4 steps straight, then 2 + 2 with a checkpoint between; losses of both, and the
    final weights gathered by logical name."""
    import train

    full = train.run(tiny_config([*overrides, "checkpoint.resume=none"], f"{root}/full"))
    split = f"{root}/split"
    first = train.run(tiny_config([*overrides, "train.stop_at_step=2"], split))
    second = train.run(tiny_config(overrides, split))
    return {
        "full": [r["loss"] for r in full],
        "split": [r["loss"] for r in first + second],
        "checkpoints": checkpoint.complete_checkpoints(f"{split}/checkpoints"),
    }


def weights_case(overrides: list[str], root: str) -> dict:
    """Train 2 steps, save; the gathered logical weights."""
    import train
    from megapipe.distributed.launch import init_distributed
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.pipeline.stages import build_model
    from megapipe.train.optim import build_optimizer

    cfg = tiny_config([*overrides, "train.stop_at_step=2"], f"{root}/w")
    train.run(cfg)
    mesh = init_distributed(cfg)
    model = build_model(cfg, mesh)
    path = checkpoint.resume_path(cfg)
    checkpoint.load(path, cfg, model, build_optimizer(model, cfg.train))
    return {"weights": gather_logical(model), "path": path}


@pytest.mark.parametrize("name", list(MESHES))
def test_resume_under_mesh_is_bitwise(gloo_pool, tmp_path, name):
    results = gloo_pool(4).run(resume_case, [*COMMON, *MESHES[name]], str(tmp_path))
    got = results[0]
    assert got["checkpoints"]
    assert got["split"] == got["full"]  # bit for bit, dropout (both RNG streams) included
    assert all(r["full"] == got["full"] for r in results)  # every rank reports the same loss
    assert os.listdir(tmp_path / "split") and (tmp_path / "split" / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_checkpoint_holds_logical_tensors(gloo_pool, tmp_path, name):
    results = gloo_pool(4).run(weights_case, [*COMMON, *MESHES[name]], str(tmp_path))
    _, whole = checkpoint.load_for_inference(results[0]["path"])  # one process, no mesh
    expected = results[0]["weights"]
    got = {n: p.detach() for n, p in whole.named_parameters()}
    assert sorted(got) == sorted(expected)
    for n in expected:
        assert torch.equal(got[n], expected[n]), n
