"""The experts' matmul: rows grouped by expert, each group times its expert's slice of a stacked
weight (E, out, in), with the weight grad deferrable to a Zero Bubble W action.

`grouped_linear(x, weight, bias, counts, owner, name)` is y[g] = x[g] W[e]ᵀ + b[e] for the
consecutive row groups g of sizes `counts` (one per expert e). Backward makes grad_x and the
bias grads now; the stacked weight grad now, or queued on `owner.wgrad_queue` under the active
B key (parallel/autograd/weight_grad.py) and done by `owner.deferred_weight_grad` when the W
action runs. Under bf16 weights the weight grad goes in float32 straight into the parameter's
`main_grad` (parallel/precision.py).

Each of the three matmuls (forward x·Wᵀ, grad_x = g·W, grad_W = gᵀ·x with the groups cutting the
contraction) is one call of torch's grouped matmul (`torch._grouped_mm`, behind
_torch_compat.grouped_mm; Megatron-Core's --moe-grouped-gemm and torchtitan's MoE use a grouped
GEMM for the same reason: one kernel instead of E small ones) where `grouped_mm_ok` says the
call can take it, and a loop of per-expert matmuls otherwise. The rule (`grouped_mm_for`, also
read by perf/software.resolved_for for a profile's GPU): on the CPU for float32, bf16 and fp16
(torch's CPU kernel: its own loop of matmuls in C++, without Python's per-expert dispatch); on
CUDA for bf16 on sm90 and sm100 (torch's CUTLASS grouped kernel); not float32 nor other GPUs on
CUDA, where torch falls back to a loop that reads the offsets on the host (a sync ours does not
need). A call also needs its `in` and `out` widths in whole 16-byte units (every operand's
leading stride, transposes included) and fewer than 1024 groups, and the device and dtype must
have passed a one-time probe against the loop (`_probe`: a warning and the loop where not). A
bf16 forward with a bias (gpt2's experts) stays the loop, whose F.linear adds the bias inside
its float32 sums; its input and weight grads are grouped. Under bf16 weights the weight grad
into the float32 main grad is grouped on the CPU with widened operands (exact products, float32
sums, as precision.fused_weight_grad widens there), then added: the same numerics as the loop's
addmm but for the rounding of that one add (float32 round-off). On CUDA it stays a loop of
fused_weight_grad, whose matmul writes float32 (torch's grouped bf16 kernel writes only bf16:
the grad would be rounded to bf16 before its float32 sum).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from megapipe._torch_compat import grouped_mm, has_grouped_mm, is_fake, quiet_fake_meta_errors
from megapipe.distributed.devices import capability as device_capability
from megapipe.parallel.autograd.weight_grad import autocast_operands, save_operands, saved_operands
from megapipe.parallel.precision import (
    fused_weight_grad,
    main_grad_arrived,
    weight_grad_landed,
)

# CUDA compute capability majors of torch's bf16 grouped kernel (CUTLASS, sm90 and sm100: its
# fast path's _scaled_mm_allowed_device(sm90_only, sm100_only) in aten's GroupedBlas.cpp)
GROUPED_MAJORS = (9, 10)
CPU_DTYPES = ("float32", "bfloat16", "float16")
ALIGN_BYTES = 16  # each operand's leading stride (torch's grouped kernels' TMA alignment)
MAX_GROUPS = 1023  # torch's bf16 CUDA kernel takes fewer than 1024 groups


def grouped_mm_for(device: str, capability: tuple[int, int] | None, dtype: str) -> bool:
    """Whether the experts' matmuls take torch's grouped matmul on `device` ("cpu" | "cuda") of
    compute `capability` ((major, minor); None: unknown) for `dtype` operands ("float32",
    "bfloat16", "float16"): the device rule of grouped_mm_ok, and the one the performance model
    reads for a profile's GPU (Runtime.moe_grouped_gemm). Pure Python."""
    if device == "cpu":
        return dtype in CPU_DTYPES
    if device == "cuda":
        return dtype == "bfloat16" and capability is not None and capability[0] in GROUPED_MAJORS
    return False


