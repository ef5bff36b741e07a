"""`train.py --dry-run --json` against the bytes a run allocates (issue 33: within 5%).

Real training steps of a small model on gloo CPU ranks, built by `parallelize()` as train.py builds
them. Per rank, from the tensors themselves (Held), each storage counted once however many
tensors view it (a bucket's flat buffer, a tied table, the shard views of the distributed
optimizer), polled at every tensor saved for backward, every unpack, every grad
accumulation, each bucket's copy into its send buffer (both held: the grads are dropped after)
and around the optimizer step:

  JSON field            measured as the largest over the steps of
  weights_bytes         the parameters' storages (zero=3: the gathered blocks resident at once)
                        and zero=3's master shards
  grads_bytes           the local grads (`.grad`, bf16 weights' `main_grad`)
  optimizer_bytes       the optimizer's state tensors and the float32 main params it steps
  activations_bytes     the live storages saved for backward (tests/test_memory_model.LiveSaved)
  grads_step_bytes      grads and reduce-scattered shards as the optimizer begins
  grads_reducing_bytes  grads plus the reducers' send buffers and shards (during the reduction)
  peak_bytes            all of them at one poll, zero>=1's pending weight all-gathers included

each held to the dry run's JSON (train/dry_run.as_json on the CPU's kernels; the CUDA plan
train.py prints is the same but for bf16 weights' LayerNorm, checked below).

LAYOUTS: one row per (train.params_dtype, parallel.zero); every row runs on every mesh. On a
mesh without replicas (dp·cp = 1) every zero level is zero=0 (no reducer, nothing to shard),
so there each params dtype runs once (CASES). EP_MESHES: a mixture of experts under parallel.ep
at the sharded layouts, its state kinds held to the byte (float32 weights).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megapipe.config import load_config
from megapipe.config.states import local_grads_transient, state_layout
from megapipe.parallel.data.zero import ShardedGradReducer
from megapipe.parallel.tensor.cross_entropy import _LinearCrossEntropy
from megapipe.train.dry_run import as_json
from megapipe.train.hooks import TrainHooks
from megapipe.train.meta_memory import chunk_params, memory_plan
from tests.conftest import TINY
from tests.parity import build_mesh, tiny_config
from tests.test_memory_model import LiveSaved

TOLERANCE = 0.05
LAYOUTS = [  # (params_dtype, zero): one row per layout
    ("float32", 0),
    ("float32", 1),
    ("float32", 2),
    ("float32", 3),
    ("bfloat16", 0),
    ("bfloat16", 1),
    ("bfloat16", 2),
    ("bfloat16", 3),
]
SMALL = ["model.d_model=64", "model.seq_len=32", "train.global_batch=8"]
PIPELINE = ["parallel.pp=2", "model.n_layers=4", "parallel.microbatches=4"]
MESHES = {
    # no pipeline, 2 microbatches: the head makes its float32 weight grad in forward into one
    # of the two buffers it keeps under grad accumulation (parallel/tensor/cross_entropy
    # .HeadBuffers); both were saved once and live on, so the saved bytes count a second
    # V·d·4 table that the plan counts as the grads' (held all step): 4.5% over
    "dp2": ["parallel.dp=2", "parallel.microbatches=2"],
    "pp2-1f1b": PIPELINE,
    "pp2-zb_h2": [*PIPELINE, "parallel.schedule=zb_h2"],
    "pp2-interleaved": [*PIPELINE, "parallel.schedule=interleaved_1f1b", "parallel.vpp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    # four ranks: the ZeRO levels under a pipeline and under tp
    "dp2-pp2": ["parallel.dp=2", *PIPELINE, "train.global_batch=16"],
    "dp2-tp2-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                   "parallel.microbatches=2"],
}  # fmt: skip
# expert parallelism: the routed experts' state sharded over their expert replicas (dp/ep = 2
# ranks), the rest over dp = 4 (config/states.expert_layout, parallel/data/zero*.py)
EP_MESHES = {
    "dp4-ep2-moe": ["parallel.dp=4", "parallel.ep=2", "parallel.microbatches=2",
                    "model.n_experts=4", "model.top_k=2"],
}  # fmt: skip
EP_LAYOUTS = [("float32", 1), ("float32", 2), ("float32", 3), ("bfloat16", 2), ("bfloat16", 3)]
STEPS = 2
KINDS = ("weights", "grads", "optimizer", "activations")


class Held(LiveSaved):
    """Every byte a rank holds, polled where LiveSaved polls (each pack, unpack and grad
    accumulation) and around the optimizer step, each storage counted once, in the first of
    these kinds that holds it:

    - weights: the parameters' storages with storage (zero=3: its gathered flat buffers while
      resident, parallel/data/zero3.py `full`) and zero=3's master shards;
    - grads: the local grads, `.grad` and `main_grad` (bf16 weights' float32 buffer);
    - optimizer: its state tensors (0-d step counts left out) and the float32 main params it
      steps (bf16 weights) that are neither the model's storages nor zero=3's master shards;
    - activations: LiveSaved's live saved storages (a zero=3 weight saved for backward is a
      view of a gathered buffer: counted as weights, not activations);
    - in flight: the reducers' send buffers and reduce-scattered shards (`bucket.flat`,
      `bucket.shard`) and, reducing every microbatch, the shard sums (zero2.py `sums`);
    - gathers: zero>=1's weight all-gathers from the step to each block's first use
      (`pending`);
    - head: inside the fused LM head + loss (polled at each of its ops, HeadAllocations), the
      storages it allocated that are still alive (its chunk of logits, their casts, its grads).

    `kinds`: each kind's largest; `step_grads`: grads and shards as the optimizer begins;
    `reducing`: grads and in-flight grads at their largest; `peak`: the largest total."""

    def __init__(self, model: torch.nn.Module, reducers: list, runtime=None) -> None:
        super().__init__(model, runtime=runtime)
        self.model, self.reducers, self.optimizer = model, [r for r in reducers if r], None
        self.kinds = dict.fromkeys(KINDS, 0)
        self.peak = self.step_grads = self.reducing = self.head_peak = 0
        self.now: dict[str, int] = {}
        self.head = HeadAllocations(self.poll)

    def _add(self, t: torch.Tensor) -> None:
        if t.untyped_storage().data_ptr() not in {
            w.untyped_storage().data_ptr() for w in self._weights()
        }:
            super()._add(t)

    def _weights(self) -> list:
        return list(self.model.parameters()) + [
            m for r in self.reducers for m in getattr(r, "master", [])
        ]

    def _grads(self) -> list:
        params = list(self.model.parameters())
        return [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]

    def _optimizer(self) -> list:
        if self.optimizer is None:
            return []
        state = [t for s in self.optimizer.state.values() for t in s.values()]
        stepped = [p for g in self.optimizer.param_groups for p in g["params"]]
        return [t for t in state if torch.is_tensor(t) and t.dim() > 0] + stepped

    def _in_flight(self) -> list:
        sums = [t for r in self.reducers for t in getattr(r, "sums", {}).values()]
        return [t for r in self.reducers for b in r.buckets for t in (b.flat, b.shard)] + sums

    def _gathers(self) -> list:
        return [full for r in self.reducers for full, _ in getattr(r, "pending", {}).values()]

    def held(self) -> dict[str, int]:
        """Bytes of each kind now (the class docstring's order decides a shared storage)."""
        seen: set[int] = set()
        out = {}
        for kind, tensors in (("weights", self._weights()), ("grads", self._grads()),
                              ("optimizer", self._optimizer()), ("in flight", self._in_flight()),
                              ("gathers", self._gathers())):  # fmt: skip
            mine = {}
            for t in tensors:
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    mine[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            seen |= set(mine)
            out[kind] = sum(mine.values())
        head = self.head.live().items() if self.head.inside else ()
        out["head"] = sum(n for p, n in head if p not in seen and p not in self.live)
        return out

    def poll(self, *_) -> None:
        super().poll()
        now = self.held()
        now["activations"] = sum(n for _, n in self.live.values())
        self.peak = max(self.peak, sum(now.values()))
        self.head_peak = max(self.head_peak, now["head"])
        self.reducing = max(self.reducing, now["grads"] + now["in flight"])
        for kind in KINDS:
            self.kinds[kind] = max(self.kinds[kind], now[kind])
        self.now = now


class HeadAllocations(TorchDispatchMode):
    """The storages the fused LM head + loss (parallel/tensor/cross_entropy._LinearCrossEntropy)
    allocates in its forward and its backward: each op's outputs while one of the two is on the
    Python stack, held by weak reference (alive until freed: the CPU's allocator statistics
    for these tensors), `on_op` called after each such op with `inside` set."""

    CODES = {_LinearCrossEntropy.forward.__code__, _LinearCrossEntropy.backward.__code__}

    def __init__(self, on_op) -> None:
        super().__init__()
        self.on_op, self.inside = on_op, False
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def _in_head(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in self.CODES:
                return True
            frame = frame.f_back
        return False

    def live(self) -> dict[int, int]:
        """Bytes of each tracked storage still alive (the CPU's kept buffers included)."""
        self.refs = {ptr: v for ptr, v in self.refs.items() if not v[0].expired()}
        return {ptr: n for ptr, (_, n) in self.refs.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._in_head():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    s = t.untyped_storage()
                    old = self.refs.get(s.data_ptr())
                    if s.nbytes() and (old is None or old[0].expired()):
                        self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
            self.inside = True
            try:
                self.on_op()
            finally:
                self.inside = False
        return out


class Allocations(TrainHooks):
    """Polls `held` around the optimizer step; the grads held over it as it begins."""

    def __init__(self, held: Held) -> None:
        self.held = held

    def optimizer_begin(self) -> None:
        self.held.poll()
        now = self.held.now
        self.held.step_grads = max(self.held.step_grads, now["grads"] + now["in flight"])

    def optimizer_end(self) -> None:
        self.held.poll()


def measure_run(overrides: list[str]) -> dict:
    """STEPS training steps under `overrides` on this rank: its (pp, tp), the bytes of each
    kind and the peak of their sum (Held)."""
    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    torch.manual_seed(cfg.train.seed)
    # the buckets the plan counts where one is copied whole (states.packing_bytes); reducing
    # every microbatch, several a block (the plan counts blocks: states.block_grads_bytes)
    job = parallelize(cfg, mesh, "cpu", 0.05 if local_grads_transient(cfg) else None)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    held = Held(job.model, job.engine.reducers, getattr(job.engine, "runtime", None))
    held.optimizer = optimizer
    hooks = [p.register_post_accumulate_grad_hook(held.poll) for p in job.model.parameters()]
    copy_in = ShardedGradReducer._copy_in
    ShardedGradReducer._copy_in = lambda *args: (held.poll(), copy_in(*args))[1]
    try:
        for step in range(STEPS):
            batch = data.batch(step, cfg.train.global_batch)
            with held.hooks(), held.head:
                job.train_step(optimizer, batch, step, Allocations(held))
    finally:
        ShardedGradReducer._copy_in = copy_in
        for hook in hooks:
            hook.remove()
    coord = (lambda axis: mesh.coord(axis)) if mesh is not None else (lambda axis: 0)
    return {"pp": coord("pp"), "tp": coord("tp"), **held.kinds, "peak": held.peak,
            "step_grads": held.step_grads, "reducing": held.reducing,
            "head": held.head_peak}  # fmt: skip


def case(mesh: str, layout: tuple[str, int], extra: tuple[str, ...] = ()) -> list[str]:
    params_dtype, zero = layout
    return [
        *SMALL,
        *{**MESHES, **EP_MESHES}[mesh],
        *extra,
        f"train.dtype={params_dtype}",  # bf16 weights compute in bf16 (checks_runtime)
        f"train.params_dtype={params_dtype}",
        f"parallel.zero={zero}",
    ]


def config(mesh: str, layout: tuple[str, int], extra: tuple[str, ...] = ()):
    return load_config(TINY, [*case(mesh, layout, extra), f"run.dir={tempfile.mkdtemp()}"])


def cases() -> list:
    """(mesh, layout) for every row and mesh, one zero level per dtype where nothing shards;
    the two-rank meshes first (the pool of one world size is kept while it lasts)."""
    out = {}
    for mesh in MESHES:
        for layout in LAYOUTS:
            cfg = config(mesh, layout)
            key = (mesh, layout[0], state_layout(cfg).zero)
            out.setdefault(key, (cfg.derived.world_size, mesh, layout))
    return [
        pytest.param(mesh, layout, id=f"{mesh}-{layout[0]}-zero{layout[1]}")
        for _, mesh, layout in sorted(out.values(), key=lambda c: c[0])
    ]


CASES = cases()


def measured_and_planned(
    gloo_pool, mesh: str, layout: tuple[str, int], extra: tuple[str, ...] = ()
) -> list:
    """(what each rank allocated, the dry run's JSON entry for its (pp, tp) rank)."""
    cfg = config(mesh, layout, extra)
    plan = {(r["pp"], r["tp"]): r for r in as_json(cfg, "cpu")["ranks"]}
    # the polls see saved tensors, grads and the head's allocations, not the grads a layer's
    # backward makes (config/memory_backward.py, held to the code by tests/test_fake_memory.py)
    for (pp, tp), r in plan.items():
        r["saved_peak_bytes"] = replace(memory_plan(cfg, "cpu").rank(pp, tp), backward=0).peak
    runs = gloo_pool(cfg.derived.world_size).run(measure_run, case(mesh, layout, extra))
    return [(got, plan[got["pp"], got["tp"]]) for got in runs]


def assert_within_the_bound(got: dict, want: dict) -> None:
    """zero=3 reduces every microbatch, where the plan's full-size grads are an upper bound
    (config/states.block_grads_bytes: the shard plus two blocks' float32 grads, and 1/d of
    them received, at most at once; float32 weights hold about one parameter's .grad, bf16
    weights one block's main grads): the run's grads within it, its grads while reducing at
    least the shard sums, and its peak between the plan's less those blocks and the plan's."""
    blocks = want["grads_bytes"] - want["grads_step_bytes"]
    assert got["grads"] <= want["grads_bytes"], (got, want)
    assert got["reducing"] <= want["grads_reducing_bytes"], (got, want)
    assert got["reducing"] >= want["grads_step_bytes"] * (1 - TOLERANCE), (got, want)
    assert got["peak"] <= want["peak_bytes"] * (1 + TOLERANCE), (got, want)
    assert got["peak"] >= (want["peak_bytes"] - blocks) * (1 - TOLERANCE), (got, want)


@pytest.mark.spawn
@pytest.mark.parametrize(("mesh", "layout"), CASES)
def test_dry_run_json_is_what_a_run_allocates(gloo_pool, mesh, layout):
    per_microbatch = local_grads_transient(config(mesh, layout))  # zero=3 with replicas
    for got, want in measured_and_planned(gloo_pool, mesh, layout):
        for kind in [k for k in KINDS if not (per_microbatch and k == "grads")]:
            assert got[kind] == pytest.approx(want[f"{kind}_bytes"], rel=TOLERANCE), (kind, got)
        assert got["step_grads"] == pytest.approx(want["grads_step_bytes"], rel=TOLERANCE)
        if per_microbatch:
            assert_within_the_bound(got, want)
            continue
        assert got["reducing"] == pytest.approx(want["grads_reducing_bytes"], rel=TOLERANCE)
        assert got["peak"] == pytest.approx(want["saved_peak_bytes"], rel=TOLERANCE), (got, want)


@pytest.mark.spawn
@pytest.mark.parametrize("layout", EP_LAYOUTS, ids=lambda x: f"{x[0]}-zero{x[1]}")
def test_dry_run_holds_the_expert_shards_a_run_allocates(gloo_pool, layout):
    """Under parallel.ep each rank's weights, grads and optimizer state, over the step and
    while the reduction runs, are the plan's to the byte (float32 weights; bf16 weights: the
    plan counts the float32 router as bf16, a few hundred bytes). The activations are left out:
    the rows a rank's experts receive follow the routing, the plan counts an even share."""
    for got, want in measured_and_planned(gloo_pool, "dp4-ep2-moe", layout):
        kinds = ("weights", "optimizer") if layout[1] == 3 else KINDS[:3]
        pairs = [(got[k], want[f"{k}_bytes"]) for k in kinds]
        pairs += [(got["step_grads"], want["grads_step_bytes"])]
        if layout[1] == 3:  # reduced every microbatch: the grads' bound (assert_within_the_bound)
            assert got["grads"] <= want["grads_bytes"], (got, want)
            assert want["grads_step_bytes"] <= got["reducing"] <= want["grads_reducing_bytes"]
        elif layout[0] == "bfloat16":
            pairs += [(got["reducing"], want["grads_reducing_bytes"])]
        else:  # grads dropped once copied: the plan's one bucket copied is the dense and the
            # expert weights' together, a bound (states.packing_bytes)
            assert want["grads_step_bytes"] < got["reducing"] <= want["grads_reducing_bytes"]
        rel = 0 if layout[0] == "float32" else 0.01
        for a, b in pairs:
            assert a == pytest.approx(b, rel=rel, abs=0), (got, want)


# a vocabulary where the LM head's chunk transient is a large part of its rank's peak
WIDE_VOCAB = ("model.vocab_size=4096",)
HEAD_CASES = [("pp2-1f1b", ("float32", 0)), ("dp2", ("bfloat16", 1)), ("tp2-sp", ("float32", 0))]


@pytest.mark.spawn
@pytest.mark.parametrize(("mesh", "layout"), HEAD_CASES, ids=lambda v: str(v))
def test_the_head_transient_is_what_a_run_allocates(gloo_pool, mesh, layout):
    """A 4096-token vocabulary: the fused head's chunk transient (config/memory_head.py) is
    measured (HeadAllocations: what the head allocates at its height beside the saved bytes
    and grads) and the peak with it is the plan's within TOLERANCE; without the term the
    plan's peak would be more than TOLERANCE short on the head's ranks. Float32 with the
    grads made in backward (pp2, tp2) and bf16 weights with the grads made in forward (dp2)."""
    for got, want in measured_and_planned(gloo_pool, mesh, layout, WIDE_VOCAB):
        transient, peak = want["head_transient_bytes"], want["saved_peak_bytes"]
        assert got["peak"] == pytest.approx(peak, rel=TOLERANCE), (got, want)
        if transient:  # the head's rank: the term is measured, and it matters
            assert got["head"] > 0
            assert got["peak"] > (peak - transient) * (1 + TOLERANCE), (got, want)
        else:
            assert got["head"] == 0


class _Peak:
    """The most bytes a HeadAllocations held at once, polled at each of the head's ops."""

    def __init__(self) -> None:
        self.mode = HeadAllocations(self.poll)
        self.peak = 0

    def poll(self) -> None:
        self.peak = max(self.peak, sum(self.mode.live().values()))


@pytest.mark.parametrize("pipeline", [False, True], ids=["grads-in-forward", "pipeline"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_transient_bytes_is_what_the_head_allocates(pipeline, dtype):
    """config/memory_head.head_transient_bytes against the fused head + loss called as the
    model calls it (CPU: 256-row chunks, here 2 or 4), float32 weights, float32 or under
    bf16 autocast (autocast's weight cast, 6 B per logit): forward's height is what it holds at
    most beyond what it keeps when it returns (the saved tensors, the activations' terms),
    backward's all it allocates, the grads it returns included; the larger within TOLERANCE."""
    from megapipe.config.memory_head import head_transient_bytes
    from megapipe.config.memory_terms import head_grad_in_forward, rank_dims
    from megapipe.parallel.tensor.cross_entropy import linear_cross_entropy
    from megapipe.parallel.tensor.sharding import TPInfo

    extra = ["parallel.pp=2", "parallel.microbatches=2"] if pipeline else []
    run = f"run.dir={tempfile.mkdtemp()}"
    cfg = load_config(TINY, [*SMALL, *WIDE_VOCAB, "train.global_batch=16", f"train.dtype={dtype}",
                             "model.seq_len=64", *extra, run])  # fmt: skip
    assert head_grad_in_forward(cfg) != pipeline
    x = rank_dims(cfg)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(x.b, x.q, cfg.model.d_model, generator=gen, requires_grad=True)
    weight = torch.randn(x.vocab, cfg.model.d_model, generator=gen).mul_(0.02).requires_grad_()
    targets = torch.randint(0, cfg.model.vocab_size, (x.b, x.q), generator=gen)
    tp = TPInfo(1, 0, None, False)
    forward, backward = _Peak(), _Peak()
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"), forward.mode:
        loss = linear_cross_entropy(
            h, weight, targets, 0, cfg.model.vocab_size, tp, grad_in_forward=not pipeline
        )
    kept = sum(forward.mode.live().values())
    with backward.mode:
        loss.backward()
    measured = max(forward.peak - kept, backward.peak)
    assert x.n >= 2 * 256  # several chunks
    assert measured == pytest.approx(head_transient_bytes(cfg, "cpu"), rel=TOLERANCE)


@pytest.mark.parametrize(("mesh", "layout"), CASES)
def test_the_cases_plan_alike_on_cuda(mesh, layout):
    """What train.py prints (the CUDA kernels' plan) is what the CPU run is held to. The saved
    tensors are the same on both: CUDA's autocast runs LayerNorm in float32 where the CPU's
    runs it in bf16, but either keeps its input alone (config/memory_terms._norm). Under bf16
    weights the backward's working set differs (net of the head's saved tensors it frees
    first), and so does the head's: its chunk's weight grad goes into the float32 main grad
    through CUDA's float32 product, or the CPU's widened operands (memory_head._into_main);
    so may the peak."""
    cfg = config(mesh, layout)
    cuda, cpu = as_json(cfg), as_json(cfg, "cpu")
    if layout[0] == "float32":
        assert cuda == cpu
        return
    for a, b in zip(cuda["ranks"], cpu["ranks"]):
        assert a["activations_bytes"] == b["activations_bytes"]
        device_kernels = ("peak_bytes", "backward_bytes", "head_transient_bytes")
        assert {k: v for k, v in a.items() if k not in device_kernels} == {
            k: v for k, v in b.items() if k not in device_kernels
        }


def test_every_field_is_in_the_json():
    """The fields issue 33 names, and the two grads moments, for every (pp, tp) rank; the
    peak is the larger moment and max_peak_bytes the largest peak."""
    for mesh, layout in [(p.values[0], p.values[1]) for p in CASES]:
        out = as_json(config(mesh, layout))
        assert out["params"] > 0 and out["max_peak_bytes"] == max(
            r["peak_bytes"] for r in out["ranks"]
        )
        for r in out["ranks"]:
            assert set(r) == {
                "pp",
                "tp",
                "params",
                "weights_bytes",
                "grads_bytes",
                "grads_step_bytes",
                "grads_reducing_bytes",
                "optimizer_bytes",
                "activations_bytes",
                "head_transient_bytes",
                "backward_bytes",
                "peak_bytes",
                "host_bytes",  # recompute.mode=offload's saved tensors; 0 here
            }
            assert r["host_bytes"] == 0
            transient = max(r["head_transient_bytes"], r["backward_bytes"])
            at_activations = sum(r[f"{k}_bytes"] for k in KINDS) + transient
            reducing = r["weights_bytes"] + r["grads_reducing_bytes"] + r["optimizer_bytes"]
            no_grads = at_activations - r["grads_bytes"]  # float32 grads made after the peak
            # zero=3: weights_bytes counts the most gathered at once; the reduction holds the
            # blocks the last backward ends with, which may be fewer
            low = no_grads if layout[1] == 3 else max(no_grads, reducing)
            assert low - 4 <= r["peak_bytes"] <= max(at_activations, reducing) + 4


def test_zero_levels_are_measured_where_they_shard():
    """On the dp2 mesh each level shards what it should: zero=1 the optimizer state (a half of
    zero=0's), zero=2 also the grads held over the step, zero=3 also the weights (its shard
    plus two gathered layers, the largest consecutive blocks here)."""
    json = {z: as_json(config("dp2", ("float32", z)))["ranks"][0] for z in range(4)}
    assert json[1]["optimizer_bytes"] == pytest.approx(json[0]["optimizer_bytes"] / 2, abs=8)
    assert json[2]["grads_step_bytes"] == pytest.approx(json[1]["grads_step_bytes"] / 2, abs=8)
    layer = chunk_params(config("dp2", ("float32", 3)), range(1, 2), 0)
    assert json[3]["weights_bytes"] == pytest.approx(
        json[0]["weights_bytes"] / 2 + 8 * layer, abs=8
    )


def table() -> str:
    """Every case planned against measured, a markdown table (the benchmarks page's)."""
    from tests.parity import Pools

    pools, rows = Pools(), []
    fields = [*KINDS, "peak"]
    try:
        for param in CASES:
            mesh, layout = param.values
            seen = set()
            for got, want in measured_and_planned(pools, mesh, layout):
                if (got["pp"], got["tp"]) in seen:
                    continue
                seen.add((got["pp"], got["tp"]))
                cells = [
                    f"{want[f'{k}_bytes']:,} / {got[k]:,} ({got[k] / want[f'{k}_bytes'] - 1:+.1%})"
                    for k in fields
                ]
                rank = f"pp{got['pp']} tp{got['tp']}"
                rows.append(
                    f"| {mesh} | {layout[0]} zero={layout[1]} | {rank} | {' | '.join(cells)} |"
                )
    finally:
        pools.close()
    head = "| mesh | layout | rank | " + " | ".join(f"{k} planned / measured" for k in fields)
    return "\n".join([head + " |", "|---" * (3 + len(fields)) + "|", *rows])


if __name__ == "__main__":  # python -m tests.test_dry_run_allocations: the table
    print(table())
