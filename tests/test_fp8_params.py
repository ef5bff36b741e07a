"""FP8 weights under the distributed optimizer (train.fp8_params, parallel/data/fp8_params.py).

Holding an FP8 linear's weight as its cast alone changes what is stored, not what is computed:
the cast each rank gathers is the one the linear makes from the bf16 weight (the owned float32
main shard rounded to bf16, its scales' amax shared over the shard group and tp). So a run with
train.fp8_params takes the same steps as the run without, bit for bit: the same losses, the
same main params, on every mesh and recipe. A wrong amax group, a stale payload or a weight
left out of the rounding changes them at once. That run trains like one FP8 process
(tests/test_parity_fp8.py), so this one does too. The checkpoint path (whole float32 main
params written, read back into the shards and cast again) is taken between two steps.
"""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ConfigError
from tests.parity import LOW_LR, built_case, mesh_params

BF16 = ["train.params_dtype=bfloat16", "train.dtype=bfloat16", LOW_LR]
# no clip: its norm sums squares over shards that the FP8 buckets lay out otherwise
NO_CLIP = ["train.grad_clip=0"]
MB2 = ["parallel.microbatches=2"]
SP = ["parallel.sequence_parallel=true"]
CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("dp2-zero1-tensorwise", 2, 1, ["train.fp8=tensorwise", "parallel.zero=1", *MB2]),
        ("dp2-zero1-rowwise", 2, 1, ["train.fp8=rowwise", "parallel.zero=1", *MB2]),
        ("dp2-zero2-blockwise", 2, 1, ["train.fp8=blockwise", "parallel.zero=2", *MB2]),
    ],
    4: [
        ("dp2-tp2-sp-zero1-tensorwise", 2, 2, ["train.fp8=tensorwise", "parallel.zero=1", *SP]),
        ("dp2-tp2-sp-zero2-rowwise", 2, 2, ["train.fp8=rowwise", "parallel.zero=2", *SP]),
        # Zero Bubble's deferred W lands the weight grads in the main grads
        (
            "dp2-pp2-zb_h1-zero1-rowwise",
            2,
            1,
            [
                "train.fp8=rowwise",
                "parallel.zero=1",
                "parallel.pp=2",
                "parallel.schedule=zb_h1",
                "parallel.microbatches=4",
            ],
        ),  # fmt: skip
    ],
}


def held_case(overrides: list[str], steps: int = 3) -> dict:
    """`steps` steps, the checkpoint's round trip of the main params before the last: losses,
    the whole float32 main params by parameter order, and the bytes the weights hold."""
    from megapipe.parallel.data.zero3_fp8 import fp8_linears

    cfg, _, job, optimizer, data = built_case(overrides)
    params = [p for chunk in job.engine.chunks for p in chunk.parameters()]
    losses = []
    for step in range(steps):
        if step == steps - 1:  # a checkpoint's read: whole main params back into the shards
            targets = optimizer.load_targets()
            for key, whole in optimizer.main_weights().items():
                targets[key].copy_(whole)
            optimizer.restore_main(targets)
        batch = data.batch(step, cfg.train.global_batch)
        losses.append(job.train_step(optimizer, batch, step).loss)
    mains = optimizer.main_weights()
    return {
        "losses": losses,
        "mains": [mains[id(p)] for p in params],
        "weight_bytes": sum(p.untyped_storage().nbytes() for p in params),
        "held": sum(p.untyped_storage().nbytes() == 0 for p in params),
        "fp8_linears": sum(len(fp8_linears(chunk)) for chunk in job.engine.chunks),
    }


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_fp8_weights_take_the_same_steps(gloo_pool, world, dp, tp, extra):
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}", *BF16, *NO_CLIP, *extra]
    plain = gloo_pool(world).run(held_case, mesh)
    held = gloo_pool(world).run(held_case, [*mesh, "train.fp8_params=true"])
    for a, b in zip(held, plain):
        assert a["losses"] == b["losses"]
        for x, y in zip(a["mains"], b["mains"], strict=True):
            assert torch.equal(x, y)
        # the rank's FP8 linears (each layer's QKV, out, fc1, fc2) hold no bf16 weight
        assert b["held"] == 0 and a["held"] == a["fp8_linears"] >= 4
        assert a["weight_bytes"] < b["weight_bytes"]


