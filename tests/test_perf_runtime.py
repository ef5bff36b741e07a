"""The performance model's megapipe runtime (perf/software.py) against the code it describes: each
fact is read from the code's own choice or pinned here by a test that fails when the code
changes.

- The AdamW kind: the runtime prices train/optim.device_adamw_kind("cuda"), the function the
  optimizer's own choice (adamw_kind) is made of.
- The casts: float32 weights under bf16 autocast save (and so made) a bf16 copy of each linear
  weight per forward; bf16 weights make none. Their grads: float32 weights' .grad is float32
  (the bf16 weight grad cast back before it is added).
- The overlaps (gloo, dp=2): every grad bucket is launched from the grad hooks while backward
  runs (dp_overlap), and under zero=1 the weights' all-gather runs inside the optimizer step
  (param_gather_overlap False: the step waits for it). When parallel/data moves the gather to
  the next forward this test fails until the runtime says so.
- The tp overlap: the runtime's `tp_comm_overlap` is parallel/tensor/overlap.TP_COMM_OVERLAP,
  the SP linears take that path under parallel.tp_overlap, and the costs price it as hidden
  behind the matmul chunks (only what outlasts them exposed).
- ZeRO-2/3 traffic (gloo, dp=2): one float32 reduce-scatter per bucket per step (grad_bytes,
  under bf16 weights too), the weight all-gathers in the weights' dtype (param_bytes), zero=3's
  per block and microbatch; the projection prices no per-microbatch reduction at zero=2.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.validation import published
from benchmarks.validation.h100_validation import megapipe_config
from megapipe.config import load_config
from megapipe.distributed import collectives as C
from megapipe.parallel.fp8 import Fp8Linear
from megapipe.parallel.fp8_weight_cache import WeightCasts as StepCasts
from megapipe.parallel.precision import autocast
from megapipe.parallel.tensor.layers import ColumnParallelLinear
from megapipe.perf.cluster import load_cluster
from megapipe.perf.model import project
from megapipe.perf.software import (
    ADAMW_BYTES,
    MEGAPIPE,
    NORM_CLIP_BYTES,
    grad_accum_bytes,
    resolved,
    weight_cast_bytes,
)
from megapipe.train import optim
from megapipe.train.hooks import TrainHooks
from tests.conftest import ROOT
from tests.parity import build_mesh, tiny_config


def test_adamw_kind_is_the_codes():
    assert MEGAPIPE.adamw == optim.device_adamw_kind("cuda")
    assert MEGAPIPE.optimizer_bytes == ADAMW_BYTES[MEGAPIPE.adamw] + NORM_CLIP_BYTES
    # adamw_kind is made of device_adamw_kind: a CPU parameter gets the CPU's kind, a meta one
    # (no fused kernel) foreach, as the optimizer built over them runs
    cpu = torch.nn.Parameter(torch.zeros(3))
    assert optim.adamw_kind([{"params": [cpu]}]) == optim.device_adamw_kind("cpu")
    kind = optim.device_adamw_kind("cpu")
    assert optim.make_adamw([{"params": [cpu]}], lr=1e-3).defaults[kind]
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    assert optim.adamw_kind([{"params": [meta]}]) == optim.device_adamw_kind("meta") == "foreach"


class WeightCasts(TorchDispatchMode):
    """Counts the casts of a tensor of `shape` to bf16 from another dtype that ops make."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.made = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.ops.aten._to_copy.default and source is not None:
            same = source.shape == self.shape and out.dtype == torch.bfloat16
            self.made += int(same and source.dtype != torch.bfloat16)
        return out


