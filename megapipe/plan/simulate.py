"""Simulation of a pipeline schedule: the planner's cost model.

The schedule is compiled into dag.py's DAG (walk.py's semantics: each rank runs its list in
order, sends are asynchronous, an action starts when its rank is free and its inputs have
arrived, producer end + ``comm`` when the producer is another rank) and timed there with costs
from `Costs`: the one timing engine, which the performance model (perf/model.py) prices too.

Units
- Costs ``F``, ``B``, ``W`` (and ``BW``, default B+W) are for one microbatch through one rank's
  whole share of layers; a chunk action costs 1/v of it (or give one value per chunk), a Seq1F1B
  segment costs its FLOPs share. ``first_stage``/``last_stage`` add the embedding / LM head + loss
  cost to the F and to the input-grad backward (B or BW) of global stage 0 / the last stage.
- Activation memory (``peak_inflight``) is in "one microbatch's activations for one full rank
  share": a chunk counts 1/v, a segment its token fraction. A unit is live from the start of its F
  to the end of its W (B/W split; the Zero Bubble paper also keeps activations until W, §3.1) or
  of its BW.

The paper's bubble rate (Qi et al. 2023, §5 and Table 5) is measured per stage, not from time 0:
``cost`` is the longest execution span of any rank (its first action's start to its last
action's end, ``SimResult.span``) and the rate is (cost − ideal) / cost with ideal the work of
one stage, m·(T_F+T_B+T_W); with unequal stages the busiest rank's work stands for it
(``SimResult.bubble_rate_paper``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megapipe.plan.actions import (
    FORWARD,
    FULL_BACKWARD,
    INPUT_GRAD,
    KINDS,
    WEIGHT_GRAD,
    Action,
    Placement,
    Schedule,
)
from megapipe.plan.dag import Dag, compile_schedule, run

Cost = float | tuple[float, ...]


@dataclass(frozen=True)
class Costs:
    """Per-action costs (see module docstring for units)."""

    F: Cost = 1.0
    B: Cost = 1.0
    W: Cost = 1.0
    BW: Cost | None = None  # full backward; None means B + W
    # DualPipe's F&B (DeepSeek-V3 Table 2): an overlapped forward + full backward pair;
    # None: F + BW, nothing hidden (megapipe's runtime runs a pair's two computes in turn)
    FB: float | None = None
    comm: float = 0.0  # p2p latency between different ranks
    first_stage: float = 0.0  # embedding, added to F and B/BW of stage 0
    last_stage: float = 0.0  # LM head + loss, added to F and B/BW of the last stage

    def base(self, kind: str, chunk: int, vpp: int) -> float:
        if kind == FULL_BACKWARD and self.BW is None:
            return self.base(INPUT_GRAD, chunk, vpp) + self.base(WEIGHT_GRAD, chunk, vpp)
        value = {FORWARD: self.F, INPUT_GRAD: self.B, WEIGHT_GRAD: self.W, FULL_BACKWARD: self.BW}[
            kind
        ]
        if isinstance(value, tuple):
            return float(value[chunk])
        return float(value) / vpp

    @staticmethod
    def parse(text: str) -> Costs:
        """``"F=1,B=1.2,W=0.8,comm=0.1"`` -> Costs (keys: F, B, W, BW, FB, comm, first, last)."""
        names = {
            "F": "F",
            "B": "B",
            "W": "W",
            "BW": "BW",
            "FB": "FB",
            "comm": "comm",
            "first": "first_stage",
            "last": "last_stage",
        }
        values = {}
        for item in filter(None, text.split(",")):
            key, _, raw = item.partition("=")
            if key.strip() not in names:
                raise ValueError(f"unknown cost key {key!r}: use {', '.join(names)}")
            values[names[key.strip()]] = float(raw)
        return Costs(**values)


@dataclass
class SimResult:
    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float  # 1 - sum(busy) / (pp * makespan)
    peak_inflight: list[float]
    timeline: list[tuple[int, Action, float, float]] = field(repr=False)
    span: list[float] = field(default_factory=list)  # per rank: last end - first start

    @property
    def bubble_rate_paper(self) -> float:
        """Zero Bubble's rate: (longest span − busiest rank's work) / longest span."""
        cost = max(self.span, default=0.0)
        return (cost - max(self.busy, default=0.0)) / cost if cost else 0.0


def _segment_shares(k: int, shares: list[float] | None) -> list[float]:
    """Per Seq1F1B segment of `k`: the given shares, or equal ones."""
    shares = list(shares) if shares is not None else [1.0 / k] * k
    if len(shares) != k:
        raise ValueError(f"{len(shares)} segment shares given for {k} segments")
    return shares


def action_cost(
    action: Action, stage: int, costs: Costs, placement: Placement, flop_shares: list[float]
) -> float:
    cost = costs.base(action.kind, action.chunk, placement.passes)
    if action.kind in (FORWARD, INPUT_GRAD, FULL_BACKWARD):
        cost += costs.first_stage * (stage == 0)
        cost += costs.last_stage * (stage == placement.num_stages - 1)
    return cost * flop_shares[action.seg]


def cost_table(
    dag: Dag, costs: Costs, placement: Placement, flop_shares: list[float] | None = None
) -> tuple[list[float], list[float]]:
    """(cost table, message delays) that time `dag` (dag.run) with `costs`: each (stage, kind,
    segment) its `action_cost`, flop shares per Seq1F1B segment (default: equal), every message
    `costs.comm`."""
    shares = _segment_shares(dag.segments, flop_shares)
    table = [0.0] * (placement.num_stages * 4 * dag.segments)
    for index in set(dag.cost_index):
        stage, kind, seg = dag.unkey(index)
        a = Action(KINDS[kind], 0, placement.locate(stage)[1], seg if dag.segments > 1 else None)
        table[index] = action_cost(a, stage, costs, placement, shares)
    return table, [costs.comm] * len(dag.messages)


def pair_saving(dag: Dag, costs: Costs, placement: Placement) -> dict[int, float]:
    """Per F&B pair's backward node: F + BW − F&B of its chunks (DeepSeek-V3 §3.2.1), the time
    overlapping the pair hides; empty without pairs or without `costs.FB`."""
    if costs.FB is None or not dag.paired:
        return {}
    v = placement.passes
    saving = {}
    for b, f in dag.paired:
        apart = costs.base(FORWARD, dag.chunk[f], v) + costs.base(
            dag.actions[b].kind, dag.chunk[b], v
        )
        saving[b] = max(0.0, apart - costs.FB / v)
    return saving


def simulate(
    schedule: Schedule | Dag,
    costs: Costs,
    placement: Placement,
    flop_shares: list[float] | None = None,
    token_shares: list[float] | None = None,
    chunk_shares: dict[int, list[float]] | None = None,
    start: dict[int, float] | None = None,
) -> SimResult:
    """Simulate ``schedule`` (or its Dag, compiled once by dag.compile_schedule); flop and
    token shares are per Seq1F1B segment (default: equal), `chunk_shares[rank][c]` the part of
    a rank's activations its chunk c holds for one microbatch (default 1/vpp each; unequal when
    chunks hold different numbers of layers); `start[rank]`: when the rank may begin (default
    0; multi_iteration chains steps)."""
    dag = schedule if isinstance(schedule, Dag) else compile_schedule(schedule, placement)
    token_shares = _segment_shares(dag.segments, token_shares)
    table, delay = cost_table(dag, costs, placement, flop_shares)
    begin = [(start or {}).get(rank, 0.0) for rank in range(dag.pp)]
    timing = run(dag, table, delay, start=begin, saving=pair_saving(dag, costs, placement))
    timeline = list(zip(dag.rank, dag.actions, timing.start, timing.end))
    share = 1.0 / placement.passes
    shares = chunk_shares or {r: [share] * placement.vpp for r in range(dag.pp)}
    return _summarise(dag.pp, timeline, token_shares, shares)


def _summarise(pp, timeline, token_shares, chunk_shares) -> SimResult:
    """SimResult of a timeline [(rank, action, start, end)] in the walk's order."""
    makespan = max((end for *_, end in timeline), default=0.0)
    busy = [0.0] * pp
    first, last = [float("inf")] * pp, [float("-inf")] * pp
    deltas: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    for rank, a, start, end in timeline:
        busy[rank] += end - start
        first[rank], last[rank] = min(first[rank], start), max(last[rank], end)
        size = token_shares[a.seg] * chunk_shares[rank][a.chunk]
        if a.kind == FORWARD:
            deltas[rank].append((start, size))
        elif a.kind in (WEIGHT_GRAD, FULL_BACKWARD):
            deltas[rank].append((end, -size))
    peaks = []
    for events in deltas:
        live = peak = 0.0
        for _, delta in sorted(events):  # frees sort before allocations at equal times
            live += delta
            peak = max(peak, live)
        peaks.append(round(peak, 9))
    idle = [makespan - b for b in busy]
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan else 0.0
    timeline.sort(key=lambda item: (item[2], item[0]))
    span = [max(0.0, b - a) for a, b in zip(first, last)]
    return SimResult(makespan, busy, idle, bubble, peaks, timeline, span)


