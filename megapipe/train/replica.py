"""The whole (tp-sharded, cp-sliced) model on this rank, as the step core drives it: the
no-pipeline `Engine` (pipeline/protocol.py), the case of pipeline/engine.Pipeline with one chunk
and microbatches one after another."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from megapipe.config import Config
from megapipe.distributed.progress import NO_PROGRESS, Progress
from megapipe.parallel.data.reducer import GradReducer
from megapipe.parallel.expert.sharding import NO_EP, EPInfo
from megapipe.parallel.precision import FLOAT32, Precision
from megapipe.parallel.tensor.grad_sync import grads_counted_once
from megapipe.pipeline.runtime import Event, MicroBatch


@dataclass
class Replica:
    cfg: Config
    model: nn.Module
    reducer: GradReducer | None = None  # dp × cp gradient buckets
    norm_group: object = None  # tp: one copy of every parameter over it
    progress: Progress = NO_PROGRESS  # this rank's record (distributed/progress.py)
    precision: Precision = FLOAT32  # the policy the model was built with (autocast)
    ep: EPInfo = NO_EP  # the expert-parallel axis the model was built on

    @property
    def chunks(self) -> list[nn.Module]:
        return [self.model]

    @property
    def reducers(self) -> list:
        return [self.reducer]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def events(self) -> list[Event]:
        return []  # no pipeline actions

    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def forward_backward(
        self, micro: list[MicroBatch], loss_scale: float, update=None
    ) -> torch.Tensor:
        """Forward and backward of each microbatch; the dp buckets sync during the last
        backward only (gradient accumulation, GPipe §2.2). Returns the summed loss."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, m in enumerate(micro):
            self.progress.doing("F+B", i)
            last = i == len(micro) - 1
            sync = self.reducer.no_sync() if self.reducer and not last else contextlib.nullcontext()
            with sync:
                with self.precision.autocast(self.device):
                    loss = self.model(m.inputs, m.targets, m.positions, documents=m.documents)
                (loss / loss_scale).backward()
            loss_sum += loss.detach()
        return loss_sum

    def sync_shared_grads(self) -> None:
        return None  # the tied table is one parameter here

    def grads_counted_once(self) -> list[torch.Tensor]:
        """Each logical grad once over `norm_group`: over every rank (zero=1, or ep > 1), the
        replicas the reducer names (GradReducer.counts)."""
        spread = self.cfg.parallel.zero or self.ep.size > 1
        keep = self.reducer.counts if self.reducer and spread else None
        return grads_counted_once(self.model, keep=keep)

    def stage_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def forward_only(self, micro: list[MicroBatch]) -> list[float]:
        """Each microbatch's summed cross entropy, forward only."""
        out = []
        for m in micro:
            with self.precision.autocast(self.device):
                out.append(
                    self.model(m.inputs, m.targets, m.positions, documents=m.documents).item()
                )
        return out
