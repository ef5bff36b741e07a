"""AdamW with weight-decay groups, warmup + cosine LR, and the global gradient-norm clip.

AdamW runs torch's fused kernel (one kernel per step over all tensors: CPU and CUDA in torch
2.13) where every parameter's device has one, else the foreach implementation; both compute
the same update, to float32 round-off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megapipe._torch_compat import foreach_mul_, foreach_norm, fused_adamw_devices
from megapipe.config import TrainConfig
from megapipe.parallel.data.levels import PLAIN, Sharding
from megapipe.parallel.data.optimizer_interface import WholeState
from megapipe.parallel.precision import MainParamOptimizer, grad_of
from megapipe.train.muon import make_muon, muon_groups
from megapipe.train.muon_zero import zero_muon


class AdamW(WholeState, torch.optim.AdamW):
    """torch's AdamW with the optimizer interface that checkpoints use
    (parallel/data/optimizer_interface.py): its state whole per parameter."""


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; biases, norm gains and other vectors do not (GPT-3 / Megatron practice).

    Embedding tables are matrices and decay, as in Megatron-LM. Stacked expert biases
    (models/moe.py: `in_bias`, `out_bias`, one vector per expert) are biases and do not.
    """
    return named_decay_groups(model.named_parameters(), weight_decay)


def named_decay_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list:
    """decay_groups over (name, parameter) pairs."""
    decay, no_decay = [], []
    for name, param in named:
        if param.requires_grad:
            matrix = param.ndim >= 2 and not name.endswith("bias")
            (decay if matrix else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module,
    cfg: TrainConfig,
    reducers=(),
    stage_group=None,
    sharding: Sharding = PLAIN,
) -> torch.optim.Optimizer:
    """AdamW over `model`; under a sharded level (`sharding`, parallel/data/levels.py) over
    this rank's shards of `reducers` (one per chunk), whose checkpoints are written over
    `stage_group` (the mesh's dp × cp × tp group of this pp stage). train.optimizer=muon:
    Muon over the hidden matrices beside that AdamW (train/muon.py; under a sharded level each
    matrix owned whole by one rank, train/muon_zero.py)."""
    groups = decay_groups(model, cfg.weight_decay)
    adamw = partial(make_adamw, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if cfg.optimizer == "muon":
        hidden, rest = muon_groups(model, cfg.weight_decay)
        groups = [hidden, *named_decay_groups(rest, cfg.weight_decay)]
        owned = zero_muon(sharding, list(reducers), groups, adamw, stage_group, cfg)
        if owned is not None:  # zero >= 1 with replicas: each matrix owned whole
            return owned
        adamw = partial(make_muon, cfg=cfg, make_adamw=adamw)
    sharded = sharding.optimizer(list(reducers), groups, adamw, stage_group)
    if sharded is not None:
        return sharded
    if any(p.element_size() < 4 for p in model.parameters()):  # bf16 weights (not float64's)
        return MainParamOptimizer(groups, adamw)  # float32 main params, written back
    return adamw(groups)


def adamw_kind(groups: list[dict]) -> str:
    """The AdamW implementation for `groups`: fused when torch has a fused kernel for the
    device of every floating-point parameter (tensors or shard views), else foreach."""
    params = [p for g in groups for p in g["params"]]
    ok = all(device_adamw_kind(p.device.type) == "fused" and p.is_floating_point() for p in params)
    return "fused" if ok else "foreach"


def device_adamw_kind(device_type: str) -> str:
    """The AdamW implementation for float32 parameters on `device_type` ("cuda", "cpu"): the
    choice adamw_kind makes, which the performance model prices (perf/software.py)."""
    return "fused" if device_type in fused_adamw_devices() else "foreach"


def make_adamw(groups: list[dict], **hyper) -> AdamW:
    """torch's AdamW over `groups`, fused where the devices allow (adamw_kind), else foreach.
    The distributed optimizer builds its inner optimizer over shard views with this too."""
    kind = adamw_kind(groups)
    optimizer = AdamW(groups, **hyper, **{kind: True})
    if kind == "fused":
        optimizer.register_step_pre_hook(_steps_on_param_device)
    return optimizer


def _steps_on_param_device(optimizer: torch.optim.Optimizer, *_) -> None:
    """The fused kernel reads each step count on its parameter's device (torch creates it
    there), but a checkpoint load creates the counts on the CPU: move any that are not."""
    for param, state in optimizer.state.items():
        step = state.get("step")
        if step is not None and step.device != param.device:
            state["step"] = step.to(param.device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_lr` at `steps`.

    `step` counts optimizer steps already taken (0 for the first update).
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    decay_steps = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ over the tensors of their squared L2 norms, in float32, as a 0-d tensor. One foreach
    norm per tensor, never a squared copy: `g.pow(2)` of GPT-2's tied 50k × 768 table is a
    fresh 154 MB buffer per step (its page faults alone cost more than the norm)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    wide = torch.float64 if grads[0].dtype == torch.float64 else torch.float32  # tests' float64
    norms = foreach_norm([g.detach() for g in grads], wide)
    return torch.stack(norms).square().sum()


def global_grad_norm(
    local_params: Iterable[nn.Parameter | torch.Tensor],
    group=None,
) -> torch.Tensor:
    """L2 norm of all gradients of the model.

    `local_params` (parameters, or gradient tensors / slices of them) must hold each logical
    gradient element exactly once across the ranks of `group`: tp-replicated parameters on tp
    rank 0 only, replicated kv-head copies once (tensor_parallel.grad_sync.grads_counted_once);
    dp replicas are not in `group` at all (the mesh's norm group spans pp × tp). The squared
    sums are all-reduced over `group`, so the norm is that of the one-process model.
    """
    items = [grad_of(p) if isinstance(p, nn.Parameter) else p for p in local_params]
    total = sum_of_squares([g for g in items if g is not None])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_gradients(params: list, norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients by max_norm / norm when the norm exceeds max_norm (Pascanu et al. 2013).
    `params`: parameters (their .grad), or grad tensors (zero >= 2's shards)."""
    if max_norm <= 0:
        return
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [grad_of(p) if isinstance(p, nn.Parameter) else p for p in params]
    grads = [g for g in grads if g is not None]
    if grads:
        foreach_mul_(grads, scale)
