"""Schedule validator: completeness, dependencies, weight versions and deadlock freedom.

The runtime's semantics are walk.py's: each rank runs its list in order, only receives wait.
Deadlock freedom is then acyclicity of "rank order + data dependencies", which the walk checks.
"""

from __future__ import annotations

from collections import Counter

from megapipe.plan.actions import (
    FORWARD,
    FULL_BACKWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    Schedule,
)
from megapipe.plan.walk import ScheduleError, produced_events, walk

__all__ = ["ScheduleError", "check_progress", "validate"]


def _check_complete(schedule: Schedule, pp: int, m: int, v: int, k: int, where: Placement) -> None:
    if sorted(schedule) != list(range(pp)):
        raise ScheduleError(f"schedule has ranks {sorted(schedule)}, expected 0..{pp - 1}")
    segs = range(k) if k > 1 else [0]
    expected = {(mb, c, s) for mb in range(m) for c in range(v) for s in segs if where.runs(mb, c)}
    for rank, actions in schedule.items():
        counts = Counter((a.kind, a.unit) for a in actions)
        for a in actions:
            if a.unit not in expected:
                raise ScheduleError(f"rank {rank}: {a} is outside m={m}, v={v}, k={k}")
            if counts[(a.kind, a.unit)] > 1:
                raise ScheduleError(f"rank {rank}: {a} appears {counts[(a.kind, a.unit)]} times")
            split_done = counts[(INPUT_GRAD, a.unit)] or counts[(WEIGHT_GRAD, a.unit)]
            if a.kind == FULL_BACKWARD and split_done:
                raise ScheduleError(f"rank {rank}: {a} mixes BW with B/W for the same unit")
        for unit in sorted(expected):
            name = Action(FORWARD, unit[0], unit[1], unit[2] if k > 1 else None)
            if not counts[(FORWARD, unit)]:
                raise ScheduleError(f"rank {rank}: missing forward {name}")
            split = counts[(INPUT_GRAD, unit)] + counts[(WEIGHT_GRAD, unit)]
            if not counts[(FULL_BACKWARD, unit)] and split != 2:
                raise ScheduleError(f"rank {rank}: missing backward (BW or B+W) for {name}")


def _check_pairs(schedule: Schedule) -> None:
    """A DualPipe F&B pair (DeepSeek-V3 §3.2.1) is a forward followed by a B or BW."""
    for rank, actions in schedule.items():
        for a, b in zip(actions, [*actions[1:], None]):
            if a.pair and (
                a.kind != FORWARD or b is None or b.kind not in (INPUT_GRAD, FULL_BACKWARD)
            ):
                raise ScheduleError(
                    f"rank {rank}: {a} is paired but not a forward before a B or BW"
                )


def _check_versions(schedule: Schedule) -> None:
    """PipeDream weight stashing: the F and backward of a unit use the same weight version."""
    for rank, actions in schedule.items():
        updates_done, forward_version = 0, {}
        for a in actions:
            if a.version is None:
                continue
            if a.version > updates_done:
                raise ScheduleError(f"rank {rank}: {a} uses version {a.version} before it exists")
            if a.kind == FORWARD:
                forward_version[a.unit] = a.version
            elif forward_version.get(a.unit) != a.version:
                raise ScheduleError(
                    f"rank {rank}: {a} uses a different weight version than its forward"
                )
            if a.kind in (FULL_BACKWARD, WEIGHT_GRAD):
                updates_done += 1


def check_progress(schedule: Schedule, placement: Placement) -> None:
    """Run every rank's list under the receive-waits semantics; raise on an order violation or a
    deadlock."""

    def blocked(rank: int, index: int, needs: list, finished: dict) -> None:
        missing = [e for e in needs if e not in finished]
        _raise_if_same_rank(
            rank, schedule[rank][index], missing, schedule[rank][index + 1 :], placement
        )

    walk(schedule, placement, lambda *_: True, blocked)


def _raise_if_same_rank(rank, action, missing, later, placement) -> None:
    """A dependency on this rank that is still ahead in its own list can never be met."""
    for what, mb, stage, seg in missing:
        owner, chunk = placement.locate(stage, mb)
        if owner != rank:
            continue
        for b in later:
            if b.unit == (mb, chunk, seg) and (what, mb, stage, seg) in produced_events(b, stage):
                raise ScheduleError(
                    f"rank {rank}: {action} runs before {b}, which it depends on (same rank)"
                )


def validate(
    schedule: Schedule, pp: int, m: int, v: int = 1, k: int = 1, placement: Placement | None = None
) -> None:
    """Raise ScheduleError (one line: rank, action, rule) unless the schedule is runnable."""
    placement = placement or Placement(pp, v)
    _check_complete(schedule, pp, m, v, k, placement)
    _check_pairs(schedule)
    _check_versions(schedule)
    check_progress(schedule, placement)
