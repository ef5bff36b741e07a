"""The runtime's semantics as a walk: each rank runs its list in order, sends are asynchronous
and buffered, so only receives wait (docs/architecture.md, Invariants).

An action may start once the events it needs have happened: the message it receives (the one
rule of messages.py) and the work on its own stage it depends on; the forward of a DualPipe F&B
pair (Action.pair) also waits for what its backward needs, so the pair starts as one unit.
`walk` advances every rank as far as it can until none can; validate.py (order and deadlock
checks) and dag.py (the DAG that simulate.py and the performance model time) are two callbacks
on this one walk, so they cannot disagree about what may run.
"""

from __future__ import annotations

from collections.abc import Callable

from megapipe.plan.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Placement, Schedule
from megapipe.plan.messages import Message, received

Event = tuple[str, int, int, int]  # (F | G | W, microbatch, global stage, segment)


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


def _sender_event(msg: Message) -> Event:
    """The event whose end puts `msg` on the wire: F of its source stage, or that stage's G."""
    seg = 0 if msg.segment is None else msg.segment
    return ("G" if msg.grad else "F", msg.microbatch, msg.source_stage(), seg)


def required_events(action: Action, stage: int, num_stages: int, segments: int) -> list[Event]:
    """Events that must have happened before ``action`` can start."""
    mb, seg = action.microbatch, action.seg
    msg = received(action, stage, num_stages - 1)
    from_peer = [] if msg is None else [_sender_event(msg)]
    if action.kind == FORWARD:
        # Seq1F1B (Sun et al. 2024) §3: segment i attends to the K/V of segments < i.
        return from_peer + ([("F", mb, stage, seg - 1)] if seg > 0 else [])
    if action.kind == WEIGHT_GRAD:
        return [("G", mb, stage, seg)]
    # Causal attention: later segments send gradient into this segment's K/V.
    later = [("G", mb, stage, seg + 1)] if seg < segments - 1 else []
    return [("F", mb, stage, seg)] + from_peer + later


Run = Callable[[int, Action, int, list[Event], dict], object]
Blocked = Callable[[int, int, list[Event], dict], None]


def walk(schedule: Schedule, placement: Placement, run: Run, blocked: Blocked | None = None):
    """Advance every rank through its list until none can move; raise ScheduleError on a
    deadlock. `run(rank, action, stage, needs, finished)` executes a ready action and returns
    what to record for the events it produces (`finished[event]`); `blocked(rank, index,
    needs, finished)` is told when a rank must wait."""
    segments = 1 + max((a.seg for acts in schedule.values() for a in acts), default=0)
    finished: dict[Event, object] = {}
    heads = {rank: 0 for rank in schedule}
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in schedule.items():
            while heads[rank] < len(actions):
                a = actions[heads[rank]]
                stage = placement.stage(rank, a.chunk)
                needs = required_events(a, stage, placement.num_stages, segments)
                if a.pair and heads[rank] + 1 < len(actions):  # an F&B pair starts as one
                    b = actions[heads[rank] + 1]
                    b_stage = placement.stage(rank, b.chunk)
                    needs = needs + required_events(b, b_stage, placement.num_stages, segments)
                if any(e not in finished for e in needs):
                    if blocked is not None:
                        blocked(rank, heads[rank], needs, finished)
                    break
                value = run(rank, a, stage, needs, finished)
                for event in produced_events(a, stage):
                    finished[event] = value
                heads[rank] += 1
                progressed = True
    stuck = [f"rank {r} at {schedule[r][i]}" for r, i in heads.items() if i < len(schedule[r])]
    if stuck:
        raise ScheduleError(f"deadlock: no rank can progress ({', '.join(stuck)})")