def grouped_mm_ok(x: torch.Tensor, out_features: int, groups: int) -> bool:
    """Whether rows `x` (N, in) in `groups` groups times a stacked (groups, out_features, in)
    weight of x's dtype take torch's grouped matmul (module docstring): this torch has it, the
    device and dtype do (grouped_mm_for), `in` and `out_features` fill whole 16-byte units,
    fewer than 1024 groups, and the probe of this device and dtype agreed with the loop."""
    if not has_grouped_mm() or groups > MAX_GROUPS or x.dim() != 2:
        return False
    capability = device_capability(x.device) if x.device.type == "cuda" else None
    if not grouped_mm_for(x.device.type, capability, str(x.dtype).removeprefix("torch.")):
        return False
    if (x.shape[1] * x.element_size()) % ALIGN_BYTES:
        return False
    if (out_features * x.element_size()) % ALIGN_BYTES:
        return False
    return _probe(x.device, x.dtype, fake=True) if is_fake(x) else _probe(x.device, x.dtype)


@functools.cache
def _probe(device: torch.device, dtype: torch.dtype, fake: bool = False) -> bool:
    """Once per device, dtype, and fake or real tensors (fake ones run torch's meta rule, which
    in torch 2.13 takes only bf16 where the CPU kernel takes float32 too, so `train.py
    --fake-ranks` asks the rule its own tensors meet): torch's grouped matmul against the loop,
    forward, grad_x and grad_W, with empty groups first, inside and last, and with no rows at
    all. The operands
    are small integers, so every product and sum is exact and any correct kernel agrees
    bit for bit. A mismatch or an error: a one-line warning, and the loop for them."""
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False), quiet_fake_meta_errors():
            bad = _mismatch(device, dtype, (0, 3, 0, 2, 0)) or _mismatch(device, dtype, (0, 0))
    except (RuntimeError, NotImplementedError, TypeError) as e:
        bad = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if bad:
        warnings.warn(
            f"torch._grouped_mm {bad} on {device} {dtype}: the experts run as a loop of matmuls",
            stacklevel=2,
        )
    return not bad


def _mismatch(device: torch.device, dtype: torch.dtype, counts: tuple[int, ...]) -> str:
    """What torch's grouped matmul gets wrong on rows grouped by `counts` ("" if nothing)."""
    gen = torch.Generator().manual_seed(0)
    n, e, d_in, d_out = sum(counts), len(counts), 16, 24

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=gen).to(device=device, dtype=dtype)

    x, w, g = ints(n, d_in), ints(e, d_out, d_in), ints(n, d_out)
    offs = _offsets(counts, device)
    got = (_forward(x, w, offs), _input_grad(g, w, offs), _weight_grad(x, g, offs))
    want = (_loop_forward(x, w, None, counts), _loop_input_grad(g, w, counts))
    want += (_loop_weight_grad(x, g, counts),)
    for what, a, b in zip(("forward", "input grad", "weight grad"), got, want, strict=True):
        if a.shape != b.shape or not torch.equal(a, b):
            return f"gives a wrong {what} for groups {counts}"
    return ""


def _offsets(counts, device: torch.device) -> torch.Tensor:
    """The groups' int32 end offsets, cumsum(counts)."""
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


# each matmul grouped ((N, in) rows, (E, out, in) weight, (N, out) grads) and as a loop


def _forward(x, weight, offs):
    return grouped_mm(x, weight.transpose(1, 2), offs)  # (N, out)


def _input_grad(grad_out, weight, offs):
    return grouped_mm(grad_out, weight, offs)  # (N, in)


def _weight_grad(x, grad_out, offs):
    return grouped_mm(grad_out.t(), x, offs)  # (E, out, in): an empty group's zeros


def _loop_forward(x, weight, bias, counts):
    outs = [F.linear(xe, weight[e], None if bias is None else bias[e]) for e, xe in
            enumerate(x.split(counts))]  # fmt: skip
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


def _loop_input_grad(grad_out, weight, counts):
    return torch.cat([g @ weight[e] for e, g in enumerate(grad_out.split(counts))])