@dataclass
class Iterations:
    """K steps simulated back to back (`multi_iteration`)."""

    ends: list[float]  # per step: its last action's end on any rank
    starts: list[dict[int, float]]  # per step: when each rank may begin it
    steps: list[SimResult] = field(repr=False)

    @property
    def steady_step(self) -> float:
        """The step time once the pipeline of steps is steady: the mean over the second half
        (the first steps still start from an idle pipeline)."""
        k = len(self.ends)
        h = max(k // 2, 1)
        if k < 2:
            return self.ends[0] if self.ends else 0.0
        return (self.ends[-1] - self.ends[-1 - h]) / h


def multi_iteration(
    schedule: Schedule,
    costs: Costs,
    placement: Placement,
    iterations: int,
    post_validation: bool,
    optimizer: float = 0.0,
    sync: float = 0.0,
) -> Iterations:
    """`iterations` steps of `schedule` back to back, with `optimizer` the cost of a rank's
    optimizer step and `sync` that of the global grad-norm / NaN reduction before it.

    - Synchronous: every rank waits, after its last action, for the reduction over all
      ranks (it ends `sync` after the last rank's last action), steps, and only then starts
      the next step: the steps meet at a barrier.
    - Post-validation (Qi et al. 2023 §4): rank r steps once its own actions are done and the
      partial state of rank r−1 has arrived (the chain 0 → p−1, `costs.comm` a hop), then
      starts the next step at once; the global state leaves the last rank when it has it and
      is only waited for at the end of the next step (the validation).
    With one rank there is nothing to reduce over the pipeline: both give the same time.
    """
    ranks = sorted(schedule)
    start = {r: 0.0 for r in ranks}
    steps, starts, ends = [], [], []
    validation: dict[int, float] = {}  # when the previous step's global state reaches a rank
    dag = compile_schedule(schedule, placement)
    for _ in range(iterations):
        result = simulate(dag, costs, placement, start=start)
        last = dict(start)
        for q, _, _, end in result.timeline:
            last[q] = max(last[q], end)
        done = {r: max(last[r], validation.get(r, 0.0)) for r in ranks}
        steps.append(result)
        starts.append(start)
        ends.append(max(done.values()))
        start, validation = _next_starts(ranks, done, costs.comm, post_validation, optimizer, sync)
    return Iterations(ends, starts, steps)


def _next_starts(ranks, done, comm, post_validation, optimizer, sync):
    """Each rank's start of the next step and the arrival of this step's global state."""
    if len(ranks) == 1 or not post_validation:
        barrier = max(done.values()) + (sync if len(ranks) > 1 else 0.0)
        return {r: barrier + optimizer for r in ranks}, {}
    ready, prev = {}, None
    for r in ranks:  # the partial state travels 0 → p−1, one hop per stage
        ready[r] = done[r] if prev is None else max(done[r], ready[prev] + comm)
        prev = r
    sent = ready[ranks[-1]]
    validation = {r: sent + (comm if r != ranks[-1] else 0.0) for r in ranks}
    return {r: ready[r] + optimizer for r in ranks}, validation
