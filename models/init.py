"""Initialisation of every parameter from (seed, logical name), then sharded.

Drawing each logical tensor from its own generator keyed by its name makes the weights
independent of which blocks a stage builds and of the tensor-parallel split.
Scheme: GPT-2 (Radford et al. 2019, §2.3): N(0, 0.02), residual output projections scaled by
1/sqrt(2·n_layers); norms start at 1, biases at 0, and a zero-centred gain (LayerNorm1P's,
which scales by 1 + weight) at 0.

Deferred initialisation (`DeferredInit`, ZeRO-3): a model built on the meta device gets
parameters of its real shapes, dtypes and device but no storage, and each one's initial value
is made only when asked, so ZeRO-3 fills one bucket at a time and keeps its shard: no rank ever
holds the whole model (FSDP2's meta-device initialisation, Zhao et al. 2023 §3.1). Because a
value depends on (seed, name) alone, the deferred weights are the ones `init_parameters` writes.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from megapipe._torch_compat import copy_tensor_hooks, resize_storage
from megapipe.parallel.expert.sharding import expert_slice
from megapipe.parallel.tensor.layers import sharded_params

RESIDUAL_PROJECTIONS = (
    "attn.proj.weight",
    "mlp.fc2.weight",
    "mlp.experts.w_out",
    "shared.fc2.weight",
)
STD = 0.02


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, logical name), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def logical_init(
    seed: int, name: str, shape: tuple[int, ...], n_layers: int, zero_centred: bool = False
) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`; `zero_centred`: a gain held as
    its offset from 1 (parallel/tensor/layers.LayerNorm1P)."""
    leaf = name.rsplit(".", 2)
    if name.endswith("bias") or zero_centred:
        return torch.zeros(shape)
    if "norm" in leaf[-2]:
        return torch.ones(shape)
    std = STD / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_PROJECTIONS) else STD
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def _initial(seed: int, name: str, shape, n_layers: int, param) -> torch.Tensor:
    """logical_init of `param`, zero-centred where its module marked it so."""
    return logical_init(seed, name, shape, n_layers, getattr(param, "zero_centred", False))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, n_layers: int) -> None:
    for name, param, shape, spec, tp in sharded_params(model):
        value = spec.shard(_initial(seed, name, shape, n_layers, param), tp)
        param.copy_(expert_slice(value, param))  # ep: this rank's experts


def materialize_released(model: nn.Module, device) -> None:
    """A meta-built `model`'s parameters made anew on `device` without storage (each one's
    attributes kept, a tied parameter still one object), and its buffers at zero (the routing
    bias, models/routing.py: the only one). DeferredInit then makes their values."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in made:
                q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))
                q.requires_grad_(p.requires_grad)
                resize_storage(q, 0)  # the parameter's own (a fake tensor's alias would not tell)
                # the model's own attributes (not a fake tensor's device and mode, train/fake_ranks)
                q.__dict__.update({k: v for k, v in p.__dict__.items() if k not in q.__dict__})
                copy_tensor_hooks(p, q)  # e.g. attention's zeroed key-bias grad
                made[id(p)] = q
            setattr(module, name, made[id(p)])
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))


class DeferredInit:
    """The initial values of a model's storage-less parameters (`materialize_released`), made
    one at a time on demand (module docstring); the frozen ones are filled at once."""

    def __init__(self, model: nn.Module, seed: int, n_layers: int) -> None:
        self.seed, self.n_layers = seed, n_layers
        self.specs = {id(p): (name, shape, spec, tp) for name, p, shape, spec, tp in
                      sharded_params(model)}  # fmt: skip
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:  # no ZeRO bucket will fill it
                    resize_storage(p, p.numel() * p.element_size())
                    p.copy_(self.value(p))

    @torch.no_grad()
    def value(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s initial value on this rank (its tp shard and experts), in its dtype."""
        name, shape, spec, tp = self.specs[id(param)]
        value = spec.shard(_initial(self.seed, name, shape, self.n_layers, param), tp)
        return expert_slice(value, param).to(param.dtype)
