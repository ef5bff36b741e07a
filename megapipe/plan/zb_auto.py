"""Zero Bubble's automatic schedules ZB-1p and ZB-2p (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", ICLR 2024, §3 and §3.1), built for given F, B, W, comm costs under a memory limit.

Memory is counted as in the paper (Table 1, §2.3): a microbatch holds M_B on a rank from the
start of its F to the end of its B, then M_W until the end of its W; ``w_share`` is M_W / M_B
(with 1, the default, a microbatch counts whole until its W: simulate.py's peak_inflight). The
limit is in units of M_B: ``1p`` = pp microbatches, 1F1B's peak on rank 0 (ZB-1p), ``2p`` twice
that (ZB-2p), or a whole number. One stage per rank; a list schedule over time, stage by stage
in order of the time each is free, with the paper's heuristic (§3.1):

- Warm-up: as many F's as the memory limit allows before the first B arrives. An F that would
  end after that B's arrival delays it: a binary hyperparameter says whether to run it.
- Steady state: F and B alternate. When the next one has not arrived, a W fills the gap if the
  gap is at least T_W; a shorter gap is filled too when idling would make this stage's
  cumulative bubble the largest of all stages. A W also runs when the memory limit leaves no
  room for the next F. Otherwise W's wait, and the stages settle into 1F-1B-1W.
- Stage i stays at least one F ahead of stage i+1: in stage i+1's warm-up, its F(k) starts only
  once stage i has started F(k+1) (so under 1p the warm-ups step down like 1F1B's); while stage
  i is more than one F ahead, a second binary hyperparameter lets it skip an F for a B that has
  arrived or an owed W, which adds no bubble.
- Cool-down: when F's and B's run out, the W's still owed, one by one.

A third binary choice (ours) lets a stage whose next F or B has not arrived run the other one
if it has. Like the paper, which grid-searches its hyperparameters, zb_auto builds every
combination (timed by the given costs and by unit costs, as zb_v does) and takes the best in
simulation under the given costs, counting the hand-made schedules that fit the limit (1F1B
with B/W split, ZB-H1, ZB-H2) as candidates too: the shortest longest per-rank span (the
paper's cost, the time of a step once steps overlap, §4), then makespan, among those no
slower in makespan (a synchronous step's time) than any hand-made schedule that fits, up to
MAKESPAN_SLACK (0.1%). So in simulation zb_auto is never slower than 1F1B, ZB-H1 or ZB-H2
within its memory, and its span is no longer than the fastest one's. A small local search
then refines it (single W's moved into the waits or out of the way of a late input; the paper
refines with an ILP). Fed the paper's profiled costs (its Table 9) and w_share from its Table
1, the heuristic alone gives the paper's ZB-1p and ZB-2p bubble rates (Table 5;
tests/test_zb_auto.py checks the 1.5B, m=24 row).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from megapipe.plan.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Placement, Schedule
from megapipe.plan.simulate import Costs, SimResult, action_cost, simulate
from megapipe.plan.zero_bubble import one_f_one_b_split, zb_h1, zb_h2

LOCAL_SEARCH_SIMULATIONS = 30  # at most this many simulations in the W-moving refinement
# zb_auto's makespan may exceed the fastest hand-made schedule's by this fraction when its
# longest span is shorter: e.g. at p=16, m=128 (the paper's 14.6B row) ZB-2p's makespan is
# 0.02% over ZB-H2's (both at the bound (p−1)(T_F+T_comm) + m(T_F+T_B+T_W)) for a 2.4% shorter
# span. A synchronous step lasts the makespan, overlapping steps (post-validation) the span.
MAKESPAN_SLACK = 1e-3


def memory_limit(memory: str | int | float, pp: int) -> int:
    """Microbatches in flight per rank: ``"1p"`` = pp, ``"2p"`` = 2·pp, ``"1.5p"``, or a whole
    number; a one-line ValueError names the fix."""
    text = str(memory).strip()
    fix = "use 1p, 2p (times pp) or a whole number of microbatches >= 1"
    try:
        value = float(text[:-1] or 1) * pp if text.endswith("p") else float(text)
    except ValueError:
        raise ValueError(f"zb_memory={memory!r} is not a memory limit: {fix}") from None
    if not text.endswith("p") and value != int(value):
        raise ValueError(f"zb_memory={memory!r} is not a whole number: {fix}")
    if not value >= 1:
        raise ValueError(f"zb_memory={memory!r} allows less than one microbatch: {fix}")
    return int(value + 1e-9)


def zb_auto(
    pp: int,
    microbatches: int,
    memory: str | int | float = "1p",
    costs: Costs | None = None,
    w_share: float = 1.0,
) -> Schedule:
    """ZB-1p / ZB-2p (module docstring) for `costs` (default unit costs) within `memory`
    microbatches per rank, counted by `peak_memory` with `w_share`."""
    costs = Costs() if costs is None else costs
    limit = memory_limit(memory, pp)
    if not 0 < w_share <= 1:
        raise ValueError(f"w_share={w_share} must be in (0, 1]: the part of a microbatch W keeps")
    place = Placement(pp)
    hand = [one_f_one_b_split(pp, microbatches), zb_h1(pp, microbatches), zb_h2(pp, microbatches)]
    auto = [
        heuristic(pp, microbatches, limit, w_share, timing, *params)
        for timing in [costs] + ([Costs()] if costs != Costs() else [])
        for params in itertools.product((False, True), repeat=3)
    ]
    fitting = []
    for schedule in auto + hand:
        result = simulate(schedule, costs, place)
        if max(peak_memory(result, w_share)) <= limit + 1e-9:
            fitting.append((schedule, result))
    # no slower (makespan) than the hand-made schedules within the memory (none may fit)
    fastest = min((r.makespan for s, r in fitting if any(s is h for h in hand)), default=None)
    bound = None if fastest is None else fastest * (1 + MAKESPAN_SLACK) + 1e-9
    best = min(
        (item for item in fitting if bound is None or item[1].makespan <= bound),
        key=lambda item: _score(item[1]),
    )
    return _local_search(best[0], best[1], costs, place, limit, w_share, bound)


def peak_memory(result: SimResult, w_share: float = 1.0) -> list[float]:
    """Per rank, the most activation memory held at once in microbatches, by Zero Bubble's
    accounting (Qi et al. 2023, Table 1): one (M_B) from the start of F to the end of B, then
    `w_share` (M_W / M_B) until the end of W; a BW frees it all. With w_share=1 this is
    simulate's peak_inflight."""
    deltas: dict[int, list[tuple[float, float]]] = {}
    for rank, a, start, end in result.timeline:
        change = {
            FORWARD: (start, 1.0),
            INPUT_GRAD: (end, w_share - 1.0),
            WEIGHT_GRAD: (end, -w_share),
        }.get(a.kind, (end, -1.0))
        deltas.setdefault(rank, []).append(change)
    peaks = []
    for rank in sorted(deltas):
        live = peak = 0.0
        for _, delta in sorted(deltas[rank]):  # frees before allocations at equal times
            live += delta
            peak = max(peak, live)
        peaks.append(round(peak, 9))
    return peaks


