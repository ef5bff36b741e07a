"""Checkpoints of expert-parallel runs (train/checkpoint.py, checkpoint_zero.py, _read.py):
stacked expert weights and their moments are written under their logical names and shapes, each
ep rank its slice of experts, so a checkpoint saved under parallel.ep resumes under another ep,
dp, tp or zero level (and one process) and continues the one-process run that never stopped
(losses to relative 1e-5); one process reads it whole."""

import os

import pytest
import torch

from megapipe.train import checkpoint
from tests.parity import Pools
from tests.test_reshard import COMMON, _on, mesh, resume_case, save_case, uninterrupted

MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_aux_coef=0.01", "model.moe_z_coef=0.001"]
CAP = ["model.moe_capacity_factor=1.0"]
PAIRS = {  # id -> (saved under, resumed under, model overrides)
    "dp2-ep2-to-1": (mesh(dp=2, ep=2), mesh(), MOE),
    "1-to-dp2-ep2": (mesh(), mesh(dp=2, ep=2), [*MOE, *CAP]),
    "dp4-ep4-zero1-to-dp2-ep2": (mesh(dp=4, ep=4, zero=1), mesh(dp=2, ep=2), MOE),
    "dp2-ep2-tp2-to-dp4-ep2-zero1": (mesh(dp=2, tp=2, ep=2), mesh(dp=4, ep=2, zero=1), MOE),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{pair id: run dir holding its step-2 checkpoint}, saves grouped by world size."""
    pools, root, out = Pools(), tmp_path_factory.mktemp("ep_reshard"), {}
    try:
        for name, ((world, first), _, model) in sorted(PAIRS.items(), key=lambda p: p[1][0][0]):
            out[name] = str(root / name)
            _on(pools, world, save_case, [*COMMON, *model, *first], out[name])
    finally:
        pools.close()
    return out


@pytest.mark.spawn
@pytest.mark.parametrize("name", sorted(PAIRS, key=lambda name: PAIRS[name][1][0]))
def test_resume_across_ep_continues_the_one_process_run(gloo_pool, saved, name):
    _, (world, then), model = PAIRS[name]
    assert os.path.isdir(os.path.join(saved[name], "checkpoints"))
    (losses, *_) = _on(gloo_pool, world, resume_case, [*COMMON, *model, *then], saved[name])
    expected = uninterrupted(tuple(model))[2:]
    assert len(losses) == len(expected) == 2
    for step, (a, b) in enumerate(zip(losses, expected), start=3):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: resumed {a} != uninterrupted {b}"


@pytest.mark.spawn
def test_ep_checkpoint_holds_logical_experts(saved):
    path = checkpoint.complete_checkpoints(os.path.join(saved["dp2-ep2-to-1"], "checkpoints"))
    _, whole = checkpoint.load_for_inference(path[-1])  # one process, no mesh
    experts = {n: p for n, p in whole.named_parameters() if ".experts." in n}
    assert experts and all(p.shape[0] == 4 for p in experts.values())
    for n, p in experts.items():  # every expert written (none left at the load's zeros)
        assert all(bool(p[e].abs().sum() > 0) or n.endswith("bias") for e in range(4)), n
    assert all(torch.isfinite(p).all() for p in experts.values())
