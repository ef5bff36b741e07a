"""The one timing engine: a schedule's action lists compiled once into a DAG, timed for any costs.

Semantics are walk.py's (shared with validate.py): each rank runs its list in order, sends are
asynchronous, an action starts when its rank is free and the events it needs have happened, a
message from another rank arriving its delay after its producer ends. With the per-rank orders
fixed, the start times are a longest path through a DAG that does not depend on the costs (nor
on the order in which the walk visits ranks). `compile_schedule` records that DAG once, by
running the walk with a callback that notes each action's predecessors; `run` times it in one
pass over flat lists for costs that may differ per global stage, per kind, per Seq1F1B segment
and per message. simulate.py times it for its `Costs` (the planner, the dry run, the schedule
CLI), perf/model.py for projected ones (a transfer on one node is cheaper than one across).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megapipe.plan.actions import FULL_BACKWARD, KINDS, WEIGHT_GRAD, Action, Placement, Schedule
from megapipe.plan.messages import sent
from megapipe.plan.walk import walk

KIND_INDEX = {kind: index for index, kind in enumerate(KINDS)}  # F 0, B 1, W 2, BW 3
_GRADS = (KIND_INDEX[WEIGHT_GRAD], KIND_INDEX[FULL_BACKWARD])


@dataclass(frozen=True)
class Dag:
    """A schedule's actions in a topological order (the walk's), with what each waits for."""

    pp: int
    vpp: int
    segments: int
    actions: tuple[Action, ...]
    rank: tuple[int, ...]
    stage: tuple[int, ...]
    kind: tuple[int, ...]  # KIND_INDEX
    chunk: tuple[int, ...]
    seg: tuple[int, ...]
    microbatch: tuple[int, ...]
    # the previous action on the same rank; -1 − rank for a rank's first (run reads its start)
    prev: tuple[int, ...]
    # (producer, message key) per action; message key -1: same rank, no transfer
    needs: tuple[tuple[tuple[int, int], ...], ...]
    messages: tuple[tuple[int, int, int, int], ...]  # key -> (src rank, dst rank, seg, grad)
    sends: tuple[int, ...]  # message key the action sends to another rank, -1 for none
    cost_index: tuple[int, ...]  # key(stage, kind, seg) of each action
    # DualPipe F&B pairs (Action.pair): (backward's node index, its forward's index)
    paired: tuple[tuple[int, int], ...] = ()

    @property
    def size(self) -> int:
        return len(self.rank)

    @cached_property
    def last_grad(self) -> dict[tuple[int, int], int]:
        """(rank, chunk) -> index of its last W or BW."""
        last = {}
        for i, (r, c, k) in enumerate(zip(self.rank, self.chunk, self.kind)):
            if k in _GRADS:
                last[r, c] = i
        return last

    @cached_property
    def counts(self) -> tuple[dict[int, int], ...]:
        """Per rank: {cost index: number of its actions with that index}."""
        counts = tuple({} for _ in range(self.pp))
        for r, ci in zip(self.rank, self.cost_index):
            counts[r][ci] = counts[r].get(ci, 0) + 1
        return counts

    def key(self, stage: int, kind: int, seg: int) -> int:
        """Index of (stage, kind, segment) in a flat cost table."""
        return (stage * 4 + kind) * self.segments + seg

    def unkey(self, index: int) -> tuple[int, int, int]:
        """(stage, kind, segment) of a cost table index."""
        stage, rest = divmod(index, 4 * self.segments)
        return (stage, *divmod(rest, self.segments))


def compile_schedule(schedule: Schedule, placement: Placement) -> Dag:
    """Walk `schedule` once and record its DAG (walk.ScheduleError on a deadlock)."""
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
        self.actions: list[Action] = []
        self.rank: list[int] = []
        self.stage: list[int] = []
        self.prev: list[int] = []
        self.needs: list[tuple[tuple[int, int], ...]] = []
        self.sends: list[int] = []
        self.message_keys: dict[tuple[int, int, int, int], int] = {}
        # (kind, segment, stage, chunk): a stage and chunk have one rank (DualPipe: two copies)
        self.send_keys: dict[tuple[str, int | None, int, int], int] = {}
        self.last_on_rank: dict[int, int] = {}
        self.paired: dict[int, int] = {}

    def message_key(self, src: int, dst: int, seg: int, grad: bool) -> int:
        """The key of the message (src rank, dst rank, segment, grad), new keys numbered 0, 1, …"""
        keys = self.message_keys
        return keys.setdefault((src, dst, seg, int(grad)), len(keys))

    def record(self, rank: int, a: Action, stage: int, needs, finished) -> int:
        """walk.py's `run`: action `a` as the next node, whose index its events record."""
        node, seg, ranks, keys = len(self.rank), a.seg, self.rank, self.message_keys
        deps = []
        for event in needs:
            producer = finished[event]
            src = ranks[producer]
            if src == rank:
                deps.append((producer, -1))
            else:  # message_key, inlined: this runs for every action of every simulation
                msg = keys.setdefault((src, rank, seg, int(event[0] == "G")), len(keys))
                deps.append((producer, msg))
        prev = self.last_on_rank.get(rank, -1 - rank)
        if prev >= 0 and self.actions[prev].pair:
            self.paired[node] = prev
        self.actions.append(a)
        ranks.append(rank)
        self.stage.append(stage)
        self.prev.append(prev)
        self.needs.append(tuple(deps))
        send = self.send_keys.get((a.kind, a.segment, stage, a.chunk))
        if send is None:  # what a (kind, segment) sends from a stage is the same each time
            send = self.send_keys[a.kind, a.segment, stage, a.chunk] = self._send_key(
                rank, a, stage
            )
        self.sends.append(send)
        self.last_on_rank[rank] = node
        return node

    def _send_key(self, rank: int, a: Action, stage: int) -> int:
        """The key of the message `a` sends to another rank when done, -1 for none."""
        out = sent(a, stage, self.last_stage)
        if out is None:
            return -1
        dst = self.placement.locate(out.dest_stage(), a.microbatch)[0]
        return -1 if dst == rank else self.message_key(rank, dst, a.seg, out.grad)

    def dag(self, segments: int) -> Dag:
        """The recorded walk as a Dag whose costs come in `segments` Seq1F1B segments."""
        kind = [KIND_INDEX[a.kind] for a in self.actions]
        seg = [a.seg for a in self.actions]
        cost_index = [(st * 4 + k) * segments + sg for st, k, sg in zip(self.stage, kind, seg)]
        return Dag(
            pp=self.placement.pp,
            vpp=self.placement.vpp,
            segments=segments,
            actions=tuple(self.actions),
            rank=tuple(self.rank),
            stage=tuple(self.stage),
            kind=tuple(kind),
            chunk=tuple(a.chunk for a in self.actions),
            seg=tuple(seg),
            microbatch=tuple(a.microbatch for a in self.actions),
            prev=tuple(self.prev),
            needs=tuple(self.needs),
            messages=tuple(sorted(self.message_keys, key=self.message_keys.get)),
            sends=tuple(self.sends),
            cost_index=tuple(cost_index),
            paired=tuple(self.paired.items()),
        )


