"""PipeDream asynchronous training (Narayanan et al. SOSP'19 §3.3) against a one-process
simulation of the same delayed-gradient rule.

The simulation knows nothing of schedules or stashes: microbatch i's gradient on stage s is taken
at that stage's weights after max(0, i − d_s) of its own updates, d_s = p−1−s (weight stashing)
or p−1 (vertical sync), then every stage clips by its own norm and steps. The pipelined runs
must match it (losses, grad norms, final weights, relative 1e-5) and must differ from
synchronous 1F1B and from the rule without delay, so a no-op stash cannot pass.
"""

import math
import tempfile
from functools import cache

import pytest
import torch

from megapipe.config import ConfigError
from megapipe.plan.schedules import build_schedule
from tests.parity import build_mesh, mesh_params, tiny_config, train_case
from tests.util import assert_rel_close, assert_state_close, rel_error

UNTIED = ["model.tie_embeddings=false"]
LLAMA = ["model.arch=llama", "model.d_ff=64"]
SP = ["parallel.sequence_parallel=true"]
B12, L4 = ["train.global_batch=12"], ["model.n_layers=4"]
STEPS = 3


def pd(p: int, m: int, sync: str = "stash") -> list[str]:
    return [
        "parallel.schedule=pipedream_async",
        f"parallel.pp={p}",
        f"parallel.microbatches={m}",
        f"parallel.weight_sync={sync}",
        *UNTIED,
    ]


CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("pp2-stash-m4", 1, 1, pd(2, 4)),
        ("pp2-vertical-m4", 1, 1, pd(2, 4, "vertical")),
        (
            "pp2-stash-m3-llama-full-recompute",
            1,
            1,
            [*pd(2, 3), *B12, *LLAMA, "recompute.mode=full"],
        ),
    ],
    4: [
        ("pp4-stash-m6", 1, 1, [*pd(4, 6), *B12, *L4]),
        ("pp4-vertical-m6", 1, 1, [*pd(4, 6, "vertical"), *B12, *L4]),
        ("dp2-pp2-stash-m3", 2, 1, [*pd(2, 3), *B12]),
        ("pp2-tp2-vertical-sp", 1, 2, [*pd(2, 4, "vertical"), *SP]),
        (
            "pp2-cp2-vertical-llama-selective",
            1,
            1,
            [*pd(2, 4, "vertical"), "parallel.cp=2", *LLAMA, "recompute.mode=selective"],
        ),
    ],
}


def delay(sync: str, pp: int, stage: int) -> int:
    """Updates a stage's weights lag behind the microbatch (§3.3's staleness)."""
    return pp - 1 if sync == "vertical" else pp - 1 - stage


# ---- the one-process simulation -----------------------------------------------------------


