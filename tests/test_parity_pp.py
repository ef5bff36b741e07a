"""Parity: pipeline schedules (alone and mixed with dp or tp) train the same model as one process:
same per-step loss, grad norm and final logical weights to relative 1e-5
(docs/architecture.md, Invariants).

Each rank returns the logical tensors of its chunks; the union over ranks is the whole model,
and every tensor held by several ranks (dp and tp replicas, the tied embedding's last-stage copy)
must agree exactly. Cases are grouped by world size so each size spawns its workers once.
"""

from functools import cache

import pytest
import torch

from megapipe.config import ConfigError
from tests.parity import mesh_params, reference_case, tiny_config, train_case
from tests.util import PARITY_REL, assert_rel_close, assert_state_close

LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
GQA2 = [*LLAMA, "model.n_kv_heads=2"]
SP = ["parallel.sequence_parallel=true"]
# QK-norm gains (models/qk_norm.py): replicated, their grads summed over tp; head_dim 24 != 64/4
QWEN3 = ["model.arch=qwen3", "model.tie_embeddings=false", "model.d_ff=64", "model.head_dim=24"]
B12 = ["train.global_batch=12"]  # room for 3 or 6 microbatches: m not a multiple of pp
L4, L6 = ["model.n_layers=4"], ["model.n_layers=6"]
B2 = ["parallel.schedule_costs=F=1,B=2,W=1"]  # a schedule built for these costs


def pp(schedule: str, p: int, m: int, vpp: int = 1) -> list[str]:
    return [
        f"parallel.schedule={schedule}",
        f"parallel.pp={p}",
        f"parallel.microbatches={m}",
        f"parallel.vpp={vpp}",
    ]


CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("gpipe-m2", 1, 1, pp("gpipe", 2, 2)),
        ("gpipe-m3-llama", 1, 1, [*pp("gpipe", 2, 3), *B12, *LLAMA]),
        ("1f1b-m1", 1, 1, pp("1f1b", 2, 1)),
        ("1f1b-m3", 1, 1, [*pp("1f1b", 2, 3), *B12]),
        ("1f1b-m4-llama", 1, 1, [*pp("1f1b", 2, 4), *LLAMA]),
        ("1f1b-m2-llama-muon", 1, 1, [*pp("1f1b", 2, 2), *LLAMA, "train.optimizer=muon"]),
        ("interleaved-m1", 1, 1, pp("interleaved_1f1b", 2, 1, 2)),
        ("interleaved-m4", 1, 1, pp("interleaved_1f1b", 2, 4, 2)),
        ("interleaved-m3-llama", 1, 1, [*pp("interleaved_1f1b", 2, 3, 2), *B12, *LLAMA]),
        ("zb_h1-m4", 1, 1, pp("zb_h1", 2, 4)),
        ("zb_h1-m1-llama", 1, 1, [*pp("zb_h1", 2, 1), *LLAMA]),
        ("zb_h2-m3", 1, 1, [*pp("zb_h2", 2, 3), *B12]),
        ("zb_v-m2", 1, 1, pp("zb_v", 2, 2, 2)),
        (
            "zb_v-m6-built-for-costs",
            1,
            1,
            [*pp("zb_v", 2, 6, 2), *B12, "parallel.schedule_costs=F=1,B=1.5,W=0.5"],
        ),
        (
            "zb_v-m3-llama-full-recompute",
            1,
            1,
            [*pp("zb_v", 2, 3, 2), *B12, *LLAMA, "recompute.mode=full"],
        ),
        ("zb_auto-m4", 1, 1, pp("zb_auto", 2, 4)),
        ("v_half-m4", 1, 1, pp("v_half", 2, 4, 2)),
        ("v_min-m3-llama-built-for-costs", 1, 1, [*pp("v_min", 2, 3, 2), *B12, *LLAMA, *B2]),
        ("dualpipe_v-m4", 1, 1, pp("dualpipe_v", 2, 4, 2)),
        ("dualpipe-m4", 1, 1, pp("dualpipe", 2, 4, 2)),
        ("dualpipe-m6-llama", 1, 1, [*pp("dualpipe", 2, 6, 2), *B12, *LLAMA]),
        (
            "dualpipe_v-m6-llama-sel",
            1,
            1,
            [*pp("dualpipe_v", 2, 6, 2), *B12, *LLAMA, "recompute.mode=selective"],
        ),
        (
            "zb_auto-m3-2p-llama",
            1,
            1,
            [*pp("zb_auto", 2, 3), *B12, *LLAMA, "parallel.zb_memory=2p"],
        ),
        (
            "zb_auto-m6-3-built-for-costs",
            1,
            1,
            [
                *pp("zb_auto", 2, 6),
                *B12,
                "parallel.schedule_costs=F=1,B=1.5,W=0.5,comm=0.1",
                "parallel.zb_memory=3",
            ],
        ),
        ("1f1b-m2-selective-recompute", 1, 1, [*pp("1f1b", 2, 2), "recompute.mode=selective"]),
        (
            "zb_h1-m2-llama-selective-recompute",
            1,
            1,
            [*pp("zb_h1", 2, 2), *LLAMA, "recompute.mode=selective"],
        ),
        (
            "zb_h1-m2-llama-mlp-recompute",
            1,
            1,
            [*pp("zb_h1", 2, 2), *LLAMA, "recompute.mode=selective", "recompute.modules=mlp"],
        ),
        ("1f1b-m2-balance-llama3", 1, 1, [*pp("1f1b", 2, 2), *L4, "parallel.balance=llama3"]),
        ("1f1b-m2-balance-cost", 1, 1, [*pp("1f1b", 2, 2), *L4, "parallel.balance=cost"]),
        ("gpipe-m2-layout-uneven", 1, 1, [*pp("gpipe", 2, 2), *L4, "parallel.balance=E,t|t,t,t,L"]),
        (
            "interleaved-m2-layout",
            1,
            1,
            [*pp("interleaved_1f1b", 2, 2, 2), *L4, "parallel.balance=E,t|t|t|t,L"],
        ),
    ],
    4: [
        ("pp4-gpipe-m2", 1, 1, [*pp("gpipe", 4, 2), *L4]),
        ("pp4-1f1b-m6-llama", 1, 1, [*pp("1f1b", 4, 6), *B12, *LLAMA, *L4]),
        ("pp4-1f1b-m8", 1, 1, [*pp("1f1b", 4, 8), *L4]),
        ("pp4-1f1b-m4-one-block-a-stage", 1, 1, pp("1f1b", 4, 4)),  # E | t | t | L
        ("pp4-interleaved-m4", 1, 1, [*pp("interleaved_1f1b", 4, 4, 2), *L6]),
        ("pp4-interleaved-m6-llama", 1, 1, [*pp("interleaved_1f1b", 4, 6, 2), *B12, *LLAMA, *L6]),
        ("dp2-pp2-1f1b-m2", 2, 1, pp("1f1b", 2, 2)),
        ("dp2-pp2-interleaved-m3-llama", 2, 1, [*pp("interleaved_1f1b", 2, 3, 2), *B12, *LLAMA]),
        ("pp2-tp2-1f1b-m2-sp", 1, 2, [*pp("1f1b", 2, 2), *SP]),
        ("pp2-tp2-interleaved-gqa-sp", 1, 2, [*pp("interleaved_1f1b", 2, 4, 2), *GQA2, *SP]),
        ("pp4-zb_h1-m4", 1, 1, [*pp("zb_h1", 4, 4), *L4]),
        ("pp4-zb_h2-m6-llama", 1, 1, [*pp("zb_h2", 4, 6), *B12, *LLAMA, *L4]),
        ("pp4-zb_v-m4", 1, 1, [*pp("zb_v", 4, 4, 2), *L6]),
        ("pp4-zb_v-m2-llama", 1, 1, [*pp("zb_v", 4, 2, 2), *LLAMA, *L6]),
        ("pp4-dualpipe_v-m8", 1, 1, [*pp("dualpipe_v", 4, 8, 2), *L6]),
        ("pp4-dualpipe-m8", 1, 1, [*pp("dualpipe", 4, 8, 2), *L6]),
        ("dp2-pp2-dualpipe-m4", 2, 1, pp("dualpipe", 2, 4, 2)),
        ("pp2-tp2-dualpipe-gqa-sp", 1, 2, [*pp("dualpipe", 2, 4, 2), *GQA2, *SP]),
        ("dp2-pp2-dualpipe_v-m4", 2, 1, pp("dualpipe_v", 2, 4, 2)),
        ("pp2-tp2-dualpipe_v-gqa-sp", 1, 2, [*pp("dualpipe_v", 2, 4, 2), *GQA2, *SP]),
        ("dp2-pp2-zb_h2-m2", 2, 1, pp("zb_h2", 2, 2)),
        ("pp4-v_min-m8", 1, 1, [*pp("v_min", 4, 8, 2), *L6]),
        ("pp4-v_half-m6-llama", 1, 1, [*pp("v_half", 4, 6, 2), *B12, *LLAMA, *L6]),
        ("dp2-pp2-v_min-m2", 2, 1, pp("v_min", 2, 2, 2)),
        ("pp2-tp2-v_half-gqa-sp", 1, 2, [*pp("v_half", 2, 4, 2), *GQA2, *SP]),
        ("pp4-zb_auto-m8", 1, 1, [*pp("zb_auto", 4, 8), *L6]),
        (
            "pp4-zb_auto-m8-2p-selective",
            1,
            1,
            [*pp("zb_auto", 4, 8), *L6, "parallel.zb_memory=2p", "recompute.mode=selective"],
        ),
        ("dp2-pp2-zb_auto-m4-2p", 2, 1, [*pp("zb_auto", 2, 4), "parallel.zb_memory=2p"]),
        ("pp2-tp2-zb_auto-gqa-sp", 1, 2, [*pp("zb_auto", 2, 4), *GQA2, *SP]),
        ("pp2-tp2-zb_v-gqa-sp", 1, 2, [*pp("zb_v", 2, 4, 2), *GQA2, *SP]),
        (
            "pp2-tp2-zb_v-qwen3-gqa-sp",
            1,
            2,
            [*pp("zb_v", 2, 4, 2), *QWEN3, "model.n_kv_heads=2", *SP],
        ),
        ("pp4-1f1b-m4-balance-llama3", 1, 1, [*pp("1f1b", 4, 4), *L6, "parallel.balance=llama3"]),
        (
            "pp4-zb_v-m4-balance-cost-selective",
            1,
            1,
            [*pp("zb_v", 4, 4, 2), *L6, "parallel.balance=cost", "recompute.mode=selective"],
        ),
    ],
}
SLOW = {
    8: [
        ("dp2-pp2-tp2-1f1b-gqa-sp", 2, 2, [*pp("1f1b", 2, 2), *GQA2, *SP]),
        ("pp4-tp2-interleaved-gqa", 1, 2, [*pp("interleaved_1f1b", 4, 4, 2), *GQA2, *L6]),
        ("pp8-1f1b-m4", 1, 1, [*pp("1f1b", 8, 4), *L6]),
        ("dp2-pp4-gpipe-llama", 2, 1, [*pp("gpipe", 4, 4), *LLAMA, *L4]),
        ("dp2-pp2-tp2-zb_v-gqa-sp", 2, 2, [*pp("zb_v", 2, 2, 2), *GQA2, *SP]),
        ("pp8-zb_h2-m4", 1, 1, [*pp("zb_h2", 8, 4), *L6]),
    ]
}


