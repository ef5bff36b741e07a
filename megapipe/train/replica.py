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
from megapipe.parallel.data.levels import PLAIN, Sharding
from megapipe.parallel.data.reducer import GradReducer
from megapipe.parallel.fp8 import NO_FP8, Fp8
from megapipe.parallel.precision import FLOAT32, Precision
from megapipe.parallel.tensor.grad_sync import grads_counted_once
from megapipe.pipeline.protocol import SynchronousStep
from megapipe.pipeline.runtime import Event, MicroBatch


@dataclass
class Replica(SynchronousStep):
    cfg: Config
    model: nn.Module
    reducer: GradReducer | None = None  # dp × cp gradient buckets
    mesh: object = None  # None: one process
    sharding: Sharding = PLAIN  # the ZeRO level (parallel/data/levels.py)
    progress: Progress = NO_PROGRESS  # this rank's record (distributed/progress.py)
    precision: Precision = FLOAT32  # the policy the model was built with (autocast)
    fp8: Fp8 = NO_FP8  # and its FP8 policy: the weight casts kept over a step

    @property
    def chunks(self) -> list[nn.Module]:
        return [self.model]

    @property
    def reducers(self) -> list:
        return [self.reducer]

    @property
    def norm_group(self):
        """The group the grad norm is summed over (the sharding's norm rule)."""
        return self.sharding.norm_group(self.mesh)

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
        with self.fp8.step():  # no weight changes until the last backward is done
            return self._microbatches(micro, loss_scale)

    def _microbatches(self, micro: list[MicroBatch], loss_scale: float) -> torch.Tensor:
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, m in enumerate(micro):
            self.progress.doing("F+B", i)
            last = i == len(micro) - 1
            sync = self.reducer.backward_of(last) if self.reducer else contextlib.nullcontext()
            with sync:
                with self.precision.autocast(self.device):
                    loss = self.model(m.inputs, m.targets, m.positions, documents=m.documents)
                (loss / loss_scale).backward()
            loss_sum += loss.detach()
        return loss_sum

    def sync_shared_grads(self) -> None:
        return None  # the tied table is one parameter here

    def grads_counted_once(self) -> list[torch.Tensor]:
        """Each logical grad once over `norm_group`: where it spans every rank, on the replica
        the reducer names (the sharding's norm rule, parallel/data/levels.py)."""
        keep = self.sharding.counted(self.mesh, self.reducer)
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

    def token_logprobs(self, micro: list[MicroBatch]) -> list[torch.Tensor]:
        """Each microbatch's per-token target log-prob (b, T/cp), forward only: the model's
        logits (gathered over tp by its head) read at the targets."""
        out = []
        for m in micro:
            with self.precision.autocast(self.device):
                logits = self.model(m.inputs, None, m.positions, documents=m.documents)
            out.append(m.target_logprobs(logits))
        return out
