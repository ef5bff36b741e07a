"""Optimizer post-validation (Zero Bubble §4, train/post_validation.py): the same model as the
synchronous step, with steps where clipping is active (the optimistic step of the first stage
is wrong and redone), a step with an inf gradient on the last stage (the first stage stepped
before it could know, so it rolls back) and one with a NaN on the first stage (every stage
skips at once); no global all-reduce runs in a post-validated step; config rules.

Both paths run on the same 2-rank mesh in one spawned pool; the synchronous path's parity with
one process is tests/test_parity_pp.py's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megapipe.cli import schedule as schedule_cli
from megapipe.config import ConfigError
from tests.parity import built_case, tiny_config
from tests.util import assert_rel_close, assert_state_close

STEPS = 5
PV = "parallel.post_validation=true"


def _pp(schedule: str, m: int, vpp: int = 1) -> list[str]:
    return [
        "parallel.pp=2",
        f"parallel.schedule={schedule}",
        f"parallel.microbatches={m}",
        f"parallel.vpp={vpp}",
    ]


def pv_case(overrides: list[str], poison: dict | None = None) -> dict:
    """Train STEPS steps; `poison` {step: (pp rank, value)} turns that rank's first gradient
    into `value` (inf, NaN) at that step. Final per-step figures, weights, redo flags and the
    number of all_reduce calls made inside train steps."""
    import torch.distributed as dist

    from megapipe.parallel.tensor.gather import gather_logical

    cfg, mesh, job, optimizer, data = built_case(overrides)
    finals, calls = [], []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        for step in range(STEPS):
            hook = _poison(job, mesh, (poison or {}).get(step))
            result = job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
            if hook is not None:
                hook.remove()
            if result.previous is not None:
                finals.append(result.previous)
            if result.final:
                finals.append(result)
        last = job.settle(optimizer)
    finally:
        dist.all_reduce = real
    if last is not None:
        finals.append(last)
    weights = {}
    for chunk in job.engine.chunks:
        weights.update(gather_logical(chunk))
        for name, buf in chunk.named_buffers():  # deepseek_v3's selection biases
            if name.endswith("routing.bias"):
                weights[name] = buf.clone()
    pipe = job.engine.inner if job.post_validated else job.engine  # the Pipeline it wraps
    validator = job.engine.validator if job.post_validated else None
    return {
        "losses": [r.loss for r in finals],
        "norms": [r.grad_norm for r in finals],
        "skipped": [r.skipped for r in finals],
        "weights": weights,
        "redone": [e.redone for e in validator.evidence] if validator else [],
        "all_reduce_calls": len(calls),
        "events": [str(e.action) for e in getattr(job.engine, "events", [])],
        "actions": [str(a) for a in getattr(pipe, "actions", [])],  # none on one process
    }


def _poison(job, mesh, what):
    """`what` (pp rank, value); one process (mesh None) holds every stage's weights."""
    if what is None or (mesh is not None and mesh.coord("pp") != what[0]):
        return None
    param = next(job.engine.chunks[0].parameters())
    value = what[1]
    return param.register_hook(lambda g: torch.full_like(g, value))


def both(gloo_pool, overrides: list[str], poison: dict | None = None) -> tuple[list, list]:
    pool = gloo_pool(2)
    sync = pool.run(pv_case, overrides, poison)
    post = pool.run(pv_case, [*overrides, PV], poison)
    return sync, post


def assert_same_training(sync: list, post: list) -> None:
    for rank, (a, b) in enumerate(zip(sync, post)):
        assert b["skipped"] == a["skipped"], f"rank {rank}"
        assert len(b["losses"]) == len(a["losses"]) == STEPS
        fin = [i for i, s in enumerate(a["skipped"]) if not s]
        for key in ("losses", "norms"):
            got, ref = (torch.tensor([r[key][i] for i in fin]) for r in (b, a))
            assert_rel_close(got, ref, name=key)
        assert b["events"] == b["actions"], f"rank {rank}: ran out of schedule order"
    union = lambda rs: {k: v for r in rs for k, v in r["weights"].items()}  # noqa: E731
    assert_state_close(union(post), union(sync), reach=3e-3 * STEPS)


