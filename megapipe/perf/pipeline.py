"""The schedule's action lists timed with per-action costs: plan/simulate.py's semantics, compiled.

plan/simulate.py times a schedule by walking it (plan/walk.py: each rank runs its list in
order, an action starts when its rank is free and the events it needs have happened, a message
from another rank arriving `comm` after its producer ends). With the per-rank orders fixed,
the start times are a longest path through a DAG that does not depend on the costs. `Dag`
records that DAG once per schedule, by running the same walk with a callback that notes each
action's predecessors, and then times it for any costs in one pass over a flat list. Costs
may differ per global stage, per kind, per Seq1F1B segment, and per message (a transfer
between ranks on one node is cheaper than one across nodes): what the projection needs and
plan/simulate.Costs cannot say. tests/test_perf_model.py holds `Dag.run` equal to `simulate`
for every schedule when the costs are ones Costs can express.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megapipe.config import Config
from megapipe.config.stages import schedule_options
from megapipe.plan.actions import (
    FORWARD,
    FULL_BACKWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    Schedule,
)
from megapipe.plan.messages import sent
from megapipe.plan.schedules import build_schedule, placement
from megapipe.plan.simulate import Costs, action_cost
from megapipe.plan.walk import walk

KIND_INDEX = {FORWARD: 0, INPUT_GRAD: 1, WEIGHT_GRAD: 2, FULL_BACKWARD: 3}


@dataclass(frozen=True)
class Dag:
    """A schedule's actions in a topological order (the walk's), with what each waits for."""

    pp: int
    vpp: int
    segments: int
    rank: tuple[int, ...]
    stage: tuple[int, ...]
    kind: tuple[int, ...]  # KIND_INDEX
    chunk: tuple[int, ...]
    seg: tuple[int, ...]
    microbatch: tuple[int, ...]
    prev: tuple[int, ...]  # the previous action on the same rank, -1 for the first
    # (producer, message key) per action; message key -1: same rank, no transfer
    needs: tuple[tuple[tuple[int, int], ...], ...]
    messages: tuple[tuple[int, int, int, int], ...]  # key -> (src rank, dst rank, seg, grad)
    sends: tuple[int, ...]  # message key the action sends to another rank, -1 for none
    cost_index: tuple[int, ...]  # key(stage, kind, seg) of each action
    last_grad: dict[tuple[int, int], int]  # (rank, chunk) -> its last W or BW
    counts: tuple[dict[int, int], ...]  # per rank: {cost index: number of actions}

    @property
    def size(self) -> int:
        return len(self.rank)

    def key(self, stage: int, kind: int, seg: int) -> int:
        """Index of (stage, kind, segment) in a flat cost table."""
        return (stage * 4 + kind) * self.segments + seg


def compile_schedule(schedule, placement: Placement) -> Dag:
    """Walk `schedule` once and record its DAG."""
    segments = 1 + max((a.seg for acts in schedule.values() for a in acts), default=0)
    recorder = _DagRecorder(placement)
    walk(schedule, placement, recorder.record)
    return recorder.dag(segments)


class _DagRecorder:
    """The walk's callback for compile_schedule: each action as a node, in the order the walk
    runs them, with the nodes it waits for and the messages between ranks it needs and sends
    (numbered in the order they first appear)."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.last_stage = placement.num_stages - 1
        self.rank: list[int] = []
        self.stage: list[int] = []
        self.kind: list[int] = []
        self.chunk: list[int] = []
        self.seg: list[int] = []
        self.microbatch: list[int] = []
        self.prev: list[int] = []
        self.needs: list[tuple[tuple[int, int], ...]] = []
        self.sends: list[int] = []
        self.message_keys: dict[tuple[int, int, int, int], int] = {}
        self.last_on_rank: dict[int, int] = {}

    def message_key(self, src: int, dst: int, seg: int, grad: bool) -> int:
        """The key of the message (src rank, dst rank, segment, grad), new keys numbered 0, 1, …"""
        k = (src, dst, seg, int(grad))
        if k not in self.message_keys:
            self.message_keys[k] = len(self.message_keys)
        return self.message_keys[k]

    def record(self, rank: int, a: Action, stage: int, needs, finished) -> int:
        """plan/walk.py's `run`: action `a` as the next node, whose index its events record."""
        node = len(self.rank)
        deps = []
        for event in needs:
            producer = finished[event]
            src = self.rank[producer]
            msg = -1 if src == rank else self.message_key(src, rank, a.seg, event[0] == "G")
            deps.append((producer, msg))
        self.rank.append(rank)
        self.stage.append(stage)
        self.kind.append(KIND_INDEX[a.kind])
        self.chunk.append(a.chunk)
        self.seg.append(a.seg)
        self.microbatch.append(a.microbatch)
        self.prev.append(self.last_on_rank.get(rank, -1))  # -1 reads end[n] = 0 in run
        self.needs.append(tuple(deps))
        self.sends.append(self._send_key(rank, a, stage))
        self.last_on_rank[rank] = node
        return node

    def _send_key(self, rank: int, a: Action, stage: int) -> int:
        """The key of the message `a` sends to another rank when done, -1 for none."""
        out = sent(a, stage, self.last_stage)
        if out is None:
            return -1
        dst = self.placement.locate(out.dest_stage())[0]
        return -1 if dst == rank else self.message_key(rank, dst, a.seg, out.grad)

    def dag(self, segments: int) -> Dag:
        """The recorded walk as a Dag whose costs come in `segments` Seq1F1B segments."""
        pp = self.placement.pp
        cost_index = [
            (st * 4 + k) * segments + sg for st, k, sg in zip(self.stage, self.kind, self.seg)
        ]
        last_grad, counts = {}, tuple({} for _ in range(pp))
        for i, (r, c, k, ci) in enumerate(zip(self.rank, self.chunk, self.kind, cost_index)):
            if k in (KIND_INDEX[WEIGHT_GRAD], KIND_INDEX[FULL_BACKWARD]):
                last_grad[r, c] = i
            counts[r][ci] = counts[r].get(ci, 0) + 1
        return Dag(
            pp=pp,
            vpp=self.placement.vpp,
            segments=segments,
            rank=tuple(self.rank),
            stage=tuple(self.stage),
            kind=tuple(self.kind),
            chunk=tuple(self.chunk),
            seg=tuple(self.seg),
            microbatch=tuple(self.microbatch),
            prev=tuple(self.prev),
            needs=tuple(self.needs),
            messages=tuple(sorted(self.message_keys, key=self.message_keys.get)),
            sends=tuple(self.sends),
            cost_index=tuple(cost_index),
            last_grad=last_grad,
            counts=counts,
        )


