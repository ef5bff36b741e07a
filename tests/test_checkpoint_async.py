"""checkpoint.async_save: the checkpoint holds the weights of the step it was taken at, although
training changed them while it was written, and it resumes like a synchronous one."""

import pytest

from tests.parity import tiny_config

MESHES = {
    "one-process": (1, []),
    "dp2-zero1": (2, ["parallel.dp=2", "parallel.zero=1"]),
    "tp2": (2, ["parallel.tp=2"]),
}


def async_case(overrides: list[str], run_dir: str) -> dict:
    """Train 2 steps, start an async save, train a 3rd step while it is written, wait; then
    load it into a fresh job: the loaded weights and moments are those after step 2."""
    import torch

    from megapipe.data.loader import build_data
    from megapipe.distributed.launch import init_distributed
    from megapipe.train import checkpoint
    from megapipe.train.build import build
    from megapipe.train.checkpoint_async import Saver

    cfg = tiny_config([*overrides, "checkpoint.async=true"], run_dir)
    mesh = init_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    job, data = build(cfg, mesh), build_data(cfg.data, cfg.model, cfg.train.seed)
    optimizer, saver = job.optimizer(), Saver(cfg)
    for step in range(2):
        job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
    with job.full_weights():  # zero=1 gathers the weights on first use after the step
        at_save = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    path = saver.save(2, job.model, optimizer)
    job.train_step(optimizer, data.batch(2, cfg.train.global_batch), 2)  # while it is written
    assert saver.wait() == path
    fresh = build(cfg, mesh)
    fresh_optimizer = fresh.optimizer()
    checkpoint.load(checkpoint.resume_path(cfg), cfg, fresh.model, fresh_optimizer)
    loaded = dict(fresh.model.named_parameters())
    with job.full_weights():
        moved = any(not torch.equal(p, at_save[n]) for n, p in job.model.named_parameters())
    return {"same": all(torch.equal(loaded[n], w) for n, w in at_save.items()), "moved": moved}


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(MESHES))
def test_async_checkpoint_holds_the_step_it_was_taken_at(gloo_pool, tmp_path, name):
    world, overrides = MESHES[name]
    args = ([*overrides, "train.steps=3", "log.progress=false"], str(tmp_path))
    results = [async_case(*args)] if world == 1 else gloo_pool(world).run(async_case, *args)
    for got in results:
        assert got["moved"]  # training did change the weights during the write
        assert got["same"]  # the checkpoint has them as they were at the save
