"""The `Engine` protocol: what the training layer (train/step.py, train/evaluate.py,
train/build.py, checkpoints) calls on whatever runs this rank's microbatches.

Three engines implement it: train/replica.Replica (no pipeline), pipeline/engine.Pipeline and
pipeline/pipedream.PipeDreamPipeline; train/post_validation.PostValidatedEngine wraps a Pipeline
(Zero Bubble §4) and implements it too. `Grads` is the part the step core's `update` finishes
and steps (an engine, or one PipeDream stage). See docs/architecture.md, "One training step".
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from megapipe.pipeline.runtime import Event, MicroBatch


class Grads(Protocol):
    """Gradients to finish and step: dp × cp buckets per chunk, shared copies, the norm's group."""

    @property
    def chunks(self) -> list[nn.Module]: ...

    @property
    def reducers(self) -> list: ...  # one dp × cp GradReducer per chunk (None: no replicas)

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

    def forward_backward(
        self, micro: list[MicroBatch], loss_scale: float, update=None
    ) -> torch.Tensor:
        """Forwards and backwards of `micro` (grads accumulated); this rank's summed loss.
        `update(grads)`: the step core's optimizer step, for an engine that steps inside
        (pipeline/pipedream.PipeDreamPipeline, once per microbatch)."""
        ...

    def forward_only(self, micro: list[MicroBatch]) -> list[float]:
        """Each microbatch's summed cross entropy (0 off the last stage)."""
        ...

    def stage_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss summed over the pipeline's stages (on every pp rank)."""
        ...