def _loop_weight_grad(x, grad_out, counts):
    return torch.stack([g.t() @ xe for g, xe in zip(grad_out.split(counts), x.split(counts))])


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, counts, owner, name, bias_name):
        param = weight
        x, weight, bias = autocast_operands(x, weight, bias)
        grouped = weight.is_contiguous() and grouped_mm_ok(x, weight.shape[1], len(counts))
        x = x.contiguous() if grouped else x
        save_operands(ctx, x, param, weight)
        ctx.counts, ctx.owner, ctx.name, ctx.has_bias = counts, owner, name, bias is not None
        ctx.bias_name, ctx.grouped = bias_name, grouped
        # the groups' offsets on the device, made once for forward and backward (a host copy)
        ctx.offs = _offsets(counts, x.device) if grouped else None
        # a low-precision bias goes inside the matmul's float32 sums as F.linear adds it (one
        # rounding): after the grouped kernel's bf16 output it would round twice, and the
        # training's bf16 bounds (tests/test_parity_bf16.py) hold for the loop's numerics
        inside = bias is not None and x.dtype != torch.float32
        with torch.autocast(x.device.type, enabled=False):
            if not grouped or inside:
                return _loop_forward(x, weight, bias, counts)
            y = _forward(x, weight, ctx.offs)
            if bias is not None:  # each row its expert's bias, in float32
                sizes = torch.tensor(counts, device=x.device)
                y = y + bias.repeat_interleave(sizes, dim=0, output_size=x.shape[0])
            return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = saved_operands(ctx)
        grad_out, counts = grad_out.to(weight.dtype), ctx.counts
        if ctx.grouped:
            grad_out = grad_out.contiguous()  # an expanded grad has no leading stride
            grad_x = _input_grad(grad_out, weight, ctx.offs)
        else:
            grad_x = _loop_input_grad(grad_out, weight, counts)
        owner = ctx.owner
        groups = grad_out.split(counts)
        grad_b = bias_grad(getattr(owner, ctx.bias_name), groups) if ctx.has_bias else None
        key = owner.wgrad_queue.key
        if key is not None:
            owner.wgrad_queue.setdefault(key, []).append((ctx.name, x.detach(), grad_out, counts))
            return grad_x, None, grad_b, None, None, None, None
        grad_w = stacked_weight_grad(getattr(owner, ctx.name), x, grad_out, counts, ctx.offs)
        return grad_x, grad_w, grad_b, None, None, None, None


def bias_grad(param, groups) -> torch.Tensor | None:
    """(E, out) grad of a stacked bias, each expert's rows summed in float32: straight into
    the bias's main grad under bf16 weights (None returned), as parallel/precision.add_bias
    does for the dense row biases (a bf16 sum would round differently per split of rows)."""
    return weight_grad_landed(param, torch.stack([g.float().sum(0) for g in groups]))


def stacked_weight_grad(param, x, grad_out, counts, offs=None) -> torch.Tensor | None:
    """(E, out, in) grad of the stacked weight `param`: each expert's g_eᵀ x_e, grouped where
    grouped_mm_ok says so (`offs`: the groups' offsets where the caller has them). Under bf16
    weights it is added into `param.main_grad` in float32 instead (module docstring), and None
    returned."""
    main = getattr(param, "main_grad", None)
    grouped = grouped_mm_ok(x, grad_out.shape[1], len(counts))
    if grouped:
        x, grad_out = x.contiguous(), grad_out.contiguous()
        offs = _offsets(counts, x.device) if offs is None else offs
    if main is None:
        if grouped:
            return _weight_grad(x, grad_out, offs)
        return _loop_weight_grad(x, grad_out, counts)
    if grouped and x.device.type == "cpu":  # widened: exact products, float32 sums
        main.add_(_weight_grad(x.float(), grad_out.float(), offs))
    else:
        for e, (g, xe) in enumerate(zip(grad_out.split(counts), x.split(counts))):
            fused_weight_grad(main[e], g, xe)
    main_grad_arrived(param)
    return None


def grouped_linear(
    x, weight, bias, counts: list[int], owner, name: str, bias_name: str | None = None
) -> torch.Tensor:
    """Rows `x` (N, in) grouped by expert (`counts`), each group times its expert's weight
    `owner.<name>` plus its bias `owner.<bias_name>`."""
    return _GroupedLinear.apply(x, weight, bias, tuple(counts), owner, name, bias_name)
