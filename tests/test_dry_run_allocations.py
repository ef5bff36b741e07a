"""`train.py --dry-run --json` against the bytes a run allocates (issue 33: within 5%).

Real training steps of a small model on gloo CPU ranks, built by `build()` as train.py builds
them; per rank, from the tensors themselves, each storage counted once however many tensors
view it (a bucket's flat buffer, a tied table, the shard views of the distributed optimizer):
the weights (the parameters' storages), the grads when the optimizer begins (after the dp × cp
reduction, as they are held over the step), the optimizer state after a step (its tensors, the
0-d step counts left out), and the activations: the peak of live storages saved for backward,
from saved_tensors_hooks (tests/test_memory_model.LiveSaved). Each is held to the dry run's JSON
(train/dry_run.as_json, on the CPU's kernels: for these cases the CUDA plan train.py prints is
the same, checked below), and so is their sum to `peak_bytes`.

LAYOUTS are the state layouts measured: one row per (train.params_dtype, parallel.zero). The
layouts of issue 33 whose runtime is not built yet (bf16 weights; zero 2 and 3) are refused by
the config checks (config/checks_runtime.check_not_built), so they cannot run here yet; each
gets its row below once its runtime lands, and every mesh and schedule is then measured under it.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from benchmarks.harness import storage_bytes
from megapipe.config import load_config
from megapipe.train.dry_run import as_json
from megapipe.train.hooks import TrainHooks
from tests.conftest import TINY
from tests.parity import build_mesh, tiny_config
from tests.test_memory_model import LiveSaved

TOLERANCE = 0.05
LAYOUTS = [
    ("float32", 0),
    ("float32", 1),
    # ("float32", 2), ("float32", 3): the grad shards and the master weight shards live in
    # the reducer (parallel/data/zero2.py, zero3.py), which Allocations does not read yet;
    # ("bfloat16", 2), ("bfloat16", 3): not built yet (config/checks_runtime.check_not_built)
]
# bf16 weights: the state (weights, float32 main grads, main params and moments) is held to the
# plan; their activations are not yet: a run saves 10-12% less than the plan counts (bf16
# compute saves bf16 tensors where the plan still counts some float32 ones), an open gap
STATE_LAYOUTS = [("bfloat16", 0), ("bfloat16", 1)]
STATE_KINDS = ("weights", "grads", "optimizer")
SMALL = ["model.d_model=64", "model.seq_len=32", "train.global_batch=8"]
MESHES = {
    # no pipeline, 2 microbatches: the head makes its float32 weight grad in forward into one
    # of the two buffers it keeps under grad accumulation (parallel/tensor/cross_entropy
    # .HeadBuffers); both were saved once and live on, so the saved bytes count a second
    # V·d·4 table that the plan counts as the grads' (held all step): 4.5% over
    "dp2": ["parallel.dp=2", "parallel.microbatches=2"],
    "pp2-1f1b": ["parallel.pp=2", "model.n_layers=4", "parallel.microbatches=4"],
    "pp2-zb_h2": ["parallel.pp=2", "model.n_layers=4", "parallel.microbatches=4",
                  "parallel.schedule=zb_h2"],
    "pp2-interleaved": ["parallel.pp=2", "model.n_layers=4", "parallel.microbatches=4",
                        "parallel.schedule=interleaved_1f1b", "parallel.vpp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
}  # fmt: skip
STEPS = 2
KINDS = ("weights", "grads", "optimizer", "activations")


class Allocations(TrainHooks):
    """The grads as the optimizer begins and the optimizer state as it ends, at their largest
    over the steps. Grads: each parameter's `.grad` and, where it has one, its float32
    `main_grad` (Megatron's name for the buffer bf16 weights accumulate into). Optimizer: the
    tensors of its state, and the parameters it steps that are not the model's storages (bf16
    weights' float32 main params)."""

    def __init__(self, model: torch.nn.Module, optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.grads = self.state = 0

    def optimizer_begin(self) -> None:
        params = list(self.model.parameters())
        grads = [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
        self.grads = max(self.grads, storage_bytes(grads))

    def optimizer_end(self) -> None:
        tensors = [
            t
            for state in self.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        model = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        stepped = [p for g in self.optimizer.param_groups for p in g["params"]]
        tensors += [p for p in stepped if p.untyped_storage().data_ptr() not in model]
        self.state = max(self.state, storage_bytes(tensors))


def measure_run(overrides: list[str]) -> dict:
    """STEPS training steps under `overrides` on this rank: its (pp, tp) and the bytes of each
    kind (module docstring)."""
    from megapipe.data.loader import build_data
    from megapipe.train.build import build

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    torch.manual_seed(cfg.train.seed)
    job = build(cfg, mesh, "cpu", bucket_mb=0.05)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    seen = Allocations(job.model, optimizer)
    live = LiveSaved(job.model, runtime=getattr(job.engine, "runtime", None))
    hooks = [p.register_post_accumulate_grad_hook(live.poll) for p in job.model.parameters()]
    try:
        for step in range(STEPS):
            with live.hooks():
                job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step, seen)
    finally:
        for hook in hooks:
            hook.remove()
    coord = (lambda axis: mesh.coord(axis)) if mesh is not None else (lambda axis: 0)
    return {
        "pp": coord("pp"),
        "tp": coord("tp"),
        "weights": storage_bytes(job.model.parameters()),
        "grads": seen.grads,
        "optimizer": seen.state,
        "activations": live.peak,
    }


def case(mesh: str, layout: tuple[str, int]) -> list[str]:
    params_dtype, zero = layout
    # bf16 weights compute in bf16 (config/checks_runtime.check_params_dtype)
    dtype = f"train.dtype={params_dtype}"
    return [
        *SMALL,
        *MESHES[mesh],
        dtype,
        f"train.params_dtype={params_dtype}",
        f"parallel.zero={zero}",
    ]


def measured_and_planned(gloo_pool, mesh: str, layout: tuple[str, int]) -> list:
    """(what each of two ranks allocated, the dry run's JSON entry for its (pp, tp) rank)."""
    overrides = case(mesh, layout)
    cfg = load_config(TINY, [*overrides, f"run.dir={tempfile.mkdtemp()}"])
    plan = {(r["pp"], r["tp"]): r for r in as_json(cfg, "cpu")["ranks"]}
    return [(got, plan[got["pp"], got["tp"]]) for got in gloo_pool(2).run(measure_run, overrides)]


@pytest.mark.spawn
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}-zero{x[1]}")
@pytest.mark.parametrize("mesh", MESHES)
def test_dry_run_json_is_what_a_run_allocates(gloo_pool, mesh, layout):
    for got, want in measured_and_planned(gloo_pool, mesh, layout):
        for kind in KINDS:
            assert got[kind] == pytest.approx(want[f"{kind}_bytes"], rel=TOLERANCE), (kind, got)
        total = sum(got[k] for k in KINDS)
        assert total == pytest.approx(want["peak_bytes"], rel=TOLERANCE), (got, want)


@pytest.mark.spawn
@pytest.mark.parametrize("layout", STATE_LAYOUTS, ids=lambda x: f"{x[0]}-zero{x[1]}")
@pytest.mark.parametrize("mesh", ["dp2", "pp2-zb_h2", "tp2-sp"])
def test_dry_run_json_holds_the_bf16_state(gloo_pool, mesh, layout):
    for got, want in measured_and_planned(gloo_pool, mesh, layout):
        for kind in STATE_KINDS:
            assert got[kind] == pytest.approx(want[f"{kind}_bytes"], rel=TOLERANCE), (kind, got)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}-zero{x[1]}")
@pytest.mark.parametrize("mesh", MESHES)
def test_the_cases_plan_alike_on_cuda(mesh, layout):
    """What train.py prints (the CUDA kernels' plan) is what the CPU run is held to."""
    cfg = load_config(TINY, [*case(mesh, layout), f"run.dir={tempfile.mkdtemp()}"])
    assert as_json(cfg) == as_json(cfg, "cpu")


def test_zero1_is_measured_where_it_shards():
    """The zero=1 row shards the optimizer state on the dp2 mesh (a half of zero=0's)."""
    states = {}
    for layout in LAYOUTS:
        cfg = load_config(TINY, [*case("dp2", layout), f"run.dir={tempfile.mkdtemp()}"])
        states[layout] = as_json(cfg)["ranks"][0]["optimizer_bytes"]
    assert states["float32", 1] == pytest.approx(states["float32", 0] / 2, abs=8)
