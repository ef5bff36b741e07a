"""Zero Bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward is split into B (input-grad, on the critical path) and W (weight-grad, free to move).
ZB-H1 and ZB-H2 are the handcrafted schedules of §3.1; ZB-V is the V-placement schedule of the
follow-up (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", §4), built here with the
greedy heuristic of the Zero Bubble paper §3.2 under a 1F1B memory limit.
"""

from __future__ import annotations

import bisect

from megapipe.plan.actions import (
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    Schedule,
    one_f_one_b_order,
)
from megapipe.plan.simulate import Costs, action_cost, simulate
from megapipe.plan.walk import produced_events, required_events


def _split_backward_order(microbatches: int, warmup: int, w_lag: int) -> list[Action]:
    """1F1B with B/W split where each W trails its B by ``w_lag`` backward steps."""
    forwards = [Action(FORWARD, mb) for mb in range(microbatches)]
    backwards = []
    for mb in range(microbatches):
        group = [Action(INPUT_GRAD, mb)]
        if mb >= w_lag:
            group.append(Action(WEIGHT_GRAD, mb - w_lag))
        backwards.append(group)
    # cool-down tail: the W's still owed, oldest first, fill the last bubbles
    tail = [Action(WEIGHT_GRAD, mb) for mb in range(max(0, microbatches - w_lag), microbatches)]
    return one_f_one_b_order(forwards, backwards, warmup, tail)