@dataclass
class Timing:
    """Start and end of every action of a Dag, and per-rank busy time."""

    start: list[float]
    end: list[float]
    makespan: float
    busy: list[float]  # per rank: the sum of its actions' costs (blocking sends left out)

    @property
    def bubble_fraction(self) -> float:
        """1 − Σ busy / (pp · makespan): the part of the ranks' time spent idle."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def run(
    dag: Dag,
    cost: list[float],
    delay: list[float],
    extra: list[float] | None = None,
    start: list[float] | None = None,
    saving: dict[int, float] | None = None,
) -> Timing:
    """Time `dag`: action i costs cost[dag.key(stage, kind, seg)] (+ extra[message it sends],
    which its rank spends sending: blocking p2p) − saving[i] (the part of a DualPipe F&B pair
    that overlapping hides, taken off its backward); a message with key k arrives delay[k]
    after its producer ends; rank r may begin at start[r] (default 0)."""
    n = dag.size
    # end[-1 − r] = start[r]: the "previous action" of rank r's first
    end = [0.0] * n + (list(reversed(start)) if start is not None else [0.0] * dag.pp)
    begin = [0.0] * n
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
        c = cost[k] - saving.get(i, 0.0) if saving else cost[k]
        busy[r] += c
        begin[i] = t
        end[i] = t + c + send[s]
    del end[n:]
    return Timing(begin, end, max(end, default=0.0), busy)
