"""The one training step core, for the plain, pipelined and PipeDream paths (design:
docs/architecture.md, "One training step").

Loss is the mean over every target token of the global batch: each microbatch's summed cross
entropy is divided by the global token count before backward, so gradient accumulation over
microbatches (GPipe §2.2) and the dp × cp sum of gradients both equal one large batch. An
`Engine` (pipeline/protocol.py: train/replica.Replica, pipeline/engine.Pipeline,
pipeline/pipedream.PipeDreamPipeline, train/post_validation.PostValidatedEngine) runs the
forwards and backwards of this rank's microbatches; `update` then finishes the gradients
(dp × cp sum, tp partial sums, shared tied copies), takes the global norm, clips and steps
AdamW; `TrainHooks` (train/hooks.py) observe both. PipeDream calls the same `update` once
per microbatch from inside its run.

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
`final`; step s + 1's carries it as `previous`, and `settle` validates a pending step at once
(before evaluation, checkpoints, the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from megapipe.config import Config
from megapipe.distributed.progress import NO_PROGRESS, Progress
from megapipe.parallel.data.levels import shards_grads
from megapipe.parallel.tensor.grad_sync import sync_tp_partial_grads
from megapipe.pipeline.pipedream import PipeDreamPipeline
from megapipe.pipeline.protocol import Engine, Grads
from megapipe.train.batches import BatchSlice
from megapipe.train.hooks import NO_HOOKS, TrainHooks, optimizer_step
from megapipe.train.optim import clip_gradients, global_grad_norm, lr_at, set_lr
from megapipe.train.post_validation import PostValidatedEngine
from megapipe.train.zero_grads import finish_grad_shards


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: bool = False  # non-finite loss or grad norm, or a spike: the optimizer did not step
    # post-validation: this step's figures are not known yet (loss and norm NaN) ...
    final: bool = True
    previous: StepResult | None = None  # ... and the step before, validated now, if pending


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
    gradients over the mesh, clip, and take one AdamW step (PipeDream: one per microbatch).

    `step` is the number of optimizer steps already taken (it picks the learning rate);
    `hooks` observe the forward-backward and every optimizer step (train/hooks.py); a loss
    above `loss_limit` (a spike: train/spikes.py) skips the step as a non-finite one does;
    `progress` records the step's waits on the other ranks (distributed/progress.py).
    """
    tokens = cfg.derived.tokens_per_step
    micro = slice_.microbatches(batch.to(engine.device), cfg.parallel.microbatches)
    if isinstance(engine, PostValidatedEngine):
        return _post_validated(engine, slice_, optimizer, micro, step, cfg, hooks)
    step_update = partial(
        update,
        optimizer=optimizer,
        step=step,
        cfg=cfg,
        hooks=hooks,
        loss_limit=loss_limit,
        progress=progress,
    )
    hooks.forward_backward_begin(step)
    loss_sum = engine.forward_backward(micro, tokens, step_update)
    hooks.forward_backward_end(step, engine.events)
    progress.wait("all_reduce loss")
    loss = slice_.sum(engine.stage_loss(loss_sum)) / tokens  # the same on every rank
    progress.waited()
    if isinstance(engine, PipeDreamPipeline):  # §3.3: each stage stepped after every microbatch
        norm, skipped = engine.step_grad_norm()
        lr = lr_at(step, cfg.train)
    else:
        norm_t, lr, skipped = step_update(engine, loss=loss)
        norm = norm_t.item()
    return StepResult(loss=loss.item(), grad_norm=norm, lr=lr, skipped=skipped)


def _post_validated(
    engine: PostValidatedEngine, slice_, optimizer, micro, step: int, cfg: Config, hooks
) -> StepResult:
    """Zero Bubble §4: this step's forwards and backwards run on the weights of the previous
    step's optimistic update; the previous step is validated after them (its global state came
    back meanwhile) and, if any stage's optimistic step was wrong, every stage rolls back and
    redoes it, and this step's work runs again on the corrected weights (same RNG draws)."""
    tokens = cfg.derived.tokens_per_step
    hooks.forward_backward_begin(step)
    loss_sum = engine.forward_backward(micro, tokens)
    hooks.forward_backward_end(step, engine.events)
    previous = None
    if engine.pending:
        started = engine.events[0].t0 if engine.events else None
        fields, redo = engine.settle(optimizer, cfg, hooks, started)
        previous = StepResult(*fields)
        if redo:
            loss_sum = engine.redo(micro, tokens)
    engine.step(optimizer, slice_.sum(loss_sum) / tokens, step, cfg, hooks)
    nan = float("nan")
    return StepResult(nan, nan, lr_at(step, cfg.train), final=False, previous=previous)


def settle(engine: Engine, optimizer, cfg: Config, hooks: TrainHooks = NO_HOOKS):
    """Validate a pending post-validated step now (rolled back and redone if it must be): its
    final result; None when nothing is pending."""
    if not isinstance(engine, PostValidatedEngine) or not engine.pending:
        return None
    fields, _ = engine.settle(optimizer, cfg, hooks)
    return StepResult(*fields)


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
    """Step 3 of one training step on `grads` (an engine, or one PipeDream stage): the dp × cp
    sum of each chunk's buckets, then tp partial sums, then shared copies (the tied embedding);
    the global norm over `grads.norm_group`, clip, AdamW. Returns (norm, lr, skipped): with a
    non-finite norm or `loss` (both agreed over the mesh), or a `loss` above `loss_limit`, the
    optimizer does not step. `progress` records the two waits on other ranks
    (distributed/progress.py)."""
    progress.wait("all_reduce grads")
    if shards_grads(grads.reducers):  # zero >= 2: on this rank's shards (train/zero_grads.py)
        counted, to_clip = finish_grad_shards(grads)
    else:
        for chunk, reducer in zip(grads.chunks, grads.reducers):
            if reducer is not None:
                reducer.finish()
            sync_tp_partial_grads(chunk)
        grads.sync_shared_grads()
        counted, to_clip = grads.grads_counted_once(), grads.params()
    progress.wait("all_reduce grad norm")
    norm = global_grad_norm(counted, grads.norm_group)
    progress.doing("optimizer")
    if not finite(norm, loss) or spiked(loss, loss_limit):
        optimizer.zero_grad(set_to_none=True)  # weights, moments and AdamW's step untouched
        return norm, lr_at(step, cfg.train), True
    return norm, clip_and_step(optimizer, to_clip, norm, step, cfg, hooks), False


def finite(*values: torch.Tensor | None) -> bool:
    """Every given scalar is finite (no inf, no NaN)."""
    return all(v is None or bool(torch.isfinite(v).all()) for v in values)


def spiked(loss: torch.Tensor | None, limit: float) -> bool:
    """The agreed `loss` exceeds `limit`, compared in float64 as the loop compares the value it
    records (train/spikes.py), so both see the same decision."""
    return loss is not None and limit < math.inf and loss.item() > limit


def clip_and_step(
    optimizer, params: list, norm: torch.Tensor, step: int, cfg: Config, hooks: TrainHooks
) -> float:
    """Clip to `train.grad_clip` by the global `norm`, set this step's LR, take the AdamW step
    and clear the grads; returns the LR used."""
    clip_gradients(params, norm, cfg.train.grad_clip)
    lr = lr_at(step, cfg.train)
    set_lr(optimizer, lr)
    optimizer_step(optimizer, hooks)
    optimizer.zero_grad(set_to_none=True)
    return lr
