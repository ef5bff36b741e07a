"""The one training step core, for the plain, pipelined and PipeDream paths (design:
docs/architecture.md, "One training step").

Loss is the mean over every target token of the global batch: each microbatch's summed cross
entropy is divided by the global token count before backward, so gradient accumulation over
microbatches (GPipe §2.2) and the dp × cp sum of gradients both equal one large batch. An
`Engine` (pipeline/protocol.py: train/replica.Replica, pipeline/engine.Pipeline,
pipeline/pipedream.PipeDreamPipeline, train/post_validation.PostValidatedEngine) runs the
forwards and backwards of this rank's microbatches and owns its step variant (`run_step`,
given this step's `StepCore`): `update` then finishes the gradients (dp × cp sum, tp partial
sums, shared tied copies), takes the global norm, clips and steps AdamW; `TrainHooks`
(train/hooks.py) observe both. PipeDream's step calls the same `update` once per microbatch
from inside its run; post-validation's runs the same first half (`finish_grads`) and end
(`clip_and_step`) around its chained norm.

Non-finite steps (Megatron checks loss and grads every step; Zero Bubble §4 skips such a step):
the loss and the global grad norm are reduced over the whole mesh before the optimizer runs, so
every rank sees the same two numbers and takes the same decision without another collective.
A step with either inf or NaN is skipped: its grads are dropped, weights, AdamW moments and the
step count stay as they were, and the result says `skipped`. So is a step whose agreed loss
exceeds `loss_limit`, the loop's loss-spike threshold (train/spikes.py; PaLM §5.1).

Under `parallel.post_validation` (pp > 1; Zero Bubble §4, train/post_validation.py: a
`PostValidatedEngine` wrapping the pipeline) there is no such global reduction: each stage
steps optimistically with the state chained to it, and step s's loss, norm and skip are known
only once the global state is back, while step s + 1 runs. The result of step s is then not
`final`; step s + 1's carries it as `previous`, and the engine's `settle` validates a pending
step at once (before evaluation, checkpoints, the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megapipe.config import Config
from megapipe.distributed.progress import NO_PROGRESS, Progress
from megapipe.parallel.tensor.grad_sync import sync_tp_partial_grads
from megapipe.pipeline.protocol import Engine, Grads, StepResult
from megapipe.train.batches import BatchSlice
from megapipe.train.hooks import NO_HOOKS, TrainHooks, optimizer_step
from megapipe.train.optim import clip_gradients, global_grad_norm, lr_at, set_lr
from megapipe.train.zero_grads import finish_grad_shards

__all__ = ["StepCore", "StepResult", "train_step", "update"]


def train_step(
    engine: Engine,
    slice_: BatchSlice,
    optimizer,
    batch: torch.Tensor,
    step: int,
    cfg: Config,
    hooks: TrainHooks = NO_HOOKS,
    loss_limit: float = math.inf,
    progress: Progress = NO_PROGRESS,
) -> StepResult:
    """Forward/backward every microbatch of this rank's slice of the global `batch`, reduce
    gradients over the mesh, clip, and take one AdamW step (PipeDream: one per microbatch;
    post-validation: an optimistic one), as the engine's `run_step` does it.

    `step` is the number of optimizer steps already taken (it picks the learning rate);
    `hooks` observe the forward-backward and every optimizer step (train/hooks.py); a loss
    above `loss_limit` (a spike: train/spikes.py) skips the step as a non-finite one does;
    `progress` records the step's waits on the other ranks (distributed/progress.py).
    """
    micro = slice_.microbatches(batch.to(engine.device), cfg.parallel.microbatches)
    core = StepCore(slice_, optimizer, step, cfg, hooks, loss_limit, progress)
    return engine.run_step(micro, core)


@dataclass
class StepCore:
    """What an engine's step runs with (pipeline/protocol.StepCore): this step's optimizer,
    index, config, hooks, loss limit and progress record, and the update half over them."""

    slice: BatchSlice
    optimizer: object
    step: int
    cfg: Config
    hooks: TrainHooks = NO_HOOKS
    loss_limit: float = math.inf
    progress: Progress = NO_PROGRESS

    @property
    def tokens(self) -> int:
        return self.cfg.derived.tokens_per_step

    @property
    def lr(self) -> float:
        return lr_at(self.step, self.cfg.train)

    def forward_backward(self, engine: Engine, micro: list, update=None) -> torch.Tensor:
        """The engine's forwards and backwards, observed by the hooks; the summed loss."""
        self.hooks.forward_backward_begin(self.step)
        loss_sum = engine.forward_backward(micro, self.tokens, update)
        self.hooks.forward_backward_end(self.step, engine.events)
        return loss_sum

    def global_loss(self, loss_sum: torch.Tensor, stages: Engine | None = None) -> torch.Tensor:
        """`loss_sum` over the dp × cp replicas (and the pipeline's stages by
        `stages.stage_loss`), divided by the global batch's tokens."""
        self.progress.wait("all_reduce loss")
        if stages is not None:
            loss_sum = stages.stage_loss(loss_sum)
        loss = self.slice.sum(loss_sum) / self.tokens
        self.progress.waited()
        return loss

    def update(self, grads: Grads, loss: torch.Tensor | None = None):
        """`update` on `grads` with this step's pieces: (norm, lr, skipped)."""
        return update(
            grads,
            self.optimizer,
            self.step,
            self.cfg,
            loss=loss,
            hooks=self.hooks,
            loss_limit=self.loss_limit,
            progress=self.progress,
        )