def _score(result: SimResult) -> tuple[float, float]:
    """What is minimised: the paper's cost, the longest per-rank span (a step's time once steps
    overlap, §4), then the makespan (the step's time from the first start to the last end)."""
    return (round(max(result.span), 9), round(result.makespan, 9))


@dataclass
class _Stage:
    """One stage's progress in the list schedule."""

    forwards: int = 0  # F's scheduled (microbatches in order)
    backwards: int = 0  # B's scheduled
    weights: int = 0  # W's scheduled (oldest B first)
    clock: float = 0.0  # free from (busy until, or idle since)
    idle: float = 0.0  # cumulative bubble since its first action
    last: str | None = None  # kind of the last F or B
    actions: list[Action] = field(default_factory=list)


class _Planner:
    """The heuristic's list schedule for one hyperparameter setting (module docstring)."""

    def __init__(self, pp, m, limit, w_share, costs, fill_warmup, skip_forward, take_ready):
        self.pp, self.m, self.limit, self.w_share, self.costs = pp, m, limit, w_share, costs
        self.fill_warmup, self.skip_forward, self.take_ready = fill_warmup, skip_forward, take_ready
        place = Placement(pp)
        self.cost = {
            (kind, i): action_cost(Action(kind, 0), i, costs, place, [1.0])
            for kind in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)
            for i in range(pp)
        }
        self.stages = [_Stage() for _ in range(pp)]
        self.ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end
        self.starts: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> its F's start

    def run(self) -> Schedule:
        while True:
            live = [i for i, s in enumerate(self.stages) if s.weights < self.m]
            if not live:
                return {i: s.actions for i, s in enumerate(self.stages)}
            for i in sorted(live, key=lambda i: (self.stages[i].clock, i)):
                choice = self._decide(i)
                if choice is not None:
                    self._commit(i, *choice)
                    break
            else:  # every stage waits on an unscheduled input: run the earliest known action
                self._commit(*self._fallback(live))

    def _fits_forward(self, s: _Stage) -> bool:
        """Room for one more F: a microbatch weighs 1 from F to B, `w_share` from B to W."""
        held = (s.forwards - s.backwards) + self.w_share * (s.backwards - s.weights)
        return held + 1 <= self.limit + 1e-9

    # -- readiness -------------------------------------------------------------------------
    def _ready(self, i: int, kind: str, mb: int) -> float | None:
        """When `kind` of `mb` can start on stage i (None: its producer is not scheduled)."""
        comm = self.costs.comm
        if kind == WEIGHT_GRAD:
            return self.ends[INPUT_GRAD, i, mb]
        if kind == FORWARD:
            if i == 0:
                return 0.0
            end = self.ends.get((FORWARD, i - 1, mb))
            if end is None or not self._gated(i, mb):
                return None if end is None else end + comm
            # stage i−1 stays an F ahead of stage i (§3.1): F(mb) here after F(mb+1) there
            ahead = self.starts.get((i - 1, mb + 1))
            return None if ahead is None else max(end + comm, ahead)
        elif i == self.pp - 1:  # the last stage's B starts from its own loss
            return self.ends[FORWARD, i, mb]
        else:
            end = self.ends.get((INPUT_GRAD, i + 1, mb))
        return None if end is None else end + comm

    def _estimate(self, i: int, kind: str, mb: int) -> tuple[float, bool]:
        """(ready time, known): the known time, else a lower bound from the producer's clock."""
        ready = self._ready(i, kind, mb)
        if ready is not None:
            return ready, True
        j = i - 1 if kind == FORWARD else i + 1
        end = self.ends.get((kind, j, mb))
        if end is None:
            return self.stages[j].clock + self.cost[kind, j] + self.costs.comm, False
        return max(end + self.costs.comm, self.stages[j].clock), False  # F gated on F(mb+1)

    def _gated(self, i: int, mb: int) -> bool:
        """Whether F(mb) on stage i waits for F(mb+1) on stage i−1: during stage i's warm-up
        (before its first B), except for the last microbatch (F's are used up). The lead needs
        stage 0 to hold pp microbatches before the last stage's first F, so a limit below pp
        drops the rule (it would deadlock)."""
        return self.stages[i].backwards == 0 and mb + 1 < self.m and self.limit >= self.pp

    # -- the heuristic ---------------------------------------------------------------------
    def _decide(self, i: int):
        """(action, start) for stage i at its clock, or None to wait for more information."""
        s, t = self.stages[i], self.stages[i].clock
        can_f = s.forwards < self.m and self._fits_forward(s)
        can_b = s.backwards < s.forwards
        owed_w = s.weights < s.backwards
        w_now = (Action(WEIGHT_GRAD, s.weights), t)
        if not (can_f or can_b):  # cool-down (or memory full): the W's still owed
            return w_now
        if s.backwards == 0:
            want = self._warmup_choice(i, t, can_f, can_b)
        else:
            want = self._steady_choice(i, can_f, can_b, owed_w)
            if want == WEIGHT_GRAD:
                return w_now
        if want == FORWARD and self._may_skip_forward(i, t, can_b, owed_w):
            b_ready = self._ready(i, INPUT_GRAD, s.backwards) if can_b else None
            if b_ready is not None and b_ready <= t:
                return Action(INPUT_GRAD, s.backwards), t
            return w_now
        mb = s.forwards if want == FORWARD else s.backwards
        ready, known = self._estimate(i, want, mb)
        if known and ready <= t:
            return Action(want, mb), t
        if self.take_ready and s.backwards:  # the other of F/B, if it is there now
            other = INPUT_GRAD if want == FORWARD else FORWARD
            if can_b if other == INPUT_GRAD else can_f:
                omb = s.backwards if other == INPUT_GRAD else s.forwards
                oready = self._ready(i, other, omb)
                if oready is not None and oready <= t:
                    return Action(other, omb), t
        gap = ready - t
        if owed_w:
            if gap >= self.cost[WEIGHT_GRAD, i] - 1e-12:
                return w_now  # the gap holds a whole W
            if known and s.idle + gap > max(x.idle for x in self.stages) + 1e-12:
                return w_now  # idling would make this the worst stage: fill it anyway
        return (Action(want, mb), ready) if known else None

    def _warmup_choice(self, i: int, t: float, can_f: bool, can_b: bool) -> str:
        """Before the first B: F's while memory allows and the first B has not arrived."""
        s = self.stages[i]
        if not (can_f and can_b):
            return FORWARD if can_f else INPUT_GRAD
        f_start = max(t, self._estimate(i, FORWARD, s.forwards)[0])
        b_start = max(t, self._estimate(i, INPUT_GRAD, 0)[0])
        if b_start <= f_start:
            return INPUT_GRAD
        fits = f_start + self.cost[FORWARD, i] <= b_start + 1e-12
        return FORWARD if fits or self.fill_warmup else INPUT_GRAD

    def _steady_choice(self, i: int, can_f: bool, can_b: bool, owed_w: bool) -> str:
        """After the first B: F and B alternate; W when memory leaves no room for the F."""
        s = self.stages[i]
        want = FORWARD if s.last == INPUT_GRAD else INPUT_GRAD
        if want == FORWARD and not can_f:
            if s.forwards < self.m and owed_w:
                return WEIGHT_GRAD  # memory limit hit: recycle a microbatch
            want = INPUT_GRAD
        elif want == INPUT_GRAD and not can_b:
            want = FORWARD
        return want

    def _may_skip_forward(self, i: int, t: float, can_b: bool, owed_w: bool) -> bool:
        """The second hyperparameter: stage i may skip an F while it is more than one F ahead of
        stage i+1 (which then still has an F to run), if it has other work now (no new bubble):
        a B that has arrived or an owed W."""
        if not self.skip_forward or i == self.pp - 1:
            return False
        if self.stages[i].forwards - self.stages[i + 1].forwards <= 1:
            return False
        b_ready = self._ready(i, INPUT_GRAD, self.stages[i].backwards) if can_b else None
        return owed_w or (b_ready is not None and b_ready <= t)

    def _fallback(self, live: list[int]):
        """Every stage waits on an input whose producer is not scheduled: the stage and known
        action that can start first (some always can: the schedule so far is deadlock-free)."""
        best = None
        for i in live:
            s, t = self.stages[i], self.stages[i].clock
            options = []
            if s.backwards < s.forwards:
                options.append(Action(INPUT_GRAD, s.backwards))
            if s.forwards < self.m and self._fits_forward(s):
                options.append(Action(FORWARD, s.forwards))
            if s.weights < s.backwards:
                options.append(Action(WEIGHT_GRAD, s.weights))
            for a in options:
                ready = self._ready(i, a.kind, a.microbatch)
                if ready is not None and (best is None or max(t, ready) < best[0]):
                    best = (max(t, ready), i, a)
        if best is None:
            raise ValueError("zb_auto: no stage can progress (memory limit too small?)")
        return best[1], best[2], best[0]

    def _commit(self, i: int, action: Action, start: float) -> None:
        s = self.stages[i]
        if s.actions and start > s.clock:
            s.idle += start - s.clock
        end = start + self.cost[action.kind, i]
        self.ends[action.kind, i, action.microbatch] = end
        if action.kind == FORWARD:
            self.starts[i, action.microbatch] = start
        s.clock = end
        s.actions.append(action)
        if action.kind == FORWARD:
            s.forwards += 1
        elif action.kind == INPUT_GRAD:
            s.backwards += 1
        else:
            s.weights += 1
        if action.kind != WEIGHT_GRAD:
            s.last = action.kind


