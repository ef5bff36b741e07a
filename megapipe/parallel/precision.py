"""Mixed precision: bfloat16 autocast; under `train.params_dtype: bfloat16` Megatron's layout.

`Precision` is the policy, resolved once from the config (train/parallelize.py) and asked by what
it affects: the model's weights (`hold`), the autocast of the engines, the pipeline's message
dtype; a weight's own float32 `main_grad` (below) is what the linears, reducers and optimizers ask.

float32 params (the default): the weights, their grads and AdamW stay float32 and autocast
computes the matmuls in bf16 (each forward casts each weight).

bfloat16 params (Megatron-LM `--bf16`, Megatron-Core's DistributedDataParallel and
Float16OptimizerWithFloat16Params / DistributedOptimizer): every parameter (norm gains and
biases too, as Megatron) is held in bf16, so the forward casts no weight. Each parameter gets a
float32 `main_grad`, a view into one flat float32 buffer per module (`MainGrads`, laid out in
reverse registration order, the order `parallel/data/reducer.py` packs its buckets in, so a
bucket's main grads are one contiguous span the all-reduce sums in place). Every weight-grad
path accumulates into it in place: the linears' weight grads (now or in a Zero Bubble W action,
`parallel/autograd/weight_grad.py`) as a float32-output matmul added into it, Megatron's
gradient-accumulation fusion; every other grad autograd makes (norms, biases, embeddings, the
fused head's) by a post-accumulate-grad hook that adds the bf16 grad into it and drops it. The
optimizer steps float32 main params (`MainParamOptimizer` here for zero=0, the owned shard
only under zero>=1: parallel/data/zero.py, zero2.py, zero3.py) and writes them back into the
bf16 weights (their shard under zero=3). Under zero>=2 the buffer lives only from a step's first
forward to its reduce-scatter (`MainGrads.release` / `ensure`), as Megatron-Core's grad buffer
would if it were sharded: what is held over the step is each rank's float32 shard.
Reductions, the grad norm and the clip read `grad_of(p)`: the main grad where there is one.

`train.main_grads_dtype: bfloat16` makes the main grads bf16 (Megatron-Core's
`grad_reduce_in_fp32=False`, whose grad buffer is then bf16): half the bytes, each microbatch's
weight grad added by a bf16 matmul accumulating into it, the reduction in bf16. The optimizer
steps a float32 copy of them (`widened`), made for its step alone, as Megatron-Core's
distributed optimizer copies its bf16 grad shard into the float32 main params' grads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megapipe._torch_compat import is_released, released_empty, resize_storage
from megapipe.parallel.data.optimizer_interface import WholeState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(dtype: str, device: torch.device | str):
    """bfloat16 autocast when `dtype` (train.dtype) says so; else nothing."""
    if dtype == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Precision:
    """The precision policy: `compute`, the autocast dtype (train.dtype); `weights`, the
    parameters' dtype (train.params_dtype; bf16: float32 main grads and main params)."""

    compute: str = "float32"
    weights: str = "float32"
    grads: str = "float32"  # the main grads' (train.main_grads_dtype)

    @staticmethod
    def of(train) -> Precision:
        """The policy of the config's `train` section: where its three keys are read."""
        return Precision(train.dtype, train.params_dtype, train.main_grads_dtype)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The parameters' dtype, and the residual stream's between pipeline stages."""
        return DTYPES[self.weights]

    @property
    def main_grads(self) -> bool:
        """Low-precision weights: each has a float32 main grad (`attach_main_grads`)."""
        return self.weight_dtype != torch.float32

    def autocast(self, device: torch.device | str):
        """The forward's autocast on `device` (none for float32 compute)."""
        return autocast(self.compute, device)

    def hold(self, model: nn.Module) -> nn.Module:
        """`model`'s weights in this dtype (each initialised in float32 from (seed, name), then
        rounded: the same bf16 weights on every mesh), with float32 main grads under bf16.
        Buffers (RoPE tables) keep their dtype, and so do modules marked `keep_float32` (the
        MoE router, models/moe.py)."""
        if not self.main_grads:
            return model
        for module in model.modules():
            if getattr(module, "keep_float32", False):
                continue
            for p in module.parameters(recurse=False):
                p.data = _cast(p, self.weight_dtype)
        attach_main_grads(model, DTYPES[self.grads])
        return model