def weight_casts(params_dtype: torch.dtype, fp8=None) -> tuple[int, int, int]:
    """A linear of `params_dtype` weights under bf16 autocast (an FP8 one where `fp8`, a
    parallel/fp8.Fp8Linear, is given): its weight's bf16 casts made in forward, in backward,
    and the tensors it saves that have the weight's shape and are not the weight itself."""
    layer = ColumnParallelLinear(16, 8, False).to(params_dtype)
    layer.fp8 = fp8
    w, saved = layer.weight, []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(4, 16, requires_grad=True)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, autocast("bfloat16", "cpu"), WeightCasts(w.shape) as forward:
        y = layer(x)
    with WeightCasts(w.shape) as backward:
        y.float().sum().backward()
    copies = [t for t in saved if t.shape == w.shape and t.data_ptr() != w.data_ptr()]
    assert w.grad.dtype == params_dtype  # a weight's grad is kept in its own dtype
    return forward.made, backward.made, len(copies)


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_weight_casts_are_what_autocast_makes(params_dtype):
    """The runtime's per-forward weight cast (read in the weight's dtype, a bf16 copy written)
    is the one the linear makes; it keeps the parameter, not the copy, and casts it again in
    backward (parallel/autograd/weight_grad.save_operands), which the runtime prices too."""
    forward, backward, copies = weight_casts(getattr(torch, params_dtype))
    cast = weight_cast_bytes(params_dtype, 2)
    assert copies == 0 and forward <= 1 and (forward > 0) == (cast > 0)
    assert backward == (forward if MEGAPIPE.backward_weight_casts else 0)
    if forward:
        assert cast == 2 + torch.finfo(getattr(torch, params_dtype)).bits // 8


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_linears_keep_the_parameter(recipe):
    """An FP8 linear saves its parameter too (parallel/fp8.weight_cast), not autocast's copy:
    outside a step its backward casts again for Wᵀ's FP8 cast; within a step
    (fp8_weight_cache.WeightCasts) only where that cast is not W's read transposed (rowwise)."""
    assert weight_casts(torch.float32, Fp8Linear(recipe)) == (1, 1, 0)
    cache = StepCasts()
    with cache.step():
        made = weight_casts(torch.float32, Fp8Linear(recipe, casts=cache))
    assert made == (1, int(recipe == "rowwise"), 0)


def test_resolved_runtime_by_dtypes():
    fp32 = resolved(MEGAPIPE, "float32")
    mixed = resolved(MEGAPIPE, "bfloat16")
    bf16 = resolved(MEGAPIPE, "bfloat16", "bfloat16")
    assert (fp32.weight_cast_bytes, fp32.grad_accum_bytes, fp32.autocast_casts) == (0, 12, False)
    assert (mixed.weight_cast_bytes, mixed.grad_accum_bytes, mixed.param_bytes) == (6, 18, 4)
    assert (bf16.weight_cast_bytes, bf16.grad_accum_bytes, bf16.param_bytes) == (0, 10, 2)
    assert bf16.optimizer_bytes == mixed.optimizer_bytes + 6  # main param -> bf16 weight
    assert resolved(bf16, "bfloat16", "bfloat16") == bf16  # idempotent
    assert grad_accum_bytes("float32", 2) == 18 and grad_accum_bytes("bfloat16", 2) == 10


class GatherWatch(TrainHooks):
    """Which collectives (distributed/collectives.COUNTER) the optimizer step launches, and how
    many weight gathers are still in flight when it returns (left for the next forward)."""

    def __init__(self, reducers: list) -> None:
        self.reducers = reducers

    def optimizer_begin(self) -> None:
        self.begin = len(C.COUNTER)

    def optimizer_end(self) -> None:
        self.inside = [op for op, _ in C.COUNTER[self.begin :]]
        self.in_flight = sum(len(getattr(r, "pending", {})) for r in self.reducers)


def overlaps(overrides: list[str]) -> dict:
    """One dp=2 step: the buckets launched in backward, and the collectives of the step."""
    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, build_mesh(cfg), "cpu", bucket_mb=0.02)
    reducers = [r for r in job.engine.reducers if r is not None]
    optimizer, watch = job.optimizer(), GatherWatch(reducers)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    C.COUNTER = []
    try:
        job.train_step(optimizer, data.batch(0, cfg.train.global_batch), 0, watch)
    finally:
        C.COUNTER = None
    return {
        "buckets": sum(len(r.buckets) for r in reducers),
        "in_backward": sum(r.overlapped for r in reducers),
        "gathers_in_step": watch.inside.count("all_gather"),
        "gathers_in_flight": watch.in_flight,
    }