def one_f_one_b_split(pp: int, microbatches: int) -> Schedule:
    """1F1B with each backward as B then W at once: 1F1B's order and memory (pp − r in flight on
    rank r), on the split-backward runtime (zb_auto's baseline among the hand-made schedules)."""
    return {r: _split_backward_order(microbatches, pp - r - 1, 0) for r in range(pp)}


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 (§3.1, Fig. 3 top): 1F1B's warm-up (pp−r−1 forwards), rank r delays its W's by r.

    Delaying W's lets B's travel upstream without waiting, and the owed W's fill the cool-down:
    the bubble shrinks from (p−1)(T_F+T_B+T_W) to (p−1)(T_F+T_B−T_W) with peak memory still pp
    microbatches (every rank holds pp−r−1 + 1 + r activations until their W).
    """
    return {r: _split_backward_order(microbatches, pp - r - 1, r) for r in range(pp)}


def zb_h2(pp: int, microbatches: int) -> Schedule:
    """ZB-H2 (§3.1, Fig. 3 bottom): extra warm-up forwards fill the bubble before the first B.

    Rank r runs 2(pp−r−1) warm-up forwards (the slots it would idle waiting for the first B come
    back) and delays its W's by up to 2r, so B's race upstream in the cool-down while the owed W's
    fill it; peak 2(pp−r−1) + 1 + 2r = 2pp−1 in-flight microbatches. With few microbatches
    (m < pp + r) the lag is cut back towards ZB-H1's r: there are too few later B's to fill with.
    """
    schedule = {}
    for r in range(pp):
        w_lag = r + min(r, max(0, microbatches - pp))
        schedule[r] = _split_backward_order(microbatches, 2 * (pp - r - 1), w_lag)
    return schedule


def zb_v(
    pp: int, microbatches: int, memory_limit: float | None = None, costs: Costs | None = None
) -> Schedule:
    """ZB-V: two chunks per rank in V placement, built greedily at 1F1B memory.

    List scheduling over time (Zero Bubble §3.2 heuristic, which schedules with the profiled
    T_F, T_B, T_W): whenever a rank is free it runs, in this priority, a ready B (critical path),
    a ready F while below the memory limit (default 2pp chunk activations = pp full
    microbatches, 1F1B's peak), else the oldest owed W (fills bubbles and frees memory). B's go
    oldest microbatch first (chunk 1 before chunk 0), F's chunk 1 first, so microbatches leave
    the pipeline early. Without `costs` the actions take unit time. With `costs` (profiled:
    B > W is common, and then the unit-time order idles) the greedy also runs on those costs,
    with and without one memory slot kept for a chunk-1 forward (timed greedy can otherwise
    fill memory with chunk-0 forwards), and the candidate with the shortest simulated makespan
    under `costs` wins, like the Zero Bubble paper's pick among its heuristic's variants.
    """
    placement = Placement(pp, 2, "v")
    limit = 2 * pp if memory_limit is None else memory_limit
    if costs is None:
        return _greedy(pp, microbatches, limit, Costs(), reserve=False)
    candidates = []
    for timing, reserve in ((Costs(), False), (costs, False), (costs, True)):
        try:
            candidates.append(_greedy(pp, microbatches, limit, timing, reserve))
        except ValueError:  # this variant fills memory before the first B: no schedule
            continue
    return min(candidates, key=lambda s: simulate(s, costs, placement).makespan)


def _greedy(pp: int, microbatches: int, limit: float, costs: Costs, reserve: bool) -> Schedule:
    """The list schedule of `zb_v` with actions timed by `costs`."""
    placement = Placement(pp, 2, "v")
    units = [(mb, c) for c in (1, 0) for mb in range(microbatches)]  # priority order
    state = {r: {"to_forward": list(units), "to_backward": [], "owed_w": []} for r in range(pp)}
    finished: dict = {}  # event -> (end time, producing rank)
    ends: list[float] = []  # every end time in `finished`, sorted
    free_at, idle_since = [0.0] * pp, [None] * pp
    schedule: Schedule = {r: [] for r in range(pp)}
    while True:
        rank, now = _next_rank(state, free_at, idle_since, ends)
        if rank is None:
            return schedule
        ready = _ready_at(rank, now, finished, placement, costs)
        action = _pick(state[rank], limit, ready, reserve)
        if action is None:  # wait for the next result anywhere
            idle_since[rank] = now
            continue
        stage = placement.stage(rank, action.chunk)
        free_at[rank] = now + action_cost(action, stage, costs, placement, [1.0])
        idle_since[rank] = None
        schedule[rank].append(action)
        for event in produced_events(action, stage):
            finished[event] = (free_at[rank], rank)
        bisect.insort(ends, free_at[rank])


def _next_rank(state: dict, free_at: list, idle_since: list, ends: list[float]):
    """(rank, time) that decides next: the earliest free rank with work, lowest rank on ties;
    an idle rank wakes at the first result after it went idle. (None, None) when all is done."""
    best = (None, None)
    for rank, s in state.items():
        if not any(s.values()):  # nothing left to forward, backward or weight-grad
            continue
        when = free_at[rank]
        if idle_since[rank] is not None:
            later = bisect.bisect_right(ends, idle_since[rank])
            if later == len(ends):
                continue
            when = ends[later]
        if best[0] is None or when < best[1]:
            best = (rank, when)
    if best[0] is None and any(any(s.values()) for s in state.values()):
        raise ValueError("zb_v: no progress (memory_limit too small?)")
    return best


def _ready_at(rank: int, now: float, finished: dict, placement: Placement, costs: Costs):
    """ready(action): every input of `action` is available on `rank` at time `now`."""

    def ready(action: Action) -> bool:
        stage = placement.stage(rank, action.chunk)
        for event in required_events(action, stage, placement.num_stages, 1):
            end, producer = finished.get(event, (None, rank))
            if end is None or end + (costs.comm if producer != rank else 0.0) > now:
                return False
        return True

    return ready


def _pick(state: dict, limit: float, ready, reserve: bool):
    """Choose a rank's next action (None to idle) and update its bookkeeping."""
    for mb, chunk in sorted(state["to_backward"], key=lambda u: (u[0], -u[1])):
        if ready(Action(INPUT_GRAD, mb, chunk)):  # B first: it is on the critical path
            state["to_backward"].remove((mb, chunk))
            state["owed_w"].append((mb, chunk))
            return Action(INPUT_GRAD, mb, chunk)
    live = len(state["to_backward"]) + len(state["owed_w"])
    if live < limit:
        for mb, chunk in state["to_forward"]:
            # with `reserve`, chunk 0 leaves a slot for a chunk-1 forward (toward the first B)
            fits = chunk == 1 or not reserve or live + 1 < limit
            if fits and ready(Action(FORWARD, mb, chunk)):
                state["to_forward"].remove((mb, chunk))
                state["to_backward"].append((mb, chunk))
                return Action(FORWARD, mb, chunk)
    if state["owed_w"]:  # W last: fills bubbles and frees activation memory
        mb, chunk = state["owed_w"].pop(0)
        return Action(WEIGHT_GRAD, mb, chunk)
    return None
