"""Aux-loss-free balancing (DeepSeek-V3 §2.1.2), model.moe_bias_update_rate: after each optimizer
step every deepseek_v3 MoE layer's selection bias moves by rate · sign(mean load − load)
(models/routing.SigmoidGroupTopK.update_bias).

The load is the rows routed to each expert over the whole global batch: this rank's
microbatches' counts (summed in backward, once per microbatch, models/moe.py), all-reduced over
the replica group (dp × cp: other sequences, and other parts of them; ep ranks are dp ranks)
and over tp under sequence parallelism (other chunks of the same tokens; without it the tp
ranks route the same tokens). pp ranks hold other layers. So every rank of every mesh, and one
process, takes the same step. A skipped step (non-finite, a spike) leaves the bias.

The bias moves between steps, never within one (DeepSeek-V3 §2.1.2: "at the end of each
step"): every microbatch of a step routes with the same bias, and the step's load is counted
over all of them. The step's fate decides it:
- a flushed step (train/parallelize.Job.train_step): `after_step` with the agreed skip;
- post-validation (Zero Bubble §4, train/post_validation.py): the bias follows the optimistic
  step (moved iff the stage's chained state is finite) and is rolled back and moved again with
  the weights when the global state says the stage stepped wrong; a redone forward/backward
  counts its load afresh (`discard`);
- PipeDream (pipeline/pipedream.py): a stage updates its weights after every microbatch, at
  other times than the other stages, but the bias has no versions: it stays fixed through the
  step's microbatches (whatever weight version each ran with) and moves once after the step's
  cool-down, when the pipeline has drained, from the load of all of them; skipped when any
  stage skipped an update of the step (the result's skip, agreed over pp). A per-update bias
  would depend on when each stage's updates land, which no one-process run reproduces.
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
        table = self.load()
        if not skipped:
            self.apply(table)

    def load(self) -> torch.Tensor | None:
        """The step's rows per expert over the whole batch (layers, E) float64, the same on
        every rank of the stage (a collective under a mesh); starts the next step's count."""
        if not self.routings:
            return None
        table = torch.stack([r.take_load() for r in self.routings])  # (layers, E) float64
        for group in self.groups:
            table = C.all_reduce(table, group)
        return table

    def apply(self, table: torch.Tensor | None) -> None:
        """Move every bias by the step's `table` (from `load`)."""
        if table is None:
            return
        for routing, load in zip(self.routings, table, strict=True):
            routing.update_bias(load)

    def discard(self) -> None:
        """Forget the load counted since the last `load` (a forward/backward run again)."""
        for routing in self.routings:
            routing.take_load()

    def biases(self) -> list[torch.Tensor]:
        """Copies of the biases, for `restore`."""
        return [r.bias.clone() for r in self.routings]

    @torch.no_grad()
    def restore(self, saved: list[torch.Tensor]) -> None:
        for routing, bias in zip(self.routings, saved, strict=True):
            routing.bias.copy_(bias)


NO_BALANCE = BiasBalancing([], [])  # no routing biases: every method does nothing
