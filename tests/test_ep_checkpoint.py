"""Checkpoints of expert-parallel runs (train/checkpoint.py, checkpoint_zero.py, _read.py):
stacked expert weights and their moments are written under their logical names and shapes, each
ep rank its slice of experts, so a checkpoint saved under parallel.ep resumes under another ep,
dp, tp or zero level (and one process) and continues the one-process run that never stopped
(losses to relative 1e-5); one process reads it whole. At zero 2 and 3 each rank writes the
moments of its shard of the expert buckets (over the expert replicas); under bf16 weights the
float32 main params, so bf16 and float32 runs resume each other across zero levels."""

import os

import pytest
import torch

from megapipe.train import checkpoint
from tests.parity import Pools
from tests.test_parity_bf16 import LOSS_REL
from tests.test_parity_moe import BF16
from tests.test_reshard import COMMON, _on, mesh, resume_case, save_case, uninterrupted

MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_aux_coef=0.01", "model.moe_z_coef=0.001"]
CAP = ["model.moe_capacity_factor=1.0"]
PAIRS = {  # id -> (saved under, resumed under, model overrides)
    "dp2-ep2-to-1": (mesh(dp=2, ep=2), mesh(), MOE),
    "1-to-dp2-ep2": (mesh(), mesh(dp=2, ep=2), [*MOE, *CAP]),
    "dp4-ep4-zero1-to-dp2-ep2": (mesh(dp=4, ep=4, zero=1), mesh(dp=2, ep=2), MOE),
    "dp2-ep2-tp2-to-dp4-ep2-zero1": (mesh(dp=2, tp=2, ep=2), mesh(dp=4, ep=2, zero=1), MOE),
    "dp2-ep2-zero3-to-dp4-ep4-zero2": (mesh(dp=2, ep=2, zero=3), mesh(dp=4, ep=4, zero=2), MOE),
    "dp4-ep2-zero2-to-1": (mesh(dp=4, ep=2, zero=2), mesh(), [*MOE, *CAP]),
    "dp4-ep4-zero3-to-dp2-ep2-zero1": (mesh(dp=4, ep=4, zero=3), mesh(dp=2, ep=2, zero=1), MOE),
    "1-to-dp2-ep2-tp2-zero3": (mesh(), mesh(dp=2, tp=2, ep=2, zero=3), MOE),
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


EP_MESH = ["parallel.dp=2", "parallel.ep=2", "parallel.microbatches=2"]
FP32 = ["train.params_dtype=float32", "train.dtype=float32"]


def cross_dtype_case(root: str) -> dict:
    """bf16 zero=3 over dp2 × ep2: 4 steps straight; 2 + 2 resumed; 2 steps then 2 as bf16
    zero=2 and as float32 zero=1; float32 zero=2 2 steps, then 2 as bf16 zero=3."""
    import train
    from tests.parity import tiny_config

    def run(where, *extra):
        cfg = tiny_config([*COMMON, *MOE, *EP_MESH, *BF16, *extra], f"{root}/{where}")
        return [r["loss"] for r in train.run(cfg)]

    stop = "train.stop_at_step=2"
    z1, z2, z3 = (f"parallel.zero={z}" for z in (1, 2, 3))
    return {
        "full": run("full", z3, "checkpoint.resume=none"),
        "split": run("split", z3, stop) + run("split", z3),
        "to_zero2": run("to_zero2", z3, stop) + run("to_zero2", z2),
        "to_fp32": run("to_fp32", z3, stop) + run("to_fp32", *FP32, z1),
        "from_fp32": run("from_fp32", *FP32, z2, stop) + run("from_fp32", z3),
    }


@pytest.mark.spawn
def test_ep_bf16_zero3_checkpoints_cross_load(gloo_pool, tmp_path):
    """A bf16 zero=3 checkpoint under ep holds float32 main params of every expert under
    logical names: it resumes bit for bit, under bf16 zero=2 (tests/test_parity_bf16.py's loss
    bound) and float32 zero=1 (1e-3, bf16's round-off), and the reverse."""
    got = gloo_pool(2).run(cross_dtype_case, str(tmp_path))[0]
    assert got["split"] == got["full"]
    bounds = {"to_zero2": LOSS_REL, "to_fp32": 1e-3, "from_fp32": 1e-3}
    for name, rel in bounds.items():
        for step, (a, b) in enumerate(zip(got[name], got["full"])):
            assert abs(a - b) <= rel * abs(b), f"{name} step {step}: {a} != {b}"
    path = checkpoint.complete_checkpoints(str(tmp_path / "split" / "checkpoints"))[0]
    _, whole = checkpoint.load_for_inference(path)
    experts = {n: p.detach() for n, p in whole.named_parameters() if ".experts." in n}
    assert experts and all(p.shape[0] == 4 and p.dtype == torch.float32 for p in experts.values())
    assert any((p != p.bfloat16().float()).any() for p in experts.values())  # main params