@pytest.mark.spawn
@pytest.mark.parametrize("zero", [0, 1])
def test_the_overlaps_are_the_codes(gloo_pool, zero):
    overrides = ["parallel.dp=2", "parallel.microbatches=2", f"parallel.zero={zero}"]
    for got in gloo_pool(2).run(overlaps, overrides):
        assert got["buckets"] > 1
        assert (got["in_backward"] == got["buckets"]) == MEGAPIPE.dp_overlap, got
        if zero:  # every bucket's gather launched by the step; overlapped: left in flight
            assert got["gathers_in_step"] == got["buckets"], got
            assert (got["gathers_in_flight"] > 0) == MEGAPIPE.param_gather_overlap, got


def traffic(overrides: list[str]) -> dict:
    """One dp=2 step's collectives (op, bytes), and each bucket's padded flat size."""
    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, build_mesh(cfg), "cpu", bucket_mb=0.02)
    reducers = [r for r in job.engine.reducers if r is not None]
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    job.train_step(optimizer, data.batch(0, cfg.train.global_batch), 0)  # gathers pending after
    C.COUNTER = []
    try:
        job.train_step(optimizer, data.batch(1, cfg.train.global_batch), 1)
    finally:
        calls, C.COUNTER = C.COUNTER, None
    padded = [r.size * -(-b.numel // r.size) for r in reducers for b in r.buckets]
    return {"calls": calls, "padded": padded}


ZERO23 = [("bfloat16", 2), ("bfloat16", 3), ("float32", 2), ("float32", 3)]


@pytest.mark.spawn
def test_zero23_traffic_is_the_codes(gloo_pool):
    """What a step sends at zero 2 and 3 (gloo, dp=2, two microbatches): float32 reduce-scatters
    (grad_bytes: float32 main grads under bf16 weights too), one per bucket per step at zero=2
    (as perf/data_parallel.py prices them), one per bucket per microbatch at zero=3 (it always
    reduces every microbatch: config/comm_bytes.grad_reductions, which perf/data_parallel.py
    prices), and every weight all-gather in the weights' dtype (param_bytes:
    bf16 under bf16 weights): one per bucket after the step at zero=2, at zero=3 each block's
    for its forward and its backward, each microbatch."""
    for params_dtype, zero in ZERO23:
        dtypes = [f"train.params_dtype={params_dtype}", f"train.dtype={params_dtype}"]
        overrides = ["parallel.dp=2", "parallel.microbatches=2", f"parallel.zero={zero}", *dtypes]
        rt = resolved(MEGAPIPE, params_dtype, params_dtype)
        for got in gloo_pool(2).run(traffic, overrides):
            sent = {op: sorted(b for o, b in got["calls"] if o == op) for op, _ in got["calls"]}
            padded = sorted(got["padded"])
            sends = sorted(padded * (2 if zero == 3 else 1))  # zero=3: each of 2 microbatches
            assert sent["reduce_scatter"] == [n * rt.grad_bytes for n in sends], sent
            gathers = [n * rt.param_bytes for n in padded]
            if zero == 2:
                assert sent["all_gather"] == gathers, sent
            else:  # every microbatch: each block for its forward, again for its backward
                assert set(sent["all_gather"]) <= set(gathers), sent
                assert len(sent["all_gather"]) > 2 * len(gathers), sent


def test_projection_prices_the_layouts(tmp_path):
    """bf16 weights drop the casts (a faster step than float32 weights); zero=3 adds the
    per-microbatch weight gathers (zero=2 reduce-scatters once per step, as zero=1: pinned by
    test_zero23_traffic_is_the_codes); the peak falls with bf16 weights and zero=3."""
    cluster = load_cluster("h100", 8)
    base = ["parallel.dp=8", "parallel.microbatches=4", f"run.dir={tmp_path}"]
    out = {}
    for params_dtype, zero in [("float32", 1), ("bfloat16", 1), ("bfloat16", 2), ("bfloat16", 3)]:
        over = [*base, f"train.params_dtype={params_dtype}", f"parallel.zero={zero}"]
        cfg = load_config(os.path.join(ROOT, "configs", "gpt2_350m.yaml"), over)
        out[params_dtype, zero] = project(cfg, cluster).to_dict()
    f32, z1, z2, z3 = out.values()
    assert z1["step_time_s"] < f32["step_time_s"]
    every = [p["detail"]["dp_per_microbatch_max_rank_s"] for p in out.values()]
    assert every[0] == every[1] == every[2] == 0 < every[3]
    # zero=2 shards the grads held over the step, but with 4 microbatches the full local grads
    # they accumulate into live beside the activation peak: its peak is zero=1's
    f32_peak, z1_peak, z2_peak, z3_peak = (p["peak_memory_gib"] for p in out.values())
    assert f32_peak > z1_peak == z2_peak > z3_peak


def test_tp_comm_overlap_is_the_codes():
    """The runtime's tp overlap is the code's (parallel/tensor/overlap.py exports it), and the
    SP linears take the overlapped path exactly when parallel.tp_overlap's TPInfo says so
    (tests/test_tp_overlap.py checks that path's ring steps under gloo)."""
    from megapipe.parallel.tensor import overlap
    from megapipe.parallel.tensor.layers import RowParallelLinear
    from megapipe.parallel.tensor.sharding import TPInfo

    assert MEGAPIPE.tp_comm_overlap == overlap.TP_COMM_OVERLAP
    for lapped in (False, True):
        tp = TPInfo(2, 0, None, True, None, lapped)
        for layer in (ColumnParallelLinear(8, 8, True, tp), RowParallelLinear(8, 8, True, tp)):
            assert layer._overlapped() == lapped


def _tp_costs(runtime_name: str, *extra):
    """(layer F, its forward GEMMs' seconds, the projection's tp_comm_s) at tp=8 with SP, bf16
    weights: the plain path's collectives move the bytes the ring's do (the ring casts each
    piece to the compute dtype; the plain gather sends the residual stream's dtype)."""
    from megapipe.perf.cost_terms import CALIBRATION, shapes
    from megapipe.perf.costs import CostModel
    from megapipe.perf.software import RUNTIMES

    cfg = load_config(os.path.join(ROOT, "configs", "gpt2_1.3b.yaml"), [
        "parallel.tp=8", "parallel.sequence_parallel=true", "train.dtype=bfloat16",
        "train.params_dtype=bfloat16", "parallel.dp=1", "parallel.pp=1",
        "parallel.microbatches=1", "train.global_batch=8", *extra,
    ])  # fmt: skip
    t = cfg.train
    h100, runtime = load_cluster("h100"), resolved(RUNTIMES[runtime_name], t.dtype, t.params_dtype)
    cm = CostModel(cfg, h100, runtime, CALIBRATION)
    gemm_s = sum(cm.dev.gemm(m, n, k, 1, cm.c) for m, n, k in cm.gemm_shapes(shapes(cfg, None)))
    step = project(cfg, h100, runtime, memory=False).breakdown["tp_comm_s"]
    return cm.layer("none").F, gemm_s, step


def test_overlapped_tp_collectives_are_priced_as_hidden_behind_their_matmul_chunks():
    """parallel.tp_overlap on megapipe's runtime: a layer's SP collectives exposed only where
    a ring step outlasts its chunk's matmul: less than the whole, never less than what the
    matmuls cannot cover; a runtime without the overlap (Megatron 2021) pays it whole."""
    (off, gemm_s, step_off), (on, _, step_on) = (
        _tp_costs("megapipe", f"parallel.tp_overlap={v}") for v in ("false", "true")
    )
    assert on.compute == off.compute
    assert max(0.0, off.tp - gemm_s) <= on.tp < off.tp, (on.tp, off.tp, gemm_s)
    assert step_on < step_off
    old = [_tp_costs("megatron2021", f"parallel.tp_overlap={v}")[0] for v in ("false", "true")]
    assert old[0] == old[1] and old[0].tp > 0


def test_head_chunk_rows_by_device():
    """The fused head's chunk (config/memory_terms.head_chunk_rows, read by cross_entropy with the
    device's memory and by the costs with the cluster's): 256 tokens on the CPU whatever the
    vocabulary, and on a device that does not say its memory; on a GPU a chunk's float32 logits
    fill 1/128 of its memory: Llama 3's 128256 on an 80 GiB H100, 1308 tokens (81559 MiB as
    torch reads it: 1302); never under 256 nor over the microbatch."""
    from megapipe.config.memory_terms import CHUNK_ROWS, HEAD_CHUNK_SHARE, head_chunk_rows

    h100 = load_cluster("h100").hbm_bytes
    assert head_chunk_rows(50304, "cpu", None, h100) == head_chunk_rows(8192, "cpu") == 256
    assert CHUNK_ROWS == 256 and HEAD_CHUNK_SHARE == 128
    assert head_chunk_rows(128256, "cuda") == 256  # memory not given
    assert head_chunk_rows(128256, "cuda", None, h100) == 1308
    assert head_chunk_rows(128256, "cuda", None, 81559 * 2**20) == 1302
    assert head_chunk_rows(128256, "cuda", 1000, h100) == 1000
    assert head_chunk_rows(64000, "cuda", None, h100) == 2621  # Nemotron-4 over tp 4
    assert head_chunk_rows(10**8, "cuda", None, h100) == 256
    assert head_chunk_rows(50304, "cpu", 100) == 100


def test_head_chunks_priced_by_the_rule():
    """The projection prices the chunks the rule gives on the cluster's memory: the Llama 3.1
    8B row (one 4096-token microbatch per rank, pp 1: the grads made in forward) is four chunks
    on an 80 GiB H100; on an 8 GiB one, 256-row chunks, sixteen, and the head's F pays at least
    three more float32 accumulations of the V·d grad (12 B per element each), and the step is
    slower; a last chunk of 1 token is priced as 1 token."""
    import dataclasses

    from megapipe.config.memory_terms import HEAD_CHUNK_SHARE, head_chunk_rows, head_chunks
    from megapipe.perf.cost_terms import CALIBRATION
    from megapipe.perf.costs import CostModel

    (row,) = [r for r in published.load_all() if r.label == "dgxc-llama3.1-8b-8"]
    cfg = megapipe_config(published.measured(row).config)
    big = load_cluster("h100", row.gpus_per_node)
    small = dataclasses.replace(big, hbm_gib=8.0)
    head = cfg.model.n_layers + 1
    f = [CostModel(cfg, c, MEGAPIPE, CALIBRATION).block(head).F.compute for c in (big, small)]
    cm = CostModel(cfg, small, MEGAPIPE, CALIBRATION)
    table = cm.cfg.model.vocab_size * cfg.model.d_model  # tp 1: the whole (padded) table
    assert f[1] - f[0] >= cm.dev.mem(3 * 12 * table) > 0, (f, cm.dev.mem(3 * 12 * table))
    steps = [project(cfg, c, MEGAPIPE, memory=False).step_time_s for c in (big, small)]
    assert steps[0] < steps[1]
    # memory for 4095-row chunks: one of 4095 and one of 1 token, priced as such (not as two
    # of 4095): beside one chunk, one accumulation more and three 1-row GEMMs at most
    v, d = cfg.model.vocab_size, cfg.model.d_model

    def holding(rows: int):  # a cluster whose memory gives chunks of `rows` tokens
        return dataclasses.replace(big, hbm_gib=rows * 4 * v * HEAD_CHUNK_SHARE / 2**30)

    odd, whole = holding(4095), holding(4096)
    assert head_chunks(4096, head_chunk_rows(v, "cuda", 4096, odd.hbm_bytes)) == ((4095, 1), (1, 1))
    assert head_chunks(4096, head_chunk_rows(v, "cuda", 4096, whole.hbm_bytes))[1] == (4096, 1)
    two = CostModel(cfg, odd, MEGAPIPE, CALIBRATION)
    one = CostModel(cfg, whole, MEGAPIPE, CALIBRATION).block(head).F.compute
    one_row = sum(two.dev.gemm(*s, 1, two.c) for s in ((1, v, d), (1, d, v), (v, d, 1)))
    extra = two.block(head).F.compute - one
    assert two.dev.mem(12 * table) < extra <= two.dev.mem(12 * table) + one_row, extra


def test_dp_bucket_size_is_the_codes():
    """The buckets the code packs (train/parallelize: parallel/data/reducer.replica_bucket_mb of
    dp · cp) are the ones the projection prices (runtime.bucket_bytes of MEGAPIPE): 25 MB up to
    6 replicas, then 1M float32 grads per replica (Megatron-Core's rule); the weights' gather
    buckets hold the same parameters in the weights' dtype."""
    from megapipe.config.states import replica_bucket_mb
    from megapipe.perf.software import bucket_bytes

    for n in (1, 2, 4, 6, 7, 8, 64, 512, 2048):
        assert bucket_bytes(MEGAPIPE, n, 4) == pytest.approx(replica_bucket_mb(n) * 2**20)
        assert bucket_bytes(MEGAPIPE, n, 2) == pytest.approx(replica_bucket_mb(n) * 2**19)
    assert replica_bucket_mb(4) == 25.0 and replica_bucket_mb(512) > 1900


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_compile_prices_what_compile_math_fuses(params_dtype, tmp_path):
    """train.compile: the runtime fuses the layers' elementwise ops (fused_elementwise), and
    drops the norm outputs' autocast casts only where compile_math compiles the linears too
    (float32 weights at tp = 1); with bf16 weights the linears stay eager, and so the casts.
    Eager, neither: the runtime is resolved()'s by dtypes."""
    from megapipe.models.gpt import compiled_linears
    from megapipe.perf.software import resolved_for
    from megapipe.pipeline.stages import build_model

    over = [f"train.params_dtype={params_dtype}", "train.dtype=bfloat16"]
    eager_cfg = tiny_config(over, str(tmp_path))
    assert resolved_for(MEGAPIPE, eager_cfg) == resolved(MEGAPIPE, "bfloat16", params_dtype)
    cfg = tiny_config([*over, "train.compile=true"], str(tmp_path))
    layer = next(iter(build_model(eager_cfg, None, "cpu").layers.values()))
    layer.compile_math()  # as build_model does under train.compile, less the warm-up
    linears = (layer.attn.qkv, layer.attn.proj, *layer.mlp.linears())
    compiled = [linear._eager_math is None for linear in linears]
    assert compiled == [compiled_linears(cfg)] * 4 == [params_dtype == "float32"] * 4
    rt = resolved_for(MEGAPIPE, cfg)
    assert rt.fused_elementwise and rt.compiled_layers
    assert rt.autocast_casts == (params_dtype != "float32")
    assert not resolved_for(MEGAPIPE, eager_cfg).fused_elementwise


def test_attention_kernel_is_the_codes(tmp_path, monkeypatch):
    """The attention kernel priced for megapipe is the one models/attention.py runs on the
    profile's GPU: one rule (kernel_choice.attention_kernel_for) read by the model, the ring's
    kernel pick and the runtime; cuDNN's on the H100 and H200 profiles, flash on the A100."""
    import megapipe.models.attention as attention
    from megapipe.parallel.context import kernel_choice, kernels
    from megapipe.perf import software as runtime
    from megapipe.perf.cost_terms import CALIBRATION, shapes
    from megapipe.perf.costs import CostModel

    rule = kernel_choice.attention_kernel_for
    assert attention.attention_kernel_for is rule and kernels.attention_kernel_for is rule
    assert runtime.attention_kernel_for is rule and MEGAPIPE.attention_kernel == "auto"
    cfg = tiny_config(["train.dtype=bfloat16"], str(tmp_path))
    want = {"h100": "cudnn", "h200": "cudnn", "a100": "flash"}
    for gpu, kernel in want.items():
        cluster = load_cluster(gpu)
        assert CostModel(cfg, cluster, MEGAPIPE, CALIBRATION).rt.attention_kernel == kernel
        # the model's own choice on a bf16 CUDA tensor of that GPU's compute capability
        monkeypatch.setattr(attention, "device_capability", lambda i, c=cluster: c.capability)
        q = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.bfloat16)
        assert attention.dense_kernel(q) == kernel
    f32 = tiny_config(["train.dtype=float32"], str(tmp_path))
    assert CostModel(f32, load_cluster("h100"), MEGAPIPE, CALIBRATION).rt.attention_kernel != (
        "cudnn"
    )  # no cuDNN kernel for float32: SDPA's own choice
    # on H100 the cuDNN rate prices megapipe's attention; before, the flash rate did
    h100 = load_cluster("h100")
    cm = CostModel(cfg, h100, MEGAPIPE, CALIBRATION)
    flash = CostModel(cfg, h100, dataclasses.replace(MEGAPIPE, attention_kernel="flash"),
                      CALIBRATION)  # fmt: skip
    x = shapes(cfg)
    ratio = flash.attention_seconds(x)[0] / cm.attention_seconds(x)[0]
    assert ratio == pytest.approx(h100.cudnn_attention_efficiency / h100.attention_efficiency)