def update(
    grads: Grads,
    optimizer,
    step: int,
    cfg: Config,
    loss: torch.Tensor | None = None,
    hooks: TrainHooks = NO_HOOKS,
    loss_limit: float = math.inf,
    progress: Progress = NO_PROGRESS,
) -> tuple[torch.Tensor, float, bool]:
    """Step 3 of one training step on `grads` (an engine, or one PipeDream stage), in order:
    (1) the dp × cp sum of each chunk's buckets finished, (2) tp partial sums, (3) shared
    copies (the tied embedding), (4) the global norm over `grads.norm_group`, (5) clip,
    (6) AdamW. Returns (norm, lr, skipped): with a
    non-finite norm or `loss` (both agreed over the mesh), or a `loss` above `loss_limit`, the
    optimizer does not step. `progress` records the two waits on other ranks
    (distributed/progress.py)."""
    progress.wait("all_reduce grads")
    counted, to_clip = finish_grads(grads)  # 1-3: dp × cp sums, tp partial sums, shared copies
    progress.wait("all_reduce grad norm")
    norm = global_grad_norm(counted, grads.norm_group)
    progress.doing("optimizer")
    if not finite(norm, loss) or spiked(loss, loss_limit):
        optimizer.zero_grad(set_to_none=True)  # weights, moments and AdamW's step untouched
        return norm, lr_at(step, cfg.train), True
    lr = lr_at(step, cfg.train)
    clip_and_step(optimizer, to_clip, norm, cfg.train.grad_clip, lr, hooks)  # 5-6
    return norm, lr, False


def finish_grads(grads: Grads) -> tuple[list[torch.Tensor], list]:
    """The first half of the update: each chunk's dp × cp reduction finished, then its tp
    partial sums, then the shared copies (the tied embedding) summed; on grad shards where the
    sharding keeps them so (zero >= 2, train/zero_grads.py). Returns (each logical grad once,
    for the norm; what the clip scales)."""
    if grads.sharding.grads_as_shards:
        return finish_grad_shards(grads)
    for chunk, reducer in zip(grads.chunks, grads.reducers):
        if reducer is not None:
            reducer.finish()
        sync_tp_partial_grads(chunk)
    grads.sync_shared_grads()
    return grads.grads_counted_once(), grads.params()


def finite(*values: torch.Tensor | None) -> bool:
    """Every given scalar is finite (no inf, no NaN)."""
    return all(v is None or bool(torch.isfinite(v).all()) for v in values)


def spiked(loss: torch.Tensor | None, limit: float) -> bool:
    """The agreed `loss` exceeds `limit`, compared in float64 as the loop compares the value it
    records (train/spikes.py), so both see the same decision."""
    return loss is not None and limit < math.inf and loss.item() > limit


def clip_and_step(
    optimizer, params: list, norm: torch.Tensor, clip: float, lr: float, hooks: TrainHooks
) -> None:
    """The end of the update: clip to `clip` (train.grad_clip) by the global `norm`, set the
    LR, take the AdamW step and clear the grads."""
    clip_gradients(params, norm, clip)
    set_lr(optimizer, lr)
    optimizer_step(optimizer, hooks)
    optimizer.zero_grad(set_to_none=True)
