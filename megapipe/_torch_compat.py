"""Every private torch API megapipe uses, each behind one small named function.

Names that start with an underscore may move or change signature in any torch release. Kept
here, a torch upgrade breaks one module, and tests/test_torch_compat.py calls each wrapper so
that the break is a test failure naming the torch version and the API, not a wrong run. No
other library module touches a private torch name (tests/test_torch_compat.py scans for it).

"Works on" below: this venv's torch 2.13 runs every wrapper (the tests; the CUDA flash ops bound
on meta tensors only). design.md's GPU machines run torch 2.11, where the same wrappers must
work: there, `pytest tests/test_torch_compat.py` is the check (its CUDA values test runs only on
a GPU). This module imports only torch: it is the lowest torch layer (tests/test_layers.py).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace_json
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.distributed_c10d import _set_pg_timeout, _world
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

Tensor = torch.Tensor

# ---------------------------------------------------------------- tensors and autograd


def storage_use_count(tensor: Tensor) -> int:
    """How many references hold `tensor`'s storage, the temporary one made to ask included
    (torch._C._storage_Use_Count on the storage's C handle `_cdata`). Kept buffers lend a
    buffer only while nothing else holds it (parallel/autograd/kept_buffers.py).
    Works on torch 2.13; no public equivalent."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def view_base(tensor: Tensor) -> Tensor | None:
    """The tensor `tensor` is a view of (None: not a view; Tensor._base). Used to leave a
    view's storage alone when freeing a sent output (parallel/autograd/outputs.py), and to key
    RoPE's shared tables by the positions a view slices (models/rope.SharedTables).
    Works on torch 2.13."""
    return tensor._base


def run_backward(roots: tuple[Tensor, ...], grads: tuple[Tensor | None, ...]) -> None:
    """Backward from `roots` with `grads`, as torch.autograd.backward without its check that
    each grad has its root's shape (a released pipeline output has lost its shape:
    parallel/autograd/outputs.py). Variable._execution_engine.run_backward(tensors,
    grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad).
    Works on torch 2.13."""
    torch.autograd.Variable._execution_engine.run_backward(
        roots, grads, False, False, (), True, True
    )


def queue_backward_callback(fn) -> None:
    """Run `fn()` when the backward pass running now ends (Variable._execution_engine
    .queue_callback, as FSDP's post-backward callback): ZeRO-3 frees the weights its last
    block's backward gathered (parallel/data/zero3.py). Only valid inside a backward.
    Works on torch 2.13."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# ---------------------------------------------------------------- grouped matmul


def has_grouped_mm() -> bool:
    """Whether this torch has `torch._grouped_mm` (torch 2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """torch._grouped_mm(a, b, offs=offs): with `a` 2-D (N, k) and `b` 3-D (G, k, n), row
    group g (rows offs[g-1]..offs[g]) times b[g], (N, n); with both 2-D, `a` (m, N) and `b`
    (N, n), the groups cut the contraction: (G, m, n), an empty group giving zeros. `offs` is
    the int32 cumulative group sizes. Each matrix's leading stride must be a multiple of 16
    bytes. The experts' matmul (parallel/autograd/grouped_linear.py). Works on torch 2.13."""
    return torch._grouped_mm(a, b, offs=offs)


# ---------------------------------------------------------------- float8 matmul


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """torch._scaled_mm(a, b) in float32: `a` (M, K) row-major and `b` (K, N) column-major
    float8, each times its dequantization scale: () for the tensor, or (M, 1) and (1, N) per
    row of `a` and column of `b` (parallel/fp8.py). torch has a CPU kernel (it upcasts) and
    CUDA ones on sm89 and later. Works on torch 2.13."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)


# ---------------------------------------------------------------- optimizer kernels


def foreach_norm(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """The L2 norm of each tensor, one fused kernel for the list (torch._foreach_norm).
    torch documents the _foreach_* ops as a beta API "subject to change", and their names are
    private by the underscore rule, so they live here too. Works on torch 2.13."""
    return torch._foreach_norm(tensors, 2, dtype=dtype)


def foreach_mul_(tensors: list[Tensor], scale: Tensor) -> None:
    """Multiply each tensor in place by `scale` (torch._foreach_mul_; see foreach_norm).
    Works on torch 2.13."""
    torch._foreach_mul_(tensors, scale)


def fused_adamw_devices() -> set[str]:
    """Device types torch's fused optimizer kernels support
    (torch.utils._foreach_utils._get_fused_kernels_supported_devices): AdamW runs fused where
    every parameter's device is one (train/optim.py). Works on torch 2.13."""
    return set(_get_fused_kernels_supported_devices())


def muon_orthogonalize(
    update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalisation of one 2-D matrix (a bfloat16
    result; torch.optim._muon._zeropower_via_newtonschulz). train/muon.py runs it per logical
    matrix of a tp shard. Works on torch 2.13 (and 2.11, which ships torch.optim.Muon)."""
    return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's learning rate for a matrix of logical `shape` (A, B): "original"
    lr·√max(1, A/B), "match_rms_adamw" 0.2·lr·√max(A, B) (torch.optim._muon._adjust_lr).
    Works on torch 2.13."""
    return _adjust_lr(lr, adjust_lr_fn, torch.Size(shape))


# ---------------------------------------------------------------- process groups


def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """The sub-mesh of `mesh` over `dims` as one flattened dimension called `name`
    (DeviceMesh._flatten): its group spans every rank of those axes (dp × cp for the gradient
    reduction, distributed/mesh.py). Works on torch 2.13."""
    return mesh[dims]._flatten(name)


def set_group_timeout(group, timeout: datetime.timedelta) -> None:
    """Set an existing group's timeout (distributed_c10d._set_pg_timeout): DeviceMesh makes its
    groups with torch's default, and a dead peer must fail every wait within the run's
    timeout (distributed/mesh.py). Works on torch 2.13."""
    _set_pg_timeout(timeout, group)


def flight_recorder_trace() -> dict:
    """This process's flight-recorder trace (_C._dump_fr_trace_json): the last
    TORCH_FR_BUFFER_SIZE collectives of its groups, each with its name, group, sizes, state and
    sequence id. The JSON form, so nothing pickled is ever read (distributed/flight.py). Works on
    torch 2.13, under gloo too (which records collectives, not send/recv)."""
    return json.loads(_dump_fr_trace_json(includeCollectives=True))


def process_group_ranks() -> dict[str, tuple[str, list[int]]]:
    """{group name: (description, global ranks)} of every group this process belongs to
    (distributed_c10d._world.pg_names): the flight recorder names a group, not its ranks.
    Works on torch 2.13."""
    return {
        name: (getattr(group, "group_desc", ""), dist.get_process_group_ranks(group))
        for group, name in _world.pg_names.items()
    }


# ---------------------------------------------------------------- sharded checkpoints


def sharded_tensor(blocks: Sequence[tuple[Sequence[int], Tensor]], shape: Sequence[int], group):
    """A ShardedTensor of logical `shape` holding this rank's `blocks` ((offsets, tensor) each)
    over `group` (ShardedTensor._init_from_local_shards; the metadata exchange is a collective
    over `group`). torch.distributed.checkpoint writes and reads it as blocks of one logical
    tensor (train/checkpoint.py, train/checkpoint_zero.py). Works on torch 2.13."""
    shards = []
    for offsets, block in blocks:
        placement = f"rank:{dist.get_rank()}/{block.device}"
        meta = ShardMetadata(list(offsets), list(block.shape), placement)
        shards.append(Shard(block.contiguous(), meta))
    return ShardedTensor._init_from_local_shards(shards, *shape, process_group=group)


def narrow_to_block(tensor: Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> Tensor:
    """The view of `tensor` at `offsets` of `sizes` along every dimension
    (torch.distributed._shard._utils.narrow_tensor_by_index): where a checkpoint reader copies
    a saved chunk's overlap (train/checkpoint_read.py). Works on torch 2.13."""
    return narrow_tensor_by_index(tensor, offsets, sizes)


# ---------------------------------------------------------------- flash attention with lse
# Ring attention merges blocks by their log-sum-exp, which only the private aten flash ops
# return (scaled_dot_product_attention does not): design.md, "GPU path".


def flash_attention_cpu(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """(out, lse (B, H, Tq) fp32) of torch's CPU flash kernel; handles GQA itself
    (aten._scaled_dot_product_flash_attention_for_cpu). Works on torch 2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def flash_attention_cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of flash_attention_cpu from the row's out and lse
    (aten._scaled_dot_product_flash_attention_for_cpu_backward). Works on torch 2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def flash_attention_cuda(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """(out, lse) of torch's CUDA flash kernel (fp16/bf16, as many kv heads as query heads)
    (aten._scaled_dot_product_flash_attention; no dropout, no debug mask). Its signature is
    checked on meta tensors here (torch 2.13); written for the GPU machines' torch 2.11."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return res[0], res[1]


def flash_attention_cuda_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of flash_attention_cuda (aten._scaled_dot_product_flash_attention_backward)
    for dense inputs: cum_seq_* undefined, max_* the block lengths, no dropout rng state.
    Checked on meta tensors here (torch 2.13); written for the GPU machines' torch 2.11."""
    tq, tk = q.shape[2], k.shape[2]
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse,
        None, None, tq, tk, 0.0, causal, None, None, scale=scale,
    )  # fmt: skip


def cudnn_attention_cuda(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float):
    """(out, lse (B, H, Tq) fp32, natural log) of torch's cuDNN attention kernel (fp16/bf16)
    (aten._scaled_dot_product_cudnn_attention with compute_log_sumexp; no bias, no dropout).
    torch 2.13 returns the lse as (B, H, Tq, 1): reshaped to the flash kernel's (B, H, Tq).
    Its signature and shapes are checked on meta tensors here (torch 2.13); written for the GPU
    machines' torch 2.11, where kernels.pick_kernel checks its values against the flash
    kernel's before a ring uses it."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return res[0], res[1].reshape(q.shape[0], q.shape[1], q.shape[2])


@functools.cache
def _cudnn_lse_is_4d() -> bool:
    """Whether this torch's cuDNN attention keeps the lse as (B, H, Tq, 1) (its meta kernel,
    the shape its backward reads), asked once."""
    x = torch.empty(1, 1, 2, 8, device="meta", dtype=torch.bfloat16)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, True)
    return res[1].dim() == 4


def cudnn_attention_cuda_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of cudnn_attention_cuda from the row's out and lse (B, H, Tq)
    (aten._scaled_dot_product_cudnn_attention_backward) for dense inputs: no bias, cum_seq_*
    undefined, max_* the block lengths, no dropout (the philox seed and offset unused).
    Checked on meta tensors here (torch 2.13); written for the GPU machines' torch 2.11."""
    tq, tk = q.shape[2], k.shape[2]
    shape = (*lse.shape, 1) if _cudnn_lse_is_4d() else lse.shape
    lse = lse.reshape(shape).contiguous()
    unused = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, unused, unused,
        None, None, None, tq, tk, 0.0, causal, scale=scale,
    )  # fmt: skip


# ---------------------------------------------------------------- fake ranks (one process)
# `train.py --fake-ranks` runs any rank of any world in this process: torch's fake process
# group backend (every collective returns at once) and fake tensors (shapes, no data).


def fake_store():
    """The store the "fake" process-group backend is initialised with
    (torch.testing._internal.distributed.fake_pg.FakeStore; torchtitan's dry runs use it).
    distributed/fake_world.py. Works on torch 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode():
    """A mode in which every tensor made is a FakeTensor (torch._subclasses.FakeTensorMode):
    the real code runs on shapes and devices, no data, no memory. Tensors made outside it are
    accepted. train/fake_ranks.py. Works on torch 2.13."""
    from torch._subclasses import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def quiet_fake_meta_errors():
    """Fake tensor mode logs a failing meta rule at ERROR with its traceback
    (torch._subclasses.fake_tensor's logger, torch 2.13). A handler that keeps its records
    (pytest's log capture) then keeps the traceback's frames, and with them the callers'
    tensors, alive for the rest of the run: `--fake-ranks` would measure them as live. For a
    probe whose failure is expected and reported in its own words."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a FakeTensor (torch._subclasses.fake_tensor.is_fake): its ops run torch's
    meta rules, which may take fewer dtypes than the device's kernels (grouped_linear's probe
    asks them apart). Works on torch 2.13."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(t)


def local_scalar_op():
    """The aten op behind `.item()`, `bool(t)` and `float(t)` (aten._local_scalar_dense):
    fake tensors hold no value, so the fake-rank run answers it (train/fake_ranks.py).
    Works on torch 2.13."""
    return torch.ops.aten._local_scalar_dense.default


def uncounted_flops() -> dict:
    """FlopCounterMode's formulas for the ops megapipe runs that it does not count: the CPU
    flash-attention ops (it knows the CUDA flash, efficient and cuDNN ones), the same
    4·b·h·s_q·s_k·d forward and its backward as for those
    (aten._scaled_dot_product_flash_attention_for_cpu and _backward), and the in-place
    aten.addmm_. Works on torch 2.13."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def backward(dout, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(dout, q, k, v)

    def addmm_in_place(out, a, b, *args, out_shape=None, **kwargs):
        return 2 * a[0] * a[1] * b[1]  # (m x k)·(k x n): 2 FLOPs a multiply-add

    ops = torch.ops.aten
    return {
        ops._scaled_dot_product_flash_attention_for_cpu: forward,
        ops._scaled_dot_product_flash_attention_for_cpu_backward: backward,
        # in place, as parallel/precision.fused_weight_grad sums a weight grad into its float32
        # main grad: the same FLOPs as addmm, which alone has a formula
        ops.addmm_: addmm_in_place,
    }


class _NoModules:
    """A ModuleTracker that tracks nothing: every op's parent is "Global"."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        return None


def flop_counter() -> torch.utils.flop_counter.FlopCounterMode:
    """FlopCounterMode (with uncounted_flops) without its per-module breakdown: its
    ModuleTracker hooks every module's inputs and outputs with register_multi_grad_hook
    (torch/utils/module_tracker.py), whose closures keep the grads they see until all of a
    module's arrive; a pipeline stage's received grads were kept into the next step, bytes no
    device run holds (train/fake_ranks.py measures live storages). Only the total is read.
    Works on torch 2.13 (FlopCounterMode.mod_tracker)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=uncounted_flops())
    counter.mod_tracker = _NoModules()
    return counter


def completed_work():
    """A finished c10d Work as a c10d op returns it (boxed): the fake backend's p2p works never
    report completion (FakeWork keeps Work's is_completed() False), so a sender polling them
    (pipeline/p2p.StageLinks._reap) would keep every send buffer to the end of the step, which
    a device frees once its peer has received; the fake-rank run hands back this one instead
    (train/fake_ranks.py). torch._C._distributed_c10d._create_work_from_future. Works on torch
    2.13."""
    from torch._C._distributed_c10d import _create_work_from_future

    future = torch.futures.Future()
    future.set_result(None)
    return _create_work_from_future(future).boxed()


def unbox_group(script_object):
    """The ProcessGroup a c10d op received as a TorchScript object (ProcessGroup.unbox): a
    dispatch mode sees collectives as c10d ops on boxed groups (train/fake_ranks.py).
    Works on torch 2.13."""
    return dist.ProcessGroup.unbox(script_object)


def dispatch_mode_base() -> type:
    """The base class of a mode that sees every aten and c10d op
    (torch.utils._python_dispatch.TorchDispatchMode): the fake-rank run's measure
    (train/fake_ranks.py). Works on torch 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def storage_key(tensor: Tensor) -> int:
    """The identity of `tensor`'s storage, the same for every view of it (the C handle
    UntypedStorage._cdata): live bytes are counted once per storage (train/fake_ranks.py).
    Works on torch 2.13."""
    return tensor.untyped_storage()._cdata


def resize_storage(tensor: Tensor, nbytes: int) -> None:
    """Resize `tensor`'s storage to `nbytes` (0 frees it; its views stay), through the op FSDP2
    uses under compile, `inductor::resize_storage_bytes_`: unlike `UntypedStorage.resize_` it
    is dispatched, so a TorchDispatchMode sees ZeRO-3's frees (train/fake_ranks.py). Works on
    torch 2.13."""
    torch.ops.inductor.resize_storage_bytes_(tensor, nbytes)


def released_empty(shape, dtype: torch.dtype, device) -> Tensor:
    """A tensor of `shape` whose storage is freed (ZeRO-3's weights before their shard is made,
    models/init.py): allocated, then resized to 0."""
    out = torch.empty(shape, dtype=dtype, device=device)
    resize_storage(out, 0)
    return out


def is_released(tensor: Tensor) -> bool:
    """Whether `tensor` has elements but no storage (`released_empty`, ZeRO-3's freed buffers)."""
    return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def copy_tensor_hooks(src: Tensor, dst: Tensor) -> None:
    """Register on `dst` the grad hooks registered on `src` (`register_hook` and
    `register_post_accumulate_grad_hook`, kept by torch in `_backward_hooks` and
    `_post_accumulate_grad_hooks`): a parameter made anew keeps what its module hooked on the
    old one (models/init.materialize_released). Works on torch 2.13."""
    for hook in (getattr(src, "_backward_hooks", None) or {}).values():
        dst.register_hook(hook)
    for hook in (getattr(src, "_post_accumulate_grad_hooks", None) or {}).values():
        dst.register_post_accumulate_grad_hook(hook)


def resize_storage_op():
    """The op `resize_storage` dispatches, as a TorchDispatchMode sees it. Works on torch 2.13."""
    return torch.ops.inductor.resize_storage_bytes_.default


def real_mode():
    """A context in which no fake mode is active (torch._subclasses.fake_tensor.
    unset_fake_temporarily): the fake-rank run computes the values it knows, the routed experts'
    balanced counts, on real tensors (train/fake_values.py). Works on torch 2.13."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
