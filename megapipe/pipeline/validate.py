"""Schedule validator: completeness, dependencies, weight versions and deadlock freedom.

Runtime semantics modelled here (and in simulate.py): each rank runs its list in order; sends are
asynchronous and buffered, so only receives wait. A forward waits for the previous stage's
forward (its input activation), a backward waits for the next stage's input-grad backward (its
output-grad). Deadlock freedom is then acyclicity of "rank order + data dependencies".
"""

from __future__ import annotations

from collections import Counter

from megapipe.pipeline.actions import (
    FORWARD,
    FULL_BACKWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    Schedule,
)

Event = tuple[str, int, int, int]  # (what, microbatch, global stage, segment)


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names rank, action and rule."""


def produced_events(action: Action, stage: int) -> list[Event]:
    """What finishing ``action`` makes available: activation (F), input-grad (G), weight-grad
    (W)."""
    mb, seg = action.microbatch, action.seg
    if action.kind == FORWARD:
        return [("F", mb, stage, seg)]
    if action.kind == INPUT_GRAD:
        return [("G", mb, stage, seg)]
    if action.kind == WEIGHT_GRAD:
        return [("W", mb, stage, seg)]
    return [("G", mb, stage, seg), ("W", mb, stage, seg)]


def required_events(action: Action, stage: int, num_stages: int, segments: int) -> list[Event]:
    """Events that must have happened before ``action`` can start."""
    mb, seg = action.microbatch, action.seg
    if action.kind == FORWARD:
        needs = [("F", mb, stage - 1, seg)] if stage > 0 else []
        # Seq1F1B (Sun et al. 2024) §3: segment i attends to the K/V of segments < i.
        return needs + ([("F", mb, stage, seg - 1)] if seg > 0 else [])
    if action.kind == WEIGHT_GRAD:
        return [("G", mb, stage, seg)]
    needs = [("F", mb, stage, seg)]
    if stage < num_stages - 1:
        needs.append(("G", mb, stage + 1, seg))
    if seg < segments - 1:
        # Causal attention: later segments send gradient into this segment's K/V.
        needs.append(("G", mb, stage, seg + 1))
    return needs


def _check_complete(schedule: Schedule, pp: int, m: int, v: int, k: int) -> None:
    if sorted(schedule) != list(range(pp)):
        raise ScheduleError(f"schedule has ranks {sorted(schedule)}, expected 0..{pp - 1}")
    segs = range(k) if k > 1 else [0]
    expected = {(mb, c, s) for mb in range(m) for c in range(v) for s in segs}
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
    segments = 1 + max((a.seg for acts in schedule.values() for a in acts), default=0)
    done: set[Event] = set()
    heads = {rank: 0 for rank in schedule}
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in schedule.items():
            while heads[rank] < len(actions):
                a = actions[heads[rank]]
                stage = placement.stage(rank, a.chunk)
                missing = [e for e in required_events(a, stage, placement.num_stages, segments)
                           if e not in done]
                if missing:
                    _raise_if_same_rank(rank, a, missing, schedule, heads, placement)
                    break
                done.update(produced_events(a, stage))
                heads[rank] += 1
                progressed = True
    stuck = [f"rank {r} at {schedule[r][i]}" for r, i in heads.items() if i < len(schedule[r])]
    if stuck:
        raise ScheduleError(f"deadlock: no rank can progress ({', '.join(stuck)})")


def _raise_if_same_rank(rank, action, missing, schedule, heads, placement) -> None:
    """A dependency on this rank that is still ahead in its own list can never be met."""
    later = schedule[rank][heads[rank] + 1:]
    for what, mb, stage, seg in missing:
        owner, chunk = placement.locate(stage)
        if owner != rank:
            continue
        for b in later:
            if b.unit == (mb, chunk, seg) and (what, mb, stage, seg) in produced_events(b, stage):
                raise ScheduleError(
                    f"rank {rank}: {action} runs before {b}, which it depends on (same rank)"
                )


def validate(schedule: Schedule, pp: int, m: int, v: int = 1, k: int = 1,
             placement: Placement | None = None) -> None:
    """Raise ScheduleError (one line: rank, action, rule) unless the schedule is runnable."""
    placement = placement or Placement(pp, v)
    _check_complete(schedule, pp, m, v, k)
    _check_versions(schedule)
    check_progress(schedule, placement)
