"""Print, simulate, compare and plot pipeline schedules.

    python tools/schedule.py --schedule zb_h1 --pp 4 --microbatches 8
    python tools/schedule.py --schedule interleaved_1f1b --pp 4 --microbatches 8 --vpp 2 --json
    python tools/schedule.py --compare 1f1b,zb_h1,zb_v --pp 4 --microbatches 8 --plot cmp.png
    python tools/schedule.py --schedule zb_v --pp 4 --microbatches 8 --to-csv zbv.csv
    python tools/schedule.py --schedule zb_auto --pp 8 --microbatches 24 --zb-memory 2p \
        --zb-w-share 0.366 --cost F=18.522,B=18.086,W=9.337,comm=0.601 --json
    python tools/schedule.py --from-csv zbv.csv --placement v --json
    python tools/schedule.py --compare 1f1b,zb_h2 --pp 4 --microbatches 8 --iterations 8 \
        --optimizer-cost 0.5 --sync-cost 0.2

CSV format (one row per action, header required): ``rank,index,kind,microbatch,chunk,segment,
version`` where index is the action's position in its rank's list, kind is F, B, W or BW,
segment and version are empty when unused. pp is the largest rank + 1, vpp the largest chunk + 1;
``--placement`` (loop or v) says which global stage a chunk holds.

zb_v and zb_auto are built for the ``--cost`` given, as training builds them for measured costs;
zb_auto under ``--zb-memory`` (1p, 2p or N microbatches per rank) with ``--zb-w-share`` the part
of a microbatch's activations kept from B to W (the Zero Bubble paper's M_W / M_B; 1 counts a
microbatch whole until its W). ``--json`` gives per rank ``span`` (last end minus first start)
and ``peak_memory`` (microbatches' activations, what B to W keeps weighing ``--zb-w-share``),
and ``bubble_rate_paper``, the paper's (longest span − busiest rank's work) / longest span.

``--iterations K`` simulates K steps back to back (plan/simulate.multi_iteration) twice: with
the synchronisation before the optimizer (every rank waits for the global grad-norm / NaN
reduction, ``--sync-cost``, after the last rank's last action) and with Zero Bubble's
post-validation (§4: each rank steps after its own last action and its predecessor's partial
state, and starts the next step at once), each step ``--optimizer-cost`` long, and prints the
steady-state step time of both (JSON: ``multi_iteration``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from megapipe.pipeline.plot import save_timelines
from megapipe.plan.actions import Action, Placement, Schedule, format_grid
from megapipe.plan.schedules import SCHEDULES, build_schedule, placement
from megapipe.plan.simulate import Costs, SimResult, multi_iteration, simulate
from megapipe.plan.validate import validate
from megapipe.plan.zb_auto import peak_memory

CSV_COLUMNS = ["rank", "index", "kind", "microbatch", "chunk", "segment", "version", "pair"]


def write_csv(schedule: Schedule, path: str) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for rank in sorted(schedule):
            for index, a in enumerate(schedule[rank]):
                writer.writerow(
                    [
                        rank,
                        index,
                        a.kind,
                        a.microbatch,
                        a.chunk,
                        "" if a.segment is None else a.segment,
                        "" if a.version is None else a.version,
                        int(a.pair),  # DualPipe F&B pair with the next action
                    ]
                )


def read_csv(path: str) -> Schedule:
    rows: dict[int, list[tuple[int, Action]]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            missing = [c for c in CSV_COLUMNS[:5] if not row.get(c)]
            if missing:
                raise ValueError(f"{path}: row {row} lacks column(s) {', '.join(missing)}")
            action = Action(
                row["kind"],
                int(row["microbatch"]),
                int(row["chunk"]),
                int(row["segment"]) if row.get("segment") else None,
                int(row["version"]) if row.get("version") else None,
                row.get("pair") == "1",
            )
            rows.setdefault(int(row["rank"]), []).append((int(row["index"]), action))
    return {rank: [a for _, a in sorted(items)] for rank, items in sorted(rows.items())}


def shape_for(name: str, vpp: int, seq_segments: int) -> tuple[int, int]:
    """(vpp, seq_segments) that ``name`` accepts, so --compare can mix schedules."""
    least, most = SCHEDULES[name].chunks
    if least == most > 1:  # exactly two chunks: zb_v, v_half, v_min, dualpipe_v, dualpipe
        return least, 1
    if name == "interleaved_1f1b":
        return max(vpp, 2), 1
    return 1, seq_segments if name == "seq1f1b" else 1


def summary(result: SimResult, w_share: float = 1.0) -> dict:
    return {
        "makespan": round(result.makespan, 6),
        "bubble_fraction": round(result.bubble_fraction, 6),
        "idle": [round(x, 6) for x in result.idle],
        "peak_inflight_microbatches": [round(x, 6) for x in result.peak_inflight],
        "peak_memory": peak_memory(result, w_share),  # units of M_B, B to W weighs w_share
        "span": [round(x, 6) for x in result.span],
        "bubble_rate_paper": round(result.bubble_rate_paper, 6),
    }


def run_named(name: str, args, costs: Costs) -> tuple[Schedule, SimResult, Placement]:
    vpp, k = (
        shape_for(name, args.vpp, args.seq_segments)
        if args.compare
        else (args.vpp, args.seq_segments)
    )
    spec = SCHEDULES[name]
    opts = {"costs": costs} if spec.built_for_costs else {}  # as the runtime builds them
    if "memory" in spec.options:
        opts |= {"memory": args.zb_memory, "w_share": args.zb_w_share}
    schedule = build_schedule(name, args.pp, args.microbatches, vpp, k, **opts)
    where = placement(name, args.pp, vpp)
    validate(schedule, args.pp, args.microbatches, vpp, k, where)
    return schedule, simulate(schedule, costs, where), where


def iterations_summary(
    schedule: Schedule, costs: Costs, where: Placement, args
) -> dict[str, float] | None:
    """Steady-state step time of K back-to-back steps, synchronous and post-validated."""
    if not args.iterations:
        return None
    one = {
        mode: multi_iteration(
            schedule, costs, where, args.iterations, mode, args.optimizer_cost, args.sync_cost
        ).steady_step
        for mode in (False, True)
    }
    return {
        "iterations": args.iterations,
        "optimizer_cost": args.optimizer_cost,
        "sync_cost": args.sync_cost,
        "sync_step": round(one[False], 6),
        "post_validation_step": round(one[True], 6),
        "gain": round(1.0 - one[True] / one[False], 6) if one[False] else 0.0,
    }


def iterations_table(rows: list[tuple[str, dict]]) -> str:
    lines = [
        "| schedule | steady step, sync | steady step, post-validation | gain |",
        "|---|---:|---:|---:|",
    ]
    for name, it in rows:
        lines.append(
            f"| {name} | {it['sync_step']:.3f} | {it['post_validation_step']:.3f} | "
            f"{it['gain']:.1%} |"
        )
    return "\n".join(lines)


def compare_table(rows: list[tuple[str, SimResult]]) -> str:
    lines = [
        "| schedule | makespan | bubble | bubble (paper) | peak in-flight (max) | idle per rank |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, r in rows:
        idle = " ".join(f"{x:g}" for x in (round(i, 3) for i in r.idle))
        lines.append(
            f"| {name} | {r.makespan:.3f} | {r.bubble_fraction:.4f} | {r.bubble_rate_paper:.4f} | "
            f"{max(r.peak_inflight):g} | {idle} |"
        )
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--schedule", choices=sorted(SCHEDULES))
    what.add_argument("--compare", help="comma-separated schedule names, side by side")
    what.add_argument("--from-csv", help="simulate an action list written by another tool")
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--seq-segments", type=int, default=1)
    parser.add_argument(
        "--cost",
        default="F=1,B=1,W=1,comm=0",
        help="F,B,W[,BW],comm,first,last; BW defaults to B+W",
    )
    parser.add_argument(
        "--zb-memory", default="1p", help="zb_auto: memory limit, 1p | 2p | N microbatches"
    )
    parser.add_argument(
        "--zb-w-share",
        type=float,
        default=1.0,
        help="zb_auto: part of a microbatch's activations kept from B to W (M_W/M_B)",
    )
    parser.add_argument(
        "--placement",
        choices=["loop", "v"],
        default="loop",
        help="stage placement of a --from-csv schedule",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=0,
        help="simulate this many steps back to back, with and without post-validation",
    )
    parser.add_argument(
        "--optimizer-cost", type=float, default=0.0, help="--iterations: one optimizer step"
    )
    parser.add_argument(
        "--sync-cost",
        type=float,
        default=0.0,
        help="--iterations: the global grad-norm/NaN reduction before the optimizer",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--plot", help="write the timeline as a PNG")
    parser.add_argument("--to-csv", help="write the action list as CSV")
    args = parser.parse_args(argv)
    if args.iterations < 0 or args.optimizer_cost < 0 or args.sync_cost < 0:
        parser.error("--iterations, --optimizer-cost and --sync-cost must be >= 0")
    if not args.from_csv and (args.pp is None or args.microbatches is None):
        parser.error("--pp and --microbatches are required unless --from-csv is given")
    return args


def main(argv=None) -> int:
    """The tool; a bad argument or schedule is one line `error: ...` on stderr and exit 1."""
    try:
        return _run(parse_args(argv))
    except ValueError as error:  # one-line errors, no traceback, for bad arguments
        print(f"error: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    costs = Costs.parse(args.cost)
    if args.from_csv:
        schedule = read_csv(args.from_csv)
        vpp = 1 + max(a.chunk for acts in schedule.values() for a in acts)
        where = Placement(len(schedule), vpp, args.placement)
        results = [(Path(args.from_csv).stem, schedule, simulate(schedule, costs, where), where)]
    else:
        names = args.compare.split(",") if args.compare else [args.schedule]
        results = [(name, *run_named(name.strip(), args, costs)) for name in names]
    if args.to_csv:
        write_csv(results[0][1], args.to_csv)
    if args.plot:
        save_timelines(
            [
                (
                    f"{name}: makespan {r.makespan:g}, bubble {r.bubble_fraction:.3f}",
                    r.timeline,
                    len(s),
                )
                for name, s, r, _ in results
            ],
            args.plot,
        )
    many = {name: iterations_summary(s, costs, w, args) for name, s, _, w in results}
    if args.json:
        out = {name: summary(r, args.zb_w_share) for name, _, r, _ in results}
        for name, it in many.items():
            if it is not None:
                out[name]["multi_iteration"] = it
        print(json.dumps(out if args.compare else next(iter(out.values()))))
        return 0
    if args.compare:
        print(compare_table([(name, r) for name, _, r, _ in results]))
    else:
        print(format_grid(results[0][1]))
        print(json.dumps(summary(results[0][2], args.zb_w_share)))
    if args.iterations:
        print(iterations_table([(name, it) for name, it in many.items()]))
    return 0