@pytest.mark.parametrize(
    "schedule",
    [
        _pp("1f1b", 4),
        _pp("zb_h2", 4),
        [*_pp("zb_auto", 4), "parallel.schedule_costs=unit"],
        [*_pp("zb_v", 4, 2), "model.n_layers=4"],  # first and last stage on rank 0
        _pp("interleaved_1f1b", 2, 2),
    ],
    ids=["1f1b", "zb_h2", "zb_auto", "zb_v", "interleaved"],
)
def test_clipping_every_step_is_rolled_back_and_matches_sync(gloo_pool, schedule):
    sync, post = both(gloo_pool, [*schedule, "train.grad_clip=0.01"])
    assert all(n > 0.01 for n in sync[0]["norms"])  # clipping really is active every step
    assert_same_training(sync, post)
    # the first stage stepped on its partial norm every time, so every step is redone
    assert post[0]["redone"] == [True] * STEPS
    assert post[1]["redone"] == post[0]["redone"]  # every rank decides alike
    assert post[0]["all_reduce_calls"] == 0 and post[1]["all_reduce_calls"] == 0
    assert sync[0]["all_reduce_calls"] >= 2 * STEPS  # the loss and the norm, every step


def test_clipping_on_some_steps_only(gloo_pool):
    """A clip between the smallest and largest norm: some steps validate, some are redone."""
    probe = gloo_pool(2).run(pv_case, _pp("1f1b", 2), None)
    norms = sorted(probe[0]["norms"])
    clip = (norms[1] + norms[-2]) / 2
    sync, post = both(gloo_pool, [*_pp("1f1b", 2), f"train.grad_clip={clip}"])
    clipped = [n > clip for n in sync[0]["norms"]]
    assert any(clipped) and not all(clipped), (sync[0]["norms"], clip)
    assert_same_training(sync, post)
    assert post[0]["redone"] == clipped  # redone exactly when the global norm clips


def test_inf_on_the_last_stage_rolls_back_the_first(gloo_pool):
    sync, post = both(gloo_pool, _pp("1f1b", 2), {1: (1, math.inf)})
    assert sync[0]["skipped"] == [False, True, False, False, False]
    assert_same_training(sync, post)
    # the first stage stepped before the inf reached it: rolled back, the step skipped
    assert post[0]["redone"][1] and post[0]["skipped"][1]


def test_nan_on_the_first_stage_is_skipped_by_every_stage_at_once(gloo_pool):
    sync, post = both(gloo_pool, _pp("zb_h1", 2), {2: (0, math.nan)})
    assert sync[0]["skipped"] == [False, False, True, False, False]
    assert_same_training(sync, post)
    assert not post[0]["redone"][2]  # the chain carried the NaN: every stage skipped at once


@pytest.mark.parametrize("mesh", [["parallel.dp=2"], ["parallel.tp=2"]], ids=["pp2-dp2", "pp2-tp2"])
def test_with_dp_or_tp_replicas(gloo_pool, mesh):
    """The chain runs per dp replica (each holds the summed grads) and sums tp shards within
    the stage first; clipping on every step, an inf on the last stage at step 1."""
    overrides = [*_pp("1f1b", 2), *mesh, "train.grad_clip=0.01"]
    pool = gloo_pool(4)
    sync = pool.run(pv_case, overrides, {1: (1, math.inf)})
    post = pool.run(pv_case, [*overrides, PV], {1: (1, math.inf)})
    assert sync[0]["skipped"] == [False, True, False, False, False]
    assert_same_training(sync, post)
    assert all(r["redone"] == [True] * STEPS for r in post)


MOE_EP = ["model.n_experts=4", "model.top_k=2", "model.moe_aux_coef=0.01", "parallel.ep=2"]


def test_with_expert_parallel_shards(gloo_pool):
    """pp2 × dp2 with the experts sharded over ep2 (each dp rank steps other experts): the
    stage's norm² sums every dp rank's experts, each expert shard is rolled back with the
    weights and moments it stepped, and training matches the synchronous step (whose parity
    with one process is tests/test_parity_ep.py's); clipping every step, an inf at step 1."""
    overrides = [*_pp("1f1b", 2), "parallel.dp=2", *MOE_EP, "train.grad_clip=0.01"]
    pool = gloo_pool(4)
    sync = pool.run(pv_case, overrides, {1: (1, math.inf)})
    post = pool.run(pv_case, [*overrides, PV], {1: (1, math.inf)})
    assert sync[0]["skipped"] == [False, True, False, False, False]
    assert any(".experts." in name for r in post for name in r["weights"])
    assert_same_training(sync, post)
    assert all(r["redone"] == [True] * STEPS for r in post)