FLOAT32 = Precision()


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; storage-less stays storage-less (models/init.DeferredInit's weights,
    whose values are made in their final dtype)."""
    return released_empty(t.shape, dtype, t.device) if is_released(t) else t.data.to(dtype)


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient reductions, the norm, the clip and the optimizer read: the float32 main
    grad of a low-precision parameter, else `.grad`."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def widened(grad: torch.Tensor | None) -> torch.Tensor | None:
    """`grad` as the float32 main params step it: itself, or a float32 copy of a bf16 main
    grad (train.main_grads_dtype; Megatron-Core's optimizer copies its bf16 grad shard into
    the float32 main params' grads the same way)."""
    if grad is None or grad.dtype == torch.float32:
        return grad
    return grad.float()


def set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Replace `param`'s gradient by `grad`: written into its main grad (whose storage the
    buckets and the optimizer view) where it has one, else bound to `.grad`."""
    main = getattr(param, "main_grad", None)
    if main is None:
        param.grad = grad.to(param.dtype)
    else:
        main.copy_(grad)


class MainGrads:
    """One flat float32 buffer holding the `main_grad` of every trainable parameter of a
    low-precision `module`, in reverse registration order (the optimizer's zero_grad clears it:
    zero_main_grads); the few kept in float32 (an MoE router, models/moe.py) have one too, so
    every optimizer and reducer path treats them alike."""

    def __init__(self, module: nn.Module, dtype: torch.dtype = torch.float32) -> None:
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        device = params[0].device if params else torch.device("cpu")
        n = sum(p.numel() for p in params)
        # weights not made yet (ZeRO-3): their main grads live per bucket, never in this one
        released = any(is_released(p) for p in params)
        self.flat = torch.zeros(0 if released else n, dtype=dtype, device=device)
        offset = 0
        for p in params:
            if not released:
                p.main_grad = self.flat[offset : offset + p.numel()].view_as(p)
                p.main_grad_span = (self.flat, offset)
                offset += p.numel()
            p.main_grad_hooks = []  # called when a backward has added into it (the reducer)
            p.register_post_accumulate_grad_hook(_into_main_grad)

    def release(self) -> None:
        """Free the buffer's storage (ZeRO-2 and -3 once the grads are reduce-scattered:
        each rank then holds only its shard); the `main_grad` views stay, storage-less."""
        resize_storage(self.flat, 0)

    def ensure(self) -> None:
        """The buffer allocated again and zeroed, if `release` freed it (before a backward)."""
        if self.flat.untyped_storage().size() == 0:
            resize_storage(self.flat, self.flat.numel() * self.flat.element_size())
            self.flat.zero_()


def _into_main_grad(param: torch.Tensor) -> None:
    """Autograd's bf16 grad added into the float32 main grad, then dropped."""
    if param.grad is None:  # a linear's weight grad, fused into the main grad (counted there)
        return
    param.main_grad.add_(param.grad)
    param.grad = None
    main_grad_arrived(param)


def main_grad_arrived(param: torch.Tensor) -> None:
    """A backward has added into `param`'s main grad: its hooks run (the reducer counts the
    bucket's arrivals: autograd's post-accumulate hook does not fire for a weight grad fused
    into the main grad, which autograd never sees)."""
    for hook in param.main_grad_hooks:
        hook(param)