@dataclass(frozen=True)
class ScheduleKey:
    """What a configured schedule's Dag depends on: the arguments config/stages.schedule_of
    passes to plan's build_schedule (the options as sorted pairs) and the placement's."""

    schedule: str
    pp: int
    microbatches: int
    vpp: int
    seq_segments: int
    options: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(cfg: Config) -> ScheduleKey:
        p = cfg.parallel
        options = tuple(sorted(schedule_options(cfg).items()))
        return ScheduleKey(p.schedule, p.pp, p.microbatches, p.vpp, p.seq_segments, options)

    def build(self) -> Schedule:
        """The schedule, as config/stages.schedule_of builds it."""
        return build_schedule(self.schedule, self.pp, self.microbatches, self.vpp,
                              self.seq_segments, **dict(self.options))  # fmt: skip


def config_dag(cfg: Config) -> Dag:
    """The Dag of the configured schedule (pp > 1), cached per ScheduleKey."""
    return schedule_dag(ScheduleKey.of(cfg))


@functools.lru_cache(maxsize=256)
def schedule_dag(key: ScheduleKey) -> Dag:
    """compile_schedule of the schedule `key` names, built from the key alone."""
    return compile_schedule(key.build(), placement(key.schedule, key.pp, key.vpp))


def simulate_costs(dag: Dag, costs: Costs, placement: Placement) -> tuple[list, list]:
    """(cost table, message delays) that time `dag` as plan/simulate.simulate(schedule, costs,
    placement) does, with equal Seq1F1B flop shares (simulate's default)."""
    table = [0.0] * (placement.num_stages * 4 * dag.segments)
    shares = [1.0 / dag.segments] * dag.segments
    for stage in range(placement.num_stages):
        chunk = placement.locate(stage)[1]
        for kind, k in KIND_INDEX.items():
            for seg in range(dag.segments):
                a = Action(kind, 0, chunk, seg if dag.segments > 1 else None)
                table[dag.key(stage, k, seg)] = action_cost(a, stage, costs, placement, shares)
    return table, [costs.comm] * len(dag.messages)


@dataclass
class Timing:
    """Start and end of every action of a Dag, and per-rank busy time."""

    start: list[float]
    end: list[float]
    makespan: float
    busy: list[float]  # per rank: the sum of its actions' costs (blocking sends left out)

    @property
    def bubble_fraction(self) -> float:
        """1 − Σ busy / (pp · makespan), as plan/simulate.SimResult.bubble_fraction."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def run(
    dag: Dag, cost: list[float], delay: list[float], extra: list[float] | None = None
) -> Timing:
    """Time `dag`: action i costs cost[dag.key(stage, kind, seg)] (+ extra[message it sends],
    which its rank spends sending: blocking p2p); a message with key k arrives delay[k] after
    its producer ends."""
    n = dag.size
    end = [0.0] * (n + 1)  # end[n] = 0: the "previous action" of each rank's first
    start = [0.0] * n
    busy = [0.0] * dag.pp
    wait = list(delay) + [0.0]  # key -1: a same-rank event, no transfer
    send = (list(extra) if extra is not None else [0.0] * len(delay)) + [0.0]
    for i, (p, needs, k, r, s) in enumerate(
        zip(dag.prev, dag.needs, dag.cost_index, dag.rank, dag.sends)
    ):
        t = end[p]
        for producer, msg in needs:
            arrive = end[producer] + wait[msg]
            if arrive > t:
                t = arrive
        c = cost[k]
        busy[r] += c
        start[i] = t
        end[i] = t + c + send[s]
    end.pop()
    return Timing(start, end, max(end, default=0.0), busy)
