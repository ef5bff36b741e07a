"""The `Engine` protocol: what the training layer (train/step.py, train/evaluate.py,
train/parallelize.py, checkpoints) calls on whatever runs this rank's microbatches.

Three engines implement it: train/replica.Replica (no pipeline), pipeline/engine.Pipeline and
pipeline/pipedream.PipeDreamPipeline; train/post_validation.PostValidatedEngine wraps a Pipeline
(Zero Bubble §4) and implements it too. Each engine owns its step variant (`run_step`), given
the step core's pieces (`StepCore`, train/step.py), so the step core never asks which engine it
holds. `Grads` is the part the step core's `update` finishes and steps (an engine, or one
PipeDream stage). See docs/architecture.md, "One training step".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from megapipe.pipeline.runtime import Event, MicroBatch


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: bool = False  # non-finite loss or grad norm, or a spike: the optimizer did not step
    # post-validation: this step's figures are not known yet (loss and norm NaN) ...
    final: bool = True
    previous: StepResult | None = None  # ... and the step before, validated now, if pending


class StepCore(Protocol):
    """The step core's pieces an engine's step runs with (train/step.StepCore)."""

    optimizer: object
    step: int  # optimizer steps already taken
    cfg: object
    hooks: object  # train/hooks.TrainHooks

    @property
    def tokens(self) -> int: ...  # target tokens of the global batch (the loss's divisor)

    @property
    def lr(self) -> float: ...  # this step's learning rate

    def forward_backward(self, engine: Engine, micro: list[MicroBatch], update=None):
        """`engine.forward_backward` between the hooks' begin and end; the summed loss."""
        ...

    def global_loss(self, loss_sum: torch.Tensor, stages: Engine | None = None) -> torch.Tensor:
        """`loss_sum` summed over the dp × cp replicas (and over the pipeline's stages by
        `stages.stage_loss`; None: this stage's), divided by the global batch's tokens."""
        ...

    def update(self, grads: Grads, loss: torch.Tensor | None = None):
        """The update half on `grads`: (norm, lr, skipped) (train/step.update)."""
        ...


class Grads(Protocol):
    """Gradients to finish and step: dp × cp buckets per chunk, shared copies, the norm's group."""

    @property
    def chunks(self) -> list[nn.Module]: ...

    @property
    def reducers(self) -> list: ...  # one dp × cp GradReducer per chunk (None: no replicas)

    @property
    def sharding(self): ...  # the ZeRO strategy (parallel/data/levels.Sharding)

    @property
    def norm_group(self): ...  # the group the global grad norm is summed over

    def params(self) -> list[nn.Parameter]: ...

    def sync_shared_grads(self) -> None: ...  # the tied embedding's two copies summed

    def grads_counted_once(self) -> list[torch.Tensor]: ...  # each logical grad once


class Engine(Grads, Protocol):
    """This rank's model as the step core drives it."""

    @property
    def device(self) -> torch.device: ...

    @property
    def events(self) -> list[Event]: ...  # the last forward_backward's action spans ([]: none)

    @property
    def post_validated(self) -> bool: ...  # Zero Bubble §4: no collective between steps

    def forward_backward(
        self, micro: list[MicroBatch], loss_scale: float, update=None
    ) -> torch.Tensor:
        """Forwards and backwards of `micro` (grads accumulated); this rank's summed loss.
        `update(grads)`: the step core's optimizer step, for an engine that steps inside
        (pipeline/pipedream.PipeDreamPipeline, once per microbatch)."""
        ...

    def run_step(self, micro: list[MicroBatch], core: StepCore) -> StepResult:
        """One training step of `micro`: forwards, backwards and this engine's update."""
        ...

    def settle(self, optimizer, cfg, hooks) -> StepResult | None:
        """A step left pending (post-validation) validated now; None when none is."""
        ...

    def forward_only(self, micro: list[MicroBatch]) -> list[float]:
        """Each microbatch's summed cross entropy (0 off the last stage)."""
        ...

    def stage_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss summed over the pipeline's stages (on every pp rank)."""
        ...

    def token_logprobs(self, micro: list[MicroBatch]) -> list[torch.Tensor]:
        """Each microbatch's log-prob of every target token, (b, T/cp) float64 (this cp rank's
        slice; train/batches.BatchSlice.whole joins them), forward only: computed where the
        head is (the last stage) from its logits gathered over tp, and held on every pp rank."""
        ...


class SynchronousStep:
    """The step of an engine whose update follows its forwards and backwards, every rank
    agreeing on the loss and the norm before the optimizer (Replica, Pipeline)."""

    post_validated = False

    def run_step(self, micro: list[MicroBatch], core: StepCore) -> StepResult:
        loss_sum = core.forward_backward(self, micro)
        loss = core.global_loss(loss_sum, stages=self)  # the same on every rank
        norm, lr, skipped = core.update(self, loss)
        return StepResult(loss=loss.item(), grad_norm=norm.item(), lr=lr, skipped=skipped)

    def settle(self, optimizer, cfg, hooks) -> StepResult | None:
        return None  # nothing is left pending