def weight_grad_landed(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """A weight grad made outside autograd (FP8's W): into the float32 main grad under bf16
    weights (then None), else returned in the weight's dtype for the caller to accumulate."""
    main = getattr(param, "main_grad", None)
    if main is None:
        return grad.to(param.dtype)
    main.add_(grad)
    main_grad_arrived(param)
    return None


def attach_main_grads(module: nn.Module, dtype: torch.dtype = torch.float32) -> MainGrads | None:
    """`module`'s main grads, in `dtype`, when its parameters are low precision (None:
    float32 params)."""
    if all(p.dtype == torch.float32 for p in module.parameters()):
        return None
    main = MainGrads(module, dtype)
    module.main_grads = main
    return main


def zero_main_grads(params: Iterable[torch.Tensor]) -> None:
    """Clear the main grads of `params` (each flat buffer once)."""
    seen = {}
    for p in params:
        span = getattr(p, "main_grad_span", None)
        if span is not None:
            seen[id(span[0])] = span[0]
    for flat in seen.values():
        flat.zero_()


def main_grad_span(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat float32 view covering the main grads of `params` in order, when they lie
    back to back in one buffer (a bucket of one module); else None."""
    spans = [getattr(p, "main_grad_span", None) for p in params]
    if not params or any(s is None for s in spans):
        return None
    flat, start = spans[0]
    offset = start
    for p, (buffer, at) in zip(params, spans):
        if buffer is not flat or at != offset:
            return None
        offset += p.numel()
    return flat[start:offset]


def fused_weight_grad(main: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """main += grad_outᵀ · x with float32 output and accumulation (Megatron's
    gradient-accumulation fusion): no bf16 weight grad is made and rounded. On CUDA torch's
    bf16 matmul with a float32 output; elsewhere the operands are widened (exact products).
    A bf16 main grad (train.main_grads_dtype) takes the bf16 matmul's accumulating product,
    rounded once per microbatch, as Megatron-Core's bf16 grad buffer does."""
    if main.dtype != torch.float32:
        main.addmm_(grad_out.t().to(main.dtype), x.to(main.dtype))
        return
    if grad_out.device.type == "cuda":
        try:  # torch's mm with out_dtype (newer releases); else widened as below
            main.add_(torch.mm(grad_out.t(), x, out_dtype=torch.float32))
            return
        except (TypeError, NotImplementedError):
            pass
    main.addmm_(grad_out.t().float(), x.float())


class _AddBias(torch.autograd.Function):
    """y + b whose bias grad, a sum over every token, is summed in float32 straight into the
    bias's main grad (a bf16 sum rounds the partial sums a split makes: tp's sequence halves
    under SP, dp's rows; near-cancelling sums then differ by far more than float32 round-off)."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.bias = bias
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        bias = ctx.bias
        bias.main_grad.add_(grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32))
        main_grad_arrived(bias)
        return grad, None


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias; a bias with a main grad gets its grad in float32 (_AddBias)."""
    if getattr(bias, "main_grad", None) is None or not torch.is_grad_enabled():
        return y + bias
    return _AddBias.apply(y, bias)


class MainParamOptimizer(WholeState):
    """The optimizer over float32 main params for low-precision weights (zero=0): one float32
    copy of each parameter, whose `.grad` is the parameter's main grad; `step()` steps them and
    writes them back into the weights. `state` is keyed by the model's parameters (checkpoints
    name them)."""

    def __init__(self, groups: list[dict], make) -> None:
        self.main_of: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        main_groups = []
        for g in groups:
            mains = []
            for p in g["params"]:
                m = p.detach().to(torch.float32, copy=True)
                grad = grad_of(p)  # the float32 main grad itself; a bf16 one is widened at step
                m.grad = grad if grad is None or grad.dtype == torch.float32 else None
                self.main_of[id(p)] = (p, m)
                mains.append(m)
            main_groups.append({**g, "params": mains})
        self.inner = make(main_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> _StateByParam:
        return _StateByParam(self)

    @torch.no_grad()
    def step(self) -> None:
        copies = [(p, m) for p, m in self.main_of.values() if m.grad is None]
        for p, m in copies:  # bf16 main grads: float32 copies for the step alone
            m.grad = widened(grad_of(p))
        self.inner.step()
        for _, m in copies:
            m.grad = None
        self.write_back()

    @torch.no_grad()
    def write_back(self) -> None:
        """The main params rounded into the weights."""
        for p, m in self.main_of.values():
            p.data.copy_(m)

    def param_state(self, param: nn.Parameter) -> dict:
        """The inner optimizer's state of `param`'s main param (its own keys: AdamW's moments,
        Muon's momentum buffer: train/muon.py), created if absent so a load has targets."""
        return self.inner.param_state(self.main_of[id(param)][1])

    def main_weights(self) -> dict[int, torch.Tensor]:
        """{id(param): float32 main param}: what a checkpoint writes as the weights."""
        return {id(p): m for p, m in self.main_of.values()}

    load_targets = main_weights  # a checkpoint reads the weights into the main params

    def restore_main(self, _targets: dict) -> None:
        self.write_back()

    def zero_grad(self, set_to_none: bool = True) -> None:
        params = [p for p, _ in self.main_of.values()]
        for p in params:
            p.grad = None
        zero_main_grads(params)


class _StateByParam(dict):
    """AdamW's state of each main param, looked up by its model parameter."""

    def __init__(self, optimizer: MainParamOptimizer) -> None:
        super().__init__()
        self.optimizer = optimizer

    def __getitem__(self, param):
        return self.optimizer.inner.state[self.optimizer.main_of[id(param)][1]]

    def __contains__(self, param) -> bool:
        return id(param) in self.optimizer.main_of

    def values(self):
        return self.optimizer.inner.state.values()

    def items(self):
        inner = self.optimizer.inner.state
        return [(p, inner[m]) for p, m in self.optimizer.main_of.values() if m in inner]