@cache
def reference(extra: tuple[str, ...], dp: int) -> dict:
    """One process: the same model and data, no pipeline, in the same microbatches of rows
    (dp·m of them), so only the order of the sums differs."""
    keep = [o for o in extra if not o.startswith("parallel.")]
    (m,) = [int(o.split("=")[1]) for o in extra if o.startswith("parallel.microbatches=")]
    return reference_case([*keep, f"parallel.microbatches={dp * m}"])


def union_of_ranks(results: list[dict]) -> dict:
    """The whole model from every rank's chunks; shared tensors must agree exactly."""
    out = {}
    for rank, got in enumerate(results):
        for name, value in got["weights"].items():
            if name in out:
                assert torch.equal(out[name], value), f"rank {rank}: copies of {name} differ"
            out[name] = value
    return out


def check_parity(gloo_pool, world, dp, tp, extra, weight_rel: float = PARITY_REL):
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    results = gloo_pool(world).run(train_case, [*extra, *mesh])
    ref = reference(tuple(extra), dp)
    for rank, got in enumerate(results):
        assert got["dp_spread"] == 0.0, f"rank {rank}: dp replicas differ"
        assert got["events"] == got["actions"], f"rank {rank}: ran out of schedule order"
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} != {b}"
        assert_rel_close(*map(_t, (got["grad_norms"], ref["grad_norms"])), name="grad norms")
    split = any(a.startswith("W") for a in results[0]["actions"])  # zero bubble: W did matmuls
    deferred = sum(got["deferred_matmuls"] for got in results)
    assert (deferred > 0) == split, f"{deferred} weight-grad matmuls deferred to W actions"
    weights = union_of_ranks(results)
    assert_state_close(weights, ref["weights"], weight_rel, ref["adam_reach"], ref["exact"])


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_pipeline_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.slow
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(SLOW))
def test_pipeline_trains_like_one_process_8_ranks(gloo_pool, world, dp, tp, extra):
    check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (pp("interleaved_1f1b", 2, 2), "interleaved_1f1b needs parallel.vpp >= 2"),
        (pp("zb_v", 2, 2), "zb_v needs parallel.vpp=2"),
        (pp("v_min", 2, 2), "v_min needs parallel.vpp=2"),
        (pp("dualpipe_v", 2, 2, 2), r"dualpipe_v needs parallel.microbatches >= 2\*pp = 4, got 2"),
        ([*pp("dualpipe", 3, 6, 2), *B12, *L4], "dualpipe needs an even pp"),
        ([*pp("zb_v", 2, 2, 3), *L6], "zb_v needs parallel.vpp=2"),
        (pp("1f1b", 2, 2, 2), "runs one chunk per rank"),
        (pp("1f1b", 5, 1), "5 stages but the model has only 2 layers"),
        (
            [*pp("zb_v", 2, 2, 2), "parallel.schedule_costs=F=1,B=fast"],
            "parallel.schedule_costs='F=1,B=fast': could not convert",
        ),
        ([*pp("zb_v", 2, 2, 2), "parallel.schedule_costs=F=1,B=0,W=1"], "needs F, B and W all > 0"),
        (pp("interleaved_1f1b", 2, 2, 4), "8 stages but the model has only 2 layers"),
    ],
)
def test_bad_pipeline_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)