def heuristic(
    pp: int,
    microbatches: int,
    limit: float,
    w_share: float = 1.0,
    costs: Costs | None = None,
    fill_warmup: bool = False,
    skip_forward: bool = False,
    take_ready: bool = False,
) -> Schedule:
    """The paper's heuristic alone (module docstring) for one setting of its hyperparameters:
    `limit` in units of M_B per rank, `w_share` = M_W / M_B, actions timed by `costs`."""
    costs = Costs() if costs is None else costs
    return _Planner(
        pp, microbatches, limit, w_share, costs, fill_warmup, skip_forward, take_ready
    ).run()


def _local_search(schedule, result, costs, place, limit, w_share, bound):
    """Refine by single W moves aimed at the bubbles (the paper refines its heuristic's
    schedule too, with an ILP): for each action that waited for its input, pull the next W of
    its rank in front of it (fills the wait), or push the W just before the producing action
    on the neighbouring rank behind it (the input comes sooner). A move is kept when the score
    improves, memory stays within `limit` and the makespan within `bound`; at most
    LOCAL_SEARCH_SIMULATIONS simulations. A moved list still runs: a W depends only on its own
    B, and it stays after it (and after older W's)."""
    score, budget = _score(result), LOCAL_SEARCH_SIMULATIONS
    improved = True
    while improved and budget > 0:
        improved = False
        for rank, moved in _moves(schedule, result, place.pp):
            if budget <= 0:
                break
            budget -= 1
            trial = {**schedule, rank: moved}
            tried = simulate(trial, costs, place)
            if (
                _score(tried) < score
                and max(peak_memory(tried, w_share)) <= limit + 1e-9
                and (bound is None or tried.makespan <= bound)
            ):
                schedule, result, score, improved = trial, tried, _score(tried), True
                break
    return schedule