# DeepSeek-V3's aux-loss-free bias (train/moe_balance.py) on both stages' MoE layers
DSV3 = ["model.arch=deepseek_v3", "model.n_experts=6", "model.n_group=3", "model.topk_group=2",
        "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
        "model.v_head_dim=8", "model.tie_embeddings=false", "model.moe_aux_coef=0",
        "model.moe_bias_update_rate=0.01"]  # fmt: skip


def test_aux_loss_free_bias_is_rolled_back_with_the_weights_as_one_process(gloo_pool):
    """pp2 post-validated against one process: clipping every step (the first stage's step is
    redone: its bias restored and stepped again) and an inf on the last stage at step 1 (the
    first stage's optimistic bias step undone, as one process skips the step): the same losses,
    weights and selection biases (the load counts are integers: the bias steps exactly)."""
    overrides = [*_pp("1f1b", 2), *DSV3, "train.grad_clip=0.01"]
    post = gloo_pool(2).run(pv_case, [*overrides, PV], {1: (1, math.inf)})
    one = pv_case([x for x in overrides if not x.startswith("parallel.pp")], {1: (0, math.inf)})
    assert one["skipped"] == [False, True, False, False, False]
    assert all(r["redone"] == [True] * STEPS for r in post)
    got = {k: v for r in post for k, v in r["weights"].items()}
    biases = sorted(k for k in one["weights"] if k.endswith("routing.bias"))
    assert biases == ["layers.0.mlp.routing.bias", "layers.1.mlp.routing.bias"]
    assert any(one["weights"][name].abs().sum() > 0 for name in biases)  # it moved (± rate)
    for name in biases:  # exactly as one process moved it
        assert torch.equal(got[name], one["weights"][name]), name
    for r in post:
        assert r["skipped"] == one["skipped"]
        fin = [i for i, s in enumerate(one["skipped"]) if not s]
        for key in ("losses", "norms"):
            a, b = (torch.tensor([x[key][i] for i in fin]) for x in (r, one))
            assert_rel_close(a, b, name=key)
    assert_state_close(got, one["weights"], reach=3e-3 * STEPS)


def test_rollback_restores_weights_moments_and_step_counts_bitwise():
    """The copies taken before a step undo AdamW exactly, including a first step's new state."""
    from megapipe.train.optim import make_adamw
    from megapipe.train.post_validation import _restore, _save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    optimizer = make_adamw([{"params": params, "weight_decay": 0.1}], lr=1e-2)

    def grads():
        for p in params:
            p.grad = torch.randn_like(p)

    for first in (True, False):
        grads()
        before = [p.detach().clone() for p in params]
        state = {
            id(p): {k: v.clone() for k, v in optimizer.state.get(p, {}).items()} for p in params
        }
        saved = _save(params, optimizer)
        optimizer.step()
        assert not all(torch.equal(a, p) for a, p in zip(before, params))
        _restore(params, optimizer, saved)
        assert all(torch.equal(a, p) for a, p in zip(before, params))
        assert all(torch.equal(g, p.grad) for g, p in zip(saved["grads"], params))
        if first:
            assert len(optimizer.state) == 0
        for p in params:
            now = optimizer.state[p] if not first else {}
            assert set(now) == set(state[id(p)])
            assert all(torch.equal(v, state[id(p)][k]) for k, v in now.items())
        optimizer.step()  # the step that stays: the next round starts from it


@pytest.mark.parametrize(
    "overrides,match",
    [
        ([PV], "needs a pipeline"),
        ([PV, *_pp("pipedream_async", 2), "model.tie_embeddings=false"], "pipedream_async"),
        ([PV, *_pp("1f1b", 2), "parallel.dp=2", "parallel.zero=1"], "parallel.zero=1"),
    ],
)
def test_bad_post_validation_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value) and "parallel.post_validation" in str(err.value)


def run_records(overrides: list[str], run_dir: str) -> list[dict]:
    """train.run on this rank (a pool worker): its records, without the timings."""
    import train

    keep = ("step", "loss", "grad_norm", "skipped", "lr", "val_loss")
    records = train.run(tiny_config(overrides, run_dir))
    return [{k: r[k] for k in keep if k in r} for r in records]


