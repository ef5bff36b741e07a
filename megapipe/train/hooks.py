"""Observers of a training run: the loop (train/loop.py) and the step core (train/step.py) call
a `TrainHooks` passed to them at each point below; observers subclass it and override what
they need (train/profile.py's per-step profile; a benchmark's timers). Nothing is patched:
the design's "hooks, never patches" (docs/architecture.md).

Order within one step: step_begin, forward_backward_begin, forward_backward_end (with the
pipeline runtime's action spans), optimizer_begin/optimizer_end around every optimizer step
(PipeDream: once per microbatch, inside forward_backward; post-validation: the optimistic
step and a redone one), step_end; `evaluated` after a validation, `train_end` once at the end.
"""

from __future__ import annotations

from megapipe.pipeline.runtime import Event


class TrainHooks:
    """Every hook does nothing here."""

    def step_begin(self, step: int) -> None:
        """Before train step `step` (the optimizer steps already taken)."""

    def forward_backward_begin(self, step: int) -> None:
        """Right before the engine runs step `step`'s forwards and backwards."""

    def forward_backward_end(self, step: int, events: list[Event]) -> None:
        """Right after them; `events`: each pipeline action's span (pipeline/runtime.Event;
        [] without a pipeline)."""

    def optimizer_begin(self) -> None:
        """Right before an `optimizer.step()`."""

    def optimizer_end(self) -> None:
        """Right after it."""

    def step_end(self, step: int, result, seconds: float) -> None:
        """After train step `step` returned `result` (train/step.StepResult) in `seconds`."""

    def evaluated(self, step: int, losses: dict[str, float]) -> None:
        """After the validation at step `step`: {"val_loss": ..., "val_loss/NAME": ...}."""

    def train_end(self, job, records: list[dict]) -> None:
        """Once, after the loop's last step, its checkpoints written (train/parallelize.Job)."""


NO_HOOKS = TrainHooks()


class HookList(TrainHooks):
    """Several observers, each called in the order given."""

    def __init__(self, hooks: list[TrainHooks]) -> None:
        self.hooks = hooks

    def step_begin(self, step: int) -> None:
        for h in self.hooks:
            h.step_begin(step)

    def forward_backward_begin(self, step: int) -> None:
        for h in self.hooks:
            h.forward_backward_begin(step)

    def forward_backward_end(self, step: int, events: list[Event]) -> None:
        for h in self.hooks:
            h.forward_backward_end(step, events)

    def optimizer_begin(self) -> None:
        for h in self.hooks:
            h.optimizer_begin()

    def optimizer_end(self) -> None:
        for h in self.hooks:
            h.optimizer_end()

    def step_end(self, step: int, result, seconds: float) -> None:
        for h in self.hooks:
            h.step_end(step, result, seconds)

    def evaluated(self, step: int, losses: dict[str, float]) -> None:
        for h in self.hooks:
            h.evaluated(step, losses)

    def train_end(self, job, records: list[dict]) -> None:
        for h in self.hooks:
            h.train_end(job, records)


def optimizer_step(optimizer, hooks: TrainHooks) -> None:
    """`optimizer.step()` between its two hooks."""
    hooks.optimizer_begin()
    optimizer.step()
    hooks.optimizer_end()