@pytest.mark.parametrize(
    "overrides,names",
    [
        (["train.fp8_params=true", *BF16, "parallel.zero=1"], "train.fp8"),
        (["train.fp8_params=true", "train.fp8=tensorwise", "parallel.zero=1"], "params_dtype"),
        (
            ["train.fp8_params=true", "train.fp8=tensorwise", *BF16, "parallel.dp=2"],
            "parallel.zero",
        ),
        (
            [
                "train.fp8_params=true",
                "train.fp8=tensorwise",
                *BF16,
                "parallel.zero=1",
                "parallel.dp=2",
                "train.optimizer=muon",
            ],
            "train.optimizer",
        ),  # fmt: skip
    ],
)
def test_fp8_weights_refuse_what_they_cannot_hold(tiny_cfg, overrides, names):
    with pytest.raises(ConfigError, match=names):
        tiny_cfg(*overrides)


def run_losses(overrides: list[str], run_dir: str) -> list[float]:
    """train.run on this rank (a pool worker): each step's loss."""
    import train
    from tests.parity import tiny_config

    return [r["loss"] for r in train.run(tiny_config(overrides, run_dir))]


@pytest.mark.spawn
def test_fp8_weights_resume_and_are_resumed(gloo_pool, tmp_path):
    """train.py's loop under dp2 zero=1 (evaluation, checkpoints, the end's hooks): a run with FP8
    weights stopped at its step-2 checkpoint and resumed repeats the straight run bit for bit,
    and so does a run without them resumed from that checkpoint (it holds the float32 main
    params, no FP8 state), and the other way round."""
    import shutil

    pool = gloo_pool(2)
    common = ["parallel.dp=2", "parallel.zero=1", "train.fp8=tensorwise", *BF16, *NO_CLIP,
              "train.steps=4", "train.warmup=1", "log.progress=false", "checkpoint.interval=2",
              "train.eval_interval=2"]  # fmt: skip
    held, stop = ["train.fp8_params=true"], ["train.stop_at_step=2"]

    def run(where: str, *extra: str) -> list[float]:
        return pool.run(run_losses, [*common, *extra], str(tmp_path / where))[0]

    full = run("full", *held)
    first = run("split", *held, *stop)
    shutil.copytree(tmp_path / "split", tmp_path / "to_plain")
    assert first + run("split", *held) == full
    assert first + run("to_plain") == full
    assert run("from_plain", *stop) + run("from_plain", *held) == full


def test_the_planner_holds_fp8_weights_where_a_candidate_can(tiny_cfg):
    """A config with train.fp8_params: the planner's candidates keep it where they hold FP8
    weights under the distributed optimizer, drop it elsewhere (zero=0, no replicas, FP8 off),
    and every candidate the rules allow stays in the space."""
    from megapipe.perf.space import candidates

    base = tiny_cfg(*BF16, "train.fp8=tensorwise", "train.fp8_params=true",
                    "parallel.dp=2", "parallel.zero=1")  # fmt: skip
    fixed = {"parallel.tp": 1, "parallel.cp": 1, "parallel.pp": 1}
    every = candidates(base, 2, 2, fixed, fp8s=("none", "tensorwise"))
    configs = [c.config(base) for c in every]  # none refused
    assert {c.parallel.zero for c in configs} >= {0, 1}
    for c in configs:
        sharded = c.parallel.zero >= 1 and c.parallel.dp * c.parallel.cp > 1
        assert c.train.fp8_params == (sharded and c.train.fp8 != "none")


def test_search_takes_fp8_recipes(capsys, tmp_path):
    """`tools/plan.py search --fp8 none,tensorwise`: both recipes ranked (the table's fp8
    column), FP8 weights held where the candidate can (`+params`); an unknown recipe is one
    line."""
    from megapipe.cli import plan as plan_cli

    base = ["--config", "configs/tiny.yaml", "--gpus", "2", "--gpu", "h100",
            "--out", str(tmp_path / "best.yaml"), "--top", "400", "--train.fp8=tensorwise",
            "--train.fp8_params=true", *(f"--{o}" for o in BF16)]  # fmt: skip
    assert plan_cli.main(["search", *base, "--fp8", "none,tensorwise"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    fp8 = {(r[11], r[12]) for r in rows if len(r) > 12 and r[1].strip().isdigit()}
    assert {("0", "-"), ("0", "tensorwise"), ("1", "tensorwise+params"), ("1", "-")} <= fp8
    assert ("1", "tensorwise") not in fp8 and ("0", "tensorwise+params") not in fp8
    assert plan_cli.main(["search", *base, "--fp8", "fp4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fp8" in err and "tensorwise" in err