def test_train_loop_logs_validated_steps_evaluates_saves_and_resumes(gloo_pool, tmp_path):
    """The loop holds a step's record until its global state is back, settles at evaluation,
    checkpoints and the end, and a run stopped at a checkpoint resumes to the same model."""
    pool = gloo_pool(2)
    common = [*_pp("1f1b", 2), "train.steps=5", "train.eval_interval=2", "checkpoint.interval=3"]
    sync = pool.run(run_records, common, str(tmp_path / "sync"))
    post = pool.run(run_records, [*common, PV], str(tmp_path / "post"))
    split = str(tmp_path / "split")
    first = pool.run(run_records, [*common, PV, "train.stop_at_step=3"], split)
    second = pool.run(run_records, [*common, PV], split)
    for got in (post[0], post[1], [*first[0], *second[0]]):
        assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
        assert [("val_loss" in r) for r in got] == [False, True, False, True, True]
        for key in ("loss", "grad_norm", "val_loss"):
            a = torch.tensor([r[key] for r in got if key in r], dtype=torch.float64)
            b = torch.tensor([r[key] for r in sync[0] if key in r], dtype=torch.float64)
            assert_rel_close(a, b, name=key)
    with open(tmp_path / "post" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5]


# ---- the simulator's multi-iteration mode (pure logic) --------------------------------------


def _iterations(name, p, m, post, optimizer=0.0, sync=0.0, comm=0.0, k=8):
    from megapipe.plan.schedules import build_schedule, placement
    from megapipe.plan.simulate import Costs, multi_iteration

    schedule, where = build_schedule(name, p, m, 1), placement(name, p, 1)
    costs = Costs(F=1, B=1, W=1, comm=comm)
    return multi_iteration(schedule, costs, where, k, post, optimizer, sync).steady_step


def test_hand_computed_two_stage_step():
    """1f1b, p=2, m=1, F=B=W=1: rank 0 runs F [0,1] and BW [4,6], rank 1 F [1,2], BW [2,4].
    Synchronous: every rank waits for the reduction after t=6 (0.5), steps (0.25): 6.75.
    Post-validated: rank 0 steps at 6 and starts again at 6.25; rank 1, done at 4, steps on
    rank 0's partial state (at 6) and waits for its activation anyway: 6.25."""
    assert _iterations("1f1b", 2, 1, False, 0.25, 0.5) == pytest.approx(6.75)
    assert _iterations("1f1b", 2, 1, True, 0.25, 0.5) == pytest.approx(6.25)


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_h2"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_post_validation_is_never_slower_and_wins_whenever_there_is_a_sync(name, p):
    for m in (p, 2 * p):
        for comm in (0.0, 0.1):
            sync = _iterations(name, p, m, False, 0.3, 0.2, comm)
            post = _iterations(name, p, m, True, 0.3, 0.2, comm)
            assert post < sync - 0.1, (name, p, m, comm, post, sync)
            free = _iterations(name, p, m, False, 0.3, 0.0, comm)
            assert _iterations(name, p, m, True, 0.3, 0.0, comm) <= free + 1e-9


def test_zb_h2_reaches_zero_bubble_only_without_the_sync():
    """Zero Bubble §4: ZB-H2's parallelogram needs the next step's warm-up to overlap this
    step's cool-down; with the barrier its steady step is a whole makespan (ZB-H1's)."""
    p, m = 4, 8
    assert _iterations("zb_h2", p, m, True) == pytest.approx(m * 3)  # m·(F+B+W): no bubble
    assert _iterations("zb_h2", p, m, False) == pytest.approx(m * 3 + (p - 1))
    assert _iterations("1f1b", p, m, True) == _iterations("1f1b", p, m, False)  # nothing to gain


def test_one_stage_is_the_same_either_way():
    assert _iterations("1f1b", 1, 4, True, 0.3, 0.5) == _iterations("1f1b", 1, 4, False, 0.3, 0.5)
    assert _iterations("1f1b", 1, 4, True, 0.3, 0.5) == pytest.approx(4 * 3 + 0.3)


def test_cli_prints_both_steady_steps(capsys):
    cli = schedule_cli
    argv = ["--schedule", "zb_h2", "--pp", "4", "--microbatches", "8", "--iterations", "6"]
    cli.main([*argv, "--sync-cost", "0.5", "--optimizer-cost", "0.25", "--json"])
    got = json.loads(capsys.readouterr().out)["multi_iteration"]
    assert got["sync_step"] == pytest.approx(_iterations("zb_h2", 4, 8, False, 0.25, 0.5, k=6))
    assert got["post_validation_step"] == pytest.approx(24.25)
    assert got["gain"] == pytest.approx(1 - 24.25 / got["sync_step"], abs=1e-6)
    cli.main(["--compare", "1f1b,zb_h2", *argv[2:]])
    assert "steady step, post-validation" in capsys.readouterr().out
