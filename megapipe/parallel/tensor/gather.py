"""Logical (unsharded) tensors from tp shards: for parity tests, export and inspection."""

from __future__ import annotations

import torch
from torch import nn

from megapipe.distributed import collectives as C
from megapipe.parallel.expert.sharding import expert_ep
from megapipe.parallel.precision import grad_of
from megapipe.parallel.tensor.layers import sharded_params
from megapipe.parallel.tensor.sharding import unshard


@torch.no_grad()
def gather_logical(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """{logical name: full tensor} of the parameters (or their grads) on every tp rank.

    A collective over each module's tp group: every tp rank must call it; and over the ep
    group for expert weights sharded by parallel.ep (their experts stacked on dim 0).
    """
    out = {}
    for name, param, shape, spec, tp in sharded_params(model):
        local = grad_of(param) if grads else param.data
        if local is None:
            continue
        ep = expert_ep(param)
        if ep.size > 1:  # experts whole on every tp rank: the ep ranks' slices in order
            out[name] = C.all_gather(local.detach(), 0, ep.group)
            continue
        if tp.size == 1 or spec.dim is None:
            out[name] = local.detach().clone()
            continue
        shards = C.all_gather(local.detach().unsqueeze(0), 0, tp.group)
        out[name] = unshard(spec, list(shards.unbind(0)), shape)
    return out