def _copy(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


@torch.no_grad()
def _load(params, values) -> None:
    for p, v in zip(params, values):
        p.copy_(v)


@cache
def simulate(extra: tuple[str, ...], dp: int, delayed: bool = True) -> dict:
    """The pipeline's stages as separate models on one process, stepped microbatch by
    microbatch with each stage's gradient taken at its delayed weights (none if not `delayed`)."""
    from megapipe.config.pipeline_split import rank_blocks
    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.pipeline.stages import build_model
    from megapipe.train.batches import split_inputs
    from megapipe.train.optim import (
        build_optimizer,
        clip_gradients,
        global_grad_norm,
        lr_at,
        set_lr,
    )

    cfg = tiny_config(list(extra), tempfile.mkdtemp())
    p, t = cfg.parallel, cfg.train
    stages = [build_model(cfg, None, "cpu", rank_blocks(cfg, s)[0]) for s in range(p.pp)]
    params = [list(st.parameters()) for st in stages]
    optimizer = build_optimizer(torch.nn.ModuleList(stages), t)
    data = build_data(cfg.data, cfg.model, t.seed)
    m, tokens = p.microbatches, t.global_batch * cfg.model.seq_len
    losses, norms = [], []
    for step in range(STEPS):
        batch = data.batch(step, t.global_batch)
        micro = [torch.cat([r.chunk(m)[i] for r in batch.chunk(dp)]) for i in range(m)]
        history = [[_copy(ps)] for ps in params]  # history[s][v]: stage s after v updates
        loss_sum, step_norms = 0.0, []
        for i, rows in enumerate(micro):
            live = [_copy(ps) for ps in params]
            for s, ps in enumerate(params):
                lag = delay(p.weight_sync, p.pp, s) if delayed else 0
                _load(ps, history[s][max(0, i - lag)])
            x, targets = split_inputs(rows)
            for st in stages[:-1]:
                x = st(x)
            loss = stages[-1](x, targets)
            (loss / (tokens / m)).backward()  # mean over microbatch i's tokens
            loss_sum += loss.item()
            squares = []
            for s, ps in enumerate(params):
                _load(ps, live[s])
                norm = global_grad_norm(ps)  # each stage clips by its own norm
                clip_gradients(ps, norm, t.grad_clip)
                squares.append(norm.item() ** 2)
            step_norms.append(math.sqrt(sum(squares)))
            set_lr(optimizer, lr_at(step, t))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for s, ps in enumerate(params):
                history[s].append(_copy(ps))
        losses.append(loss_sum / tokens)
        norms.append(sum(step_norms) / m)
    weights = {k: v for st in stages for k, v in gather_logical(st).items()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}


# ---- the pipelined runs (pool workers) ----------------------------------------------------


def pipedream_case(overrides: list[str]) -> dict:
    """Train STEPS steps under the mesh: losses, norms, this rank's weights, versions stashed."""
    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.train.optim import build_optimizer
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    job = parallelize(cfg, mesh, "cpu", 0.01)
    pipe = job.engine
    optimizer = build_optimizer(job.model, cfg.train)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    results = [
        job.train_step(optimizer, data.batch(s, cfg.train.global_batch), s) for s in range(STEPS)
    ]
    return {
        "losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
        "weights": gather_logical(pipe.chunks[0]), "pp_rank": mesh.coord("pp"),
        "peak_versions": pipe.store.peak,
        "events": [str(e.action) for e in pipe.runtime.events],
        "actions": [str(a) for a in pipe.actions],
    }  # fmt: skip


def _run(gloo_pool, world, dp, tp, extra) -> tuple[list[dict], dict]:
    results = gloo_pool(world).run(
        pipedream_case, [*extra, f"parallel.dp={dp}", f"parallel.tp={tp}"]
    )
    union = {}
    for rank, got in enumerate(results):
        assert got["events"] == got["actions"], f"rank {rank}: ran out of schedule order"
        for name, value in got["weights"].items():
            assert name not in union or torch.equal(union[name], value), f"{name} copies differ"
            union[name] = value
    return results, union


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_pipedream_matches_delayed_gradient_simulation(gloo_pool, world, dp, tp, extra):
    results, weights = _run(gloo_pool, world, dp, tp, extra)
    ref = simulate(tuple(extra), dp)
    cfg = tiny_config(extra, tempfile.mkdtemp())
    for rank, got in enumerate(results):
        assert_rel_close(_t(got["losses"]), _t(ref["losses"]), name=f"rank {rank} losses")
        assert_rel_close(_t(got["grad_norms"]), _t(ref["grad_norms"]), name="grad norms")
        if cfg.parallel.weight_sync == "stash":  # at most one stash per in-flight microbatch
            r, pp = got["pp_rank"], cfg.parallel.pp
            assert (got["peak_versions"] == 0) == (r == pp - 1)  # the last stage: F, BW, step
            assert got["peak_versions"] <= pp - r
    assert_state_close(weights, ref["weights"])
    # teeth: the same rule without the delay, i.e. what ignoring the versions would give
    undelayed = simulate(tuple(extra), dp, delayed=False)["weights"]
    assert max(rel_error(weights[k], undelayed[k]) for k in weights) > 1e-3


def test_pipedream_is_not_synchronous_1f1b_and_stash_is_not_vertical(gloo_pool):
    stash, vertical = pd(2, 4), pd(2, 4, "vertical")
    _, got = _run(gloo_pool, 2, 1, 1, stash)
    _, got_vertical = _run(gloo_pool, 2, 1, 1, vertical)
    sync = train_case([*UNTIED, "parallel.microbatches=4"], steps=STEPS)["weights"]
    for other in (sync, got_vertical):
        assert max(rel_error(got[k], other[k]) for k in got) > 1e-3


def test_simulation_delays_match_the_schedule_versions():
    for sync in ("stash", "vertical"):
        schedule = build_schedule("pipedream_async", 4, 8, weight_sync=sync)
        for stage, actions in schedule.items():
            for a in actions:
                assert a.version == max(0, a.microbatch - delay(sync, 4, stage)), (sync, a)


def test_stash_keeps_the_forward_weights_for_backward(tmp_path):
    """A backward after an in-place update: with the stash it is the gradient at the forward's
    weights, grad hooks included; without it autograd refuses (the weights changed)."""
    from megapipe.data.loader import build_data
    from megapipe.pipeline.pipedream import VersionStore
    from megapipe.pipeline.stages import build_model
    from megapipe.train.batches import split_inputs

    cfg = tiny_config(UNTIED, str(tmp_path))
    model = build_model(cfg)
    x, y = split_inputs(build_data(cfg.data, cfg.model, 0).batch(0, 2))
    store = VersionStore(model)
    model(x, y).backward()
    expected = [p.grad for p in store.live]
    model.zero_grad(set_to_none=True)

    def update():
        with torch.no_grad():
            for p in store.live:
                p.add_(0.5)

    store.snapshot()
    with store.use(0):
        loss = model(x, y)
    update()
    store.current = 1
    with store.use(0):
        loss.backward()
    store.move_grads(0)
    for p, g in zip(store.live, expected):
        assert torch.equal(p.grad, g)
    loss = model(x, y)  # no stash: the live weights, then an update before backward
    update()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize(
    "overrides,match",
    [
        ([*pd(2, 2)[:-1]], "model.tie_embeddings=true with parallel.schedule=pipedream_async"),
        ([*pd(2, 2), "parallel.vpp=2", *L4], "pipedream_async runs one chunk per rank"),
        (pd(2, 2, "sometimes"), "parallel.weight_sync='sometimes' is not one of stash, vertical"),
        (
            ["parallel.weight_sync=vertical", "parallel.pp=2", "parallel.microbatches=2"],
            "weight_sync=vertical applies to parallel.schedule=pipedream_async only",
        ),
    ],
)
def test_bad_pipedream_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)
