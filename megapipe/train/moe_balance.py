"""Aux-loss-free balancing (DeepSeek-V3 §2.1.2), model.moe_bias_update_rate: after each optimizer
step every deepseek_v3 MoE layer's selection bias moves by rate · sign(mean load − load)
(models/routing.SigmoidGroupTopK.update_bias).

The load is the rows routed to each expert over the whole global batch: this rank's
microbatches' counts (summed in backward, once per microbatch, models/moe.py), all-reduced over
the replica group (dp × cp: other sequences, and other parts of them; ep ranks are dp ranks)
and over tp under sequence parallelism (other chunks of the same tokens; without it the tp
ranks route the same tokens). pp ranks hold other layers, but under DualPipe's two copies of
each stage, each copy routing half the microbatches: their loads are summed (pipeline/dual.py
twin_sums). So every rank of every mesh, and one process, takes the same step. A skipped step
(non-finite, a spike) leaves the bias.

Under parallel.post_validation (Zero Bubble §4, train/post_validation.py) the step is the
stage's optimistic one; when the global check rolls the weights back, `roll_back` takes the
bias back too and steps it by the global decision, so it matches one process exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.config import Config
from megapipe.distributed import collectives as C
from megapipe.models.routing import SigmoidGroupTopK
from megapipe.pipeline.dual import twin_sums
from megapipe.plan.actions import Placement


class BiasBalancing:
    def __init__(self, routings: list[SigmoidGroupTopK], groups: list, twins=None) -> None:
        self.routings, self.groups = routings, groups
        self.twins = twins  # DualPipe: the table with each stage's twin copy's loads added
        self.last: tuple | None = None  # the last step's (load table, biases before it)

    @classmethod
    def of(
        cls, cfg: Config, model: nn.Module, mesh, place: Placement | None = None
    ) -> BiasBalancing | None:
        """The component for this rank's layers (`model`: its chunks, placed by `place`), or
        None when the rate is 0."""
        if cfg.model.moe_bias_update_rate == 0:
            return None
        routings = [m for m in model.modules() if isinstance(m, SigmoidGroupTopK)]
        groups = []
        if mesh is not None:
            groups.append(mesh.replica_group)
            if cfg.parallel.sequence_parallel:
                groups.append(mesh.group("tp"))
        twins = None
        if place is not None and place.style == "dual":  # each chunk sees half the batch
            per_chunk = [sum(isinstance(m, SigmoidGroupTopK) for m in c.modules()) for c in model]

            def twins(table: torch.Tensor) -> torch.Tensor:
                return torch.cat(twin_sums(list(table.split(per_chunk)), place, mesh))

        return cls(routings, groups, twins)

    def after_step(self, skipped: bool) -> None:
        """Every rank calls it after its step (a collective under a mesh)."""
        if not self.routings:
            return
        table = torch.stack([r.take_load() for r in self.routings])  # (layers, E) float64
        for group in self.groups:
            table = C.all_reduce(table, group)
        if self.twins is not None:
            table = self.twins(table)
        self.last = (table, [r.bias.clone() for r in self.routings])
        if not skipped:
            self._update(table)

    @torch.no_grad()
    def roll_back(self, skipped: bool) -> None:
        """Post-validation's redo of the last step: the bias back to before it and stepped by
        the global decision `skipped` (the loads counted since go with the redo,
        PostValidatedEngine.redo)."""
        if self.last is None:
            return
        table, before = self.last
        for routing, bias in zip(self.routings, before, strict=True):
            routing.bias.copy_(bias)
        if not skipped:
            self._update(table)

    def _update(self, table: torch.Tensor) -> None:
        for routing, load in zip(self.routings, table, strict=True):
            routing.update_bias(load)