def _moves(schedule: Schedule, result: SimResult, pp: int):
    """(rank, moved action list) for each wait in `result` (see _local_search)."""
    start = {(rank, a): t0 for rank, a, t0, _ in result.timeline}
    end = {(rank, a): t1 for rank, a, _, t1 in result.timeline}
    for rank, actions in schedule.items():
        for i in range(1, len(actions)):
            if start[rank, actions[i]] <= end[rank, actions[i - 1]] + 1e-9:
                continue  # no wait before actions[i]
            moved = _pull_w(actions, i)
            if moved is not None:
                yield rank, moved
            producer = rank - 1 if actions[i].kind == FORWARD else rank + 1
            if actions[i].kind != WEIGHT_GRAD and 0 <= producer < pp:
                moved = _push_w(schedule[producer], Action(actions[i].kind, actions[i].microbatch))
                if moved is not None:
                    yield producer, moved


def _pull_w(actions: list[Action], i: int) -> list[Action] | None:
    """`actions` with the first W after position i moved to position i, if its B is before."""
    for j in range(i + 1, len(actions)):
        if actions[j].kind == WEIGHT_GRAD:
            done = actions[:i]
            if Action(INPUT_GRAD, actions[j].microbatch) not in done:
                return None
            return done + [actions[j]] + actions[i:j] + actions[j + 1 :]
    return None


def _push_w(actions: list[Action], target: Action) -> list[Action] | None:
    """`actions` with the W just before `target` moved just after it, if there is one."""
    k = actions.index(target)
    if k == 0 or actions[k - 1].kind != WEIGHT_GRAD:
        return None
    return actions[: k - 1] + [target, actions[k - 1]] + actions[k + 1 :]
