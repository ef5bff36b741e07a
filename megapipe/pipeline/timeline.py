"""Measured pipeline timelines: spans from every rank, Chrome traces, profiled costs, bubbles.

The runtime records each action's span on its rank (`PipelineRuntime.events`: perf_counter
seconds and the part spent waiting for the input). Here the spans of all ranks become

- a timeline in the simulator's format, (rank, action, start, end), so that a measured step
  and its simulation (plan/simulate.py) are drawn side by side by plot.py;
- a Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev): "X" events, pid = rank;
- per-action costs for `simulate.Costs`, and the measured makespan and bubble fraction;
- where two consecutive steps meet (`step_boundary`): whether the next step began on one rank
  before the last one ended on another, which post-validation allows.

A span's compute part is [t0 + wait, t1]: the input receive is waited for first, and posting
the sends afterwards counts as busy. perf_counter is CLOCK_MONOTONIC on Linux, one clock for
all processes of a host, so spans of ranks on one machine line up; across hosts they do not.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch.distributed as dist

from megapipe.plan.actions import KINDS, Action
from megapipe.plan.simulate import Costs

Span = tuple[str, float, float, float]  # (action text, t0, t1, wait): picklable, JSON-able
Timeline = list[tuple[int, Action, float, float]]  # (rank, action, start, end), as simulate's


def spans(events) -> list[Span]:
    """This rank's runtime events as plain tuples."""
    return [(str(e.action), e.t0, e.t1, e.wait) for e in events]


def gather_spans(events, group=None) -> list[list[Span]]:
    """Every rank's spans of the last step, on every rank (one all_gather_object over `group`)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, spans(events), group=group)
    return out


def to_timeline(per_rank: list[list[Span]]) -> Timeline:
    """Compute spans in seconds from the step's first start (the waits are left out)."""
    origin = min(t0 for rank in per_rank for _, t0, _, _ in rank)
    return [
        (r, Action.parse(text), t0 + wait - origin, t1 - origin)
        for r, rank in enumerate(per_rank)
        for text, t0, t1, wait in rank
    ]


def ran(per_rank: list[list[Span]]) -> dict[int, list[Action]]:
    """The schedule that produced the spans: each rank's actions in the order they ran."""
    return {rank: [Action.parse(span[0]) for span in spans] for rank, spans in enumerate(per_rank)}


def measured(per_rank: list[list[Span]]) -> dict:
    """Makespan (first start to last end), busy and idle seconds per rank, bubble fraction."""
    makespan = max(t1 for rank in per_rank for _, _, t1, _ in rank) - min(
        t0 for rank in per_rank for _, t0, _, _ in rank
    )
    busy = [sum(t1 - t0 - wait for _, t0, t1, wait in rank) for rank in per_rank]
    return {
        "makespan": makespan,
        "busy": busy,
        "idle": [makespan - b for b in busy],
        "bubble_fraction": 1.0 - sum(busy) / (len(per_rank) * makespan),
    }


def step_boundary(before: list[list[Span]], after: list[list[Span]]) -> dict:
    """Where two consecutive steps meet, from every rank's spans of both (one host's clock):
    per rank the end of its last action of `before` and the start of its first of `after`,
    and `overlap`: the last rank's end of `before` minus the first rank's start of `after`.
    With a synchronisation before the optimizer every rank starts `after` only once every rank
    ended `before`, so overlap < 0; post-validation (Zero Bubble §4) lets a rank that ended
    early start the next step's warm-up while another still runs its cool-down: overlap > 0."""
    ends = [max(t1 for _, _, t1, _ in rank) for rank in before]
    starts = [min(t0 for _, t0, _, _ in rank) for rank in after]
    return {"ends": ends, "starts": starts, "overlap": max(ends) - min(starts)}


def profile_costs(steps: list[list[list[Span]]], vpp: int) -> Costs:
    """Mean compute seconds per (kind, local chunk) over all ranks and `steps` (each a per-rank
    span list) as simulate.Costs with one value per chunk. Means, not medians: a makespan is a
    sum of costs. Kinds the schedule does not run keep the default (and are not used)."""
    seconds = defaultdict(list)
    for per_rank in steps:
        for rank in per_rank:
            for text, t0, t1, wait in rank:
                a = Action.parse(text)
                seconds[a.kind, a.chunk].append(t1 - t0 - wait)
    values = {}
    for kind in KINDS:
        if all((kind, c) in seconds for c in range(vpp)):
            values[kind] = tuple(statistics.fmean(seconds[kind, c]) for c in range(vpp))
    return Costs(**values)


def agreed_costs(events, mesh, vpp: int) -> Costs:
    """`profile_costs` of this step over the pp group, the same on every rank of the mesh: the
    spans are gathered over pp, then the first replica's costs are broadcast along dp, cp and tp
    (each rank must build the same schedule: dp buckets reduce in its chunk order)."""
    costs = [profile_costs([gather_spans(events, mesh.group("pp"))], vpp)]
    for axis in ("dp", "cp", "tp"):
        if mesh.size(axis) > 1:
            dist.broadcast_object_list(costs, group=mesh.group(axis), group_src=0)
    return costs[0]


def chrome_trace(per_rank: list[list[Span]], name: str = "", meta: dict | None = None) -> dict:
    """A Chrome trace: one "X" event per action (ts/dur in µs from the step's start) named by
    its action text (F3.c1), pid = rank; the wait for the input is a separate "wait" event.
    `meta` (e.g. the schedule) goes to "otherData", which trace viewers show and ignore."""
    origin = min(t0 for rank in per_rank for _, t0, _, _ in rank)
    events = []
    for r, rank in enumerate(per_rank):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": r,
                "tid": 0,
                "args": {"name": f"{name} rank {r}".strip()},
            }
        )
        for text, t0, t1, wait in rank:
            start = (t0 - origin) * 1e6
            if wait > 0:
                events.append(
                    {
                        "name": "wait",
                        "cat": "wait",
                        "ph": "X",
                        "pid": r,
                        "tid": 0,
                        "ts": start,
                        "dur": wait * 1e6,
                        "args": {"action": text},
                    }
                )
            events.append(
                {
                    "name": text,
                    "cat": Action.parse(text).kind,
                    "ph": "X",
                    "pid": r,
                    "tid": 0,
                    "ts": start + wait * 1e6,
                    "dur": (t1 - t0 - wait) * 1e6,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}


def spans_from_trace(trace: dict) -> list[list[Span]]:
    """Inverse of `chrome_trace` (seconds from the step's start): redraw a saved trace."""
    per_rank: dict[int, list[Span]] = defaultdict(list)
    waits = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "wait":
            waits[e["pid"], e["args"]["action"]] = e["dur"] / 1e6
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] != "wait":
            wait = waits.get((e["pid"], e["name"]), 0.0)
            t1 = (e["ts"] + e["dur"]) / 1e6
            per_rank[e["pid"]].append((e["name"], e["ts"] / 1e6 - wait, t1, wait))
    return [sorted(per_rank[r], key=lambda s: s[1]) for r in sorted(per_rank)]
