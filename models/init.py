"""Initialisation of every parameter from (seed, logical name), then sharded.

Drawing each logical tensor from its own generator keyed by its name makes the weights
independent of which blocks a stage builds and of the tensor-parallel split.
Scheme: GPT-2 (Radford et al. 2019, §2.3): N(0, 0.02), residual output projections scaled by
1/sqrt(2·n_layers); norms start at 1, biases at 0.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

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


def logical_init(seed: int, name: str, shape: tuple[int, ...], n_layers: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`."""
    leaf = name.rsplit(".", 2)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in leaf[-2]:
        return torch.ones(shape)
    std = STD / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_PROJECTIONS) else STD
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, n_layers: int) -> None:
    for name, param, shape, spec, tp in sharded_params(model):
        value = spec.shard(logical_init(seed, name, shape, n_layers), tp)
        param.copy_(expert_slice(value, param))  # ep: this rank's experts
