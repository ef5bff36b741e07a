"""Aux-loss-free balancing (DeepSeek-V3 §2.1.2), model.moe_bias_update_rate: after each optimizer
step every deepseek_v3 MoE layer's selection bias moves by rate · sign(mean load − load)
(models/routing.SigmoidGroupTopK.update_bias).

The load is the rows routed to each expert over the whole global batch: this rank's
microbatches' counts (summed in backward, once per microbatch, models/moe.py), all-reduced over
the replica group (dp × cp: other sequences, and other parts of them; ep ranks are dp ranks)
and over tp under sequence parallelism (other chunks of the same tokens; without it the tp
ranks route the same tokens). pp ranks hold other layers. So every rank of every mesh, and one
process, takes the same step. A skipped step (non-finite, a spike) leaves the bias.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.config import Config
from megapipe.distributed import collectives as C
from megapipe.models.routing import SigmoidGroupTopK


class BiasBalancing:
    def __init__(self, routings: list[SigmoidGroupTopK], groups: list) -> None:
        self.routings, self.groups = routings, groups

    @classmethod
    def of(cls, cfg: Config, model: nn.Module, mesh) -> BiasBalancing | None:
        """The component for this rank's layers, or None when the rate is 0."""
        if cfg.model.moe_bias_update_rate == 0:
            return None
        routings = [m for m in model.modules() if isinstance(m, SigmoidGroupTopK)]
        groups = []
        if mesh is not None:
            groups.append(mesh.replica_group)
            if cfg.parallel.sequence_parallel:
                groups.append(mesh.group("tp"))
        return cls(routings, groups)

    def after_step(self, skipped: bool) -> None:
        """Every rank calls it after its step (a collective under a mesh)."""
        if not self.routings:
            return
        table = torch.stack([r.take_load() for r in self.routings])  # (layers, E) float64
        for group in self.groups:
            table = C.all_reduce(table, group)
        if skipped:
            return
        for routing, load in zip(self.routings, table, strict=True):
            routing.update_bias(load)