def run_train(overrides: list[str], run_dir: str) -> list[float]:
    """train.run on this rank (a pool worker): the losses it logged."""
    import train

    return [r["loss"] for r in train.run(tiny_config(overrides, run_dir))]


def test_train_py_runs_the_pipeline_and_rank0_logs_the_loss(gloo_pool, tmp_path):
    import json

    extra = [*pp("interleaved_1f1b", 2, 2, 2), "train.steps=2"]
    per_rank = gloo_pool(2).run(run_train, extra, str(tmp_path))
    ref = run_train(["parallel.microbatches=2", "train.steps=2"], str(tmp_path / "one"))
    assert per_rank[0] == per_rank[1], "every rank logs the same loss"
    assert_rel_close(_t(per_rank[0]), _t(ref), name="losses")
    with open(tmp_path / "metrics.jsonl") as f:
        logged = [json.loads(line)["loss"] for line in f]
    assert logged == per_rank[0]


def held_output_elements(overrides: list[str]) -> list[int]:
    """One gpipe step (a pool worker): after each action, the elements of the stage outputs
    this rank's stash still holds (Megatron's deallocate_output_tensor frees them once sent)."""
    import tempfile

    from megapipe.data.loader import build_data
    from megapipe.pipeline.runtime import Hooks
    from megapipe.train.optim import build_optimizer
    from megapipe.train.parallelize import parallelize
    from tests.parity import build_mesh

    class Held(Hooks):  # after each action: the elements the stash still holds
        def after(self, action):
            held.append(sum(out.numel() for _, out in job.engine.runtime.stash.values()))

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    job = parallelize(cfg, build_mesh(cfg), "cpu", 0.01)
    held = []
    job.engine.hooks = Held()
    batch = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    job.train_step(build_optimizer(job.model, cfg.train), batch, 0)
    return held


def test_sent_outputs_keep_no_values_until_backward(gloo_pool):
    held = gloo_pool(2).run(held_output_elements, pp("gpipe", 2, 4))
    # Rank 0 (stage 0) holds 4 forwards before its first backward: one element each, not
    # (b=2, T=16, d=32) = 1024; the last stage's outputs are its scalar losses.
    assert held[0][:4] == [1, 2, 3, 4]
    assert held[1][:4] == [1, 2, 3, 4]
    assert held[0][-1] == held[1][-1] == 0


def unordered_train_case(overrides: list[str]) -> dict:
    """train_case (a pool worker) with receives posted on demand, not in the senders' order."""
    from megapipe.pipeline import engine

    order = engine.arrival_order
    engine.arrival_order = lambda *args: {}
    try:
        return train_case(overrides)
    finally:
        engine.arrival_order = order


def test_tagless_receives_must_follow_the_senders_order(gloo_pool):
    """Messages carry no tag (as under NCCL), so gloo matches each rank pair in issue order.
    zb_v at m=3 consumes a channel out of its send order (test_channels): posted on demand,
    receives take the wrong tensors; in the sender's order (arrival_order) they train at parity
    (the w2-zb_v-m3 case above)."""
    extra = [*pp("zb_v", 2, 3, 2), *B12, "parallel.dp=1", "parallel.tp=1"]
    results = gloo_pool(2).run(unordered_train_case, extra)
    ref = reference(tuple(extra[:-2]), 1)
    assert abs(results[0]["losses"][-1] / ref["losses"][-1] - 1) > 1e-4
