"""The one message rule: which tensor an action sends when done and which it needs to start.

Every tensor that crosses a stage boundary is a `Message`: an activation going from stage s to
s+1 (sent by F on s, needed by F on s+1), or an input-grad going back from s+1 to s (sent by B
or BW on s+1, needed by B or BW on s). W sends and needs nothing across stages; the first stage
takes token ids, the last starts its backward from the loss. The runtime (pipeline/runtime.py),
the per-channel order (channels.py) and the dependency walk of validate.py and simulate.py all
read this rule, so they cannot disagree.
"""

from __future__ import annotations

from typing import NamedTuple

from megapipe.plan.actions import FORWARD, WEIGHT_GRAD, Action


class Message(NamedTuple):
    """One tensor over the boundary between global stages `boundary` and `boundary + 1`."""

    grad: bool  # False: activation, forward direction; True: input-grad, backward direction
    microbatch: int
    boundary: int
    segment: int | None = None  # Seq1F1B sequence segment; None: the whole sequence

    def source_stage(self) -> int:
        return self.boundary + 1 if self.grad else self.boundary

    def dest_stage(self) -> int:
        return self.boundary if self.grad else self.boundary + 1


def sent(a: Action, stage: int, last: int) -> Message | None:
    """The message `a` on global `stage` sends when done (None: nothing crosses a boundary)."""
    if a.kind == FORWARD:
        return Message(False, a.microbatch, stage, a.segment) if stage < last else None
    if a.kind == WEIGHT_GRAD or stage == 0:
        return None
    return Message(True, a.microbatch, stage - 1, a.segment)


def received(a: Action, stage: int, last: int) -> Message | None:
    """The message `a` on global `stage` needs before it starts (what `sent` gave next door)."""
    if a.kind == FORWARD:
        return Message(False, a.microbatch, stage - 1, a.segment) if stage > 0 else None
    if a.kind == WEIGHT_GRAD or stage == last:
        return None
    return Message(True, a.microbatch, stage, a.segment)
