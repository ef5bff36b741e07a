"""``bench schedules``: our schedules against torch.distributed.pipelining's, and the proof table.

    python -m benchmarks.bench schedules                 # peer comparison (markdown)
    python -m benchmarks.bench schedules --proofs        # closed forms from the papers vs simulated
    python -m benchmarks.bench schedules --plots docs    # timeline PNGs for docs/
    python -m benchmarks.bench schedules --summary       # a row per schedule (docs/)

torch's schedule classes compute their action order in ``_calculate_single_rank_operations``
from a few attributes; we set those on a bare instance (no process group, no stages), read the
order, convert it to our Actions and run it through our simulator with the same costs.
"""

from __future__ import annotations

import argparse

from megapipe.cli.schedule import shape_for
from megapipe.plan.actions import Action, Placement, Schedule
from megapipe.plan.schedules import SCHEDULES, build_schedule, placement
from megapipe.plan.simulate import Costs, SimResult, simulate
from megapipe.plan.validate import ScheduleError, validate

# torch class name, its placement style, our schedules to hold against it: (name, vpp, judged).
# InterleavedZeroBubble is ZB-H1 on 2 interleaved chunks: the fair match is our 2-chunk zb_v at
# the same 1F1B memory. zb_h1 (v=1) is shown for reference only: no single-chunk schedule can
# beat m(F+B+W) + (p−1)F, while 2 chunks halve the fill time to (p−1)F/2.
PEERS = [
    ("ScheduleInterleaved1F1B", "loop", [("interleaved_1f1b", 2, True)]),
    ("ScheduleInterleavedZeroBubble", "loop", [("zb_v", 2, True), ("zb_h1", 1, False)]),
    ("ScheduleZBVZeroBubble", "v", [("zb_v", 2, True)]),
    ("ScheduleDualPipeV", "v", [("zb_v", 2, True), ("dualpipe_v", 2, True)]),
]
TORCH_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}  # torch "B" is the full backward
Row = tuple[str, str, float, float]  # a proof row: claim, setting, closed form, simulated


def torch_order(class_name: str, pp: int, m: int, style: str) -> Schedule:
    """Action lists of a torch pipelining schedule (2 stages per rank) as our Actions."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, class_name)
    bare = cls.__new__(cls)  # skip __init__: it wants real stages and a process group
    bare.pp_group_size, bare.n_local_stages, bare._n_microbatches = pp, 2, m
    bare.number_of_rounds = max(1, m // pp)
    bare.microbatches_per_round = m // bare.number_of_rounds
    bare.num_stages = bare._num_stages = 2 * pp
    bare.pipeline_order = {}
    where = Placement(pp, 2, style)
    schedule: Schedule = {}
    for rank in range(pp):
        ops = bare._calculate_single_rank_operations(rank)
        bare.pipeline_order[rank] = ops
        flat = [sub for op in ops if op is not None for sub in (op.sub_actions or [op])]
        schedule[rank] = [
            Action(
                TORCH_KINDS[op.computation_type.value],
                op.microbatch_index,
                where.locate(op.stage_index)[1],
            )
            for op in flat
        ]
    return schedule


def _ours(name: str, pp: int, m: int, vpp: int, costs: Costs) -> SimResult:
    schedule = build_schedule(name, pp, m, vpp)
    return simulate(schedule, costs, placement(name, pp, vpp))


def _cell(result: SimResult | None) -> str:
    if result is None:
        return "n/a"
    return f"{result.bubble_fraction:.3f} / {result.makespan:g} / {max(result.peak_inflight):g}"


def peer_table(costs: Costs, pps=(2, 4, 8)) -> tuple[str, list[str]]:
    """Markdown table (cells: bubble / makespan / peak in-flight) and the cells we lose."""
    header = (
        "| torch schedule | ours | p | m | torch: bubble / makespan / peak | "
        "ours: bubble / makespan / peak | ours ≤ torch |"
    )
    lines = [header, "|---|---|---:|---:|---|---|:-:|"]
    losses = []
    for class_name, style, mine in PEERS:
        for pp in pps:
            for m in (pp, 2 * pp, 4 * pp):
                theirs = _torch_result(class_name, pp, m, style, costs)
                for name, vpp, judged in mine:
                    ours = _ours(name, pp, m, vpp, costs)
                    ok = theirs is None or ours.bubble_fraction <= theirs.bubble_fraction + 1e-9
                    if judged and not ok:
                        losses.append(f"{class_name} vs {name} p={pp} m={m}")
                    verdict = ("yes" if ok else "NO") if judged else "(ref.)"
                    lines.append(
                        f"| {class_name[8:]} | {name} (v={vpp}) | {pp} | {m} | "
                        f"{_cell(theirs)} | {_cell(ours)} | {verdict} |"
                    )
    return "\n".join(lines), losses


def _torch_result(class_name: str, pp: int, m: int, style: str, costs: Costs):
    try:
        schedule = torch_order(class_name, pp, m, style)
    except (ValueError, RuntimeError):  # e.g. DualPipeV needs m >= 2p
        return None
    where = Placement(pp, 2, style)
    try:
        validate(schedule, pp, m, 2, 1, where)  # their orders must also pass our validator
    except ScheduleError:  # DualPipeV with m < 2p names microbatches >= m: torch refuses it
        return None
    return simulate(schedule, costs, where)


def proof_rows() -> list[tuple[str, str, float, float]]:
    """(claim, setting, closed form, simulated) for the papers' statements."""
    unit, uneven = Costs(), Costs(F=1, B=1.2, W=0.8)
    rows = []
    for pp, m in [(4, 8), (8, 16), (4, 3)]:
        rows += _gpipe_1f1b_rows(pp, m, unit)
    for pp, m, v in [(4, 8, 2), (4, 16, 4), (8, 16, 2)]:
        rows.append(_interleaved_row(pp, m, v, unit))
    for costs, label in [(unit, "F=B=W=1"), (uneven, "F=1 B=1.2 W=0.8")]:
        for pp, m in [(4, 8), (8, 24)]:
            rows += _zero_bubble_rows(pp, m, costs, label)
    for pp, m in [(4, 8), (8, 24)]:
        rows += _zb_v_rows(pp, m, unit) + _seq1f1b_rows(pp, m, unit)
    for pp, m in [(4, 16), (6, 24), (8, 32)]:  # Qi et al. 2024, Controllable Memory
        rows += _v_shape_rows(pp, m, unit)
    rows += _dualpipe_rows()
    return rows


def _dualpipe_rows() -> list[Row]:
    """DeepSeek-V3 Table 2 (F, B full backward, W of a chunk; F&B a pair hiding half a W):
    DualPipe's longest device idle (PP/2−1)(F&B+B−3W) and PP+1 chunks' activations on PP
    devices, DualPipeV's on PP/2 devices of two chunks (the DualPipe README's row)."""
    chunk, rows = Costs(F=1, B=1, W=1, FB=2.5), []
    fb, b, w = 2.5, 2.0, 1.0
    for PP in (8, 16):
        setting = f"PP={PP} m={2 * PP} F=B/2=W=1 F&B=2.5"
        dual = simulate(
            build_schedule("dualpipe", PP, 2 * PP, 2), chunk, placement("dualpipe", PP, 2)
        )
        v_costs = Costs(F=2, B=2, W=2, FB=5)  # a rank's two chunks
        vee = _ours_costs("dualpipe_v", PP // 2, 2 * PP, v_costs)
        bubble = (PP / 2 - 1) * (fb + b - 3 * w)
        rows += [
            ("dualpipe idle (PP/2−1)(F&B+B−3W)", setting, bubble, max(dual.idle)),
            ("dualpipe activations PP+1 chunks", setting, PP + 1, max(dual.peak_inflight)),
            ("dualpipe_v idle (PP/2−1)(F&B+B−3W)", setting, bubble, max(vee.idle)),
            ("dualpipe_v activations PP+1 chunks", setting, PP + 1, 2 * max(vee.peak_inflight)),
        ]
    return rows


def _ours_costs(name: str, pp: int, m: int, costs: Costs) -> SimResult:
    return simulate(build_schedule(name, pp, m, 2), costs, placement(name, pp, 2))


def _gpipe_1f1b_rows(pp: int, m: int, unit: Costs) -> list[Row]:
    """The proof rows of GPipe's and 1F1B's bubble and peak in-flight at p = `pp`, `m`."""
    setting = f"p={pp} m={m}"
    rows: list[Row] = [
        (
            f"{name} bubble (p−1)/(m+p−1)",
            setting,
            (pp - 1) / (m + pp - 1),
            _ours(name, pp, m, 1, unit).bubble_fraction,
        )
        for name in ("gpipe", "1f1b")
    ]
    gpipe_peak = max(_ours("gpipe", pp, m, 1, unit).peak_inflight)
    rows.append(("gpipe peak in-flight m", setting, m, gpipe_peak))
    rank0_peak = _ours("1f1b", pp, m, 1, unit).peak_inflight[0]
    rows.append(("1f1b peak in-flight on rank 0: min(p, m)", setting, min(pp, m), rank0_peak))
    return rows


def _interleaved_row(pp: int, m: int, v: int, unit: Costs) -> Row:
    """The proof row of interleaved 1F1B's bubble at p = `pp`, `m`, `v` chunks."""
    over = (pp - 1) / v
    return (
        "interleaved bubble ((p−1)/v)/(m+(p−1)/v)",
        f"p={pp} m={m} v={v}",
        over / (m + over),
        _ours("interleaved_1f1b", pp, m, v, unit).bubble_fraction,
    )


def _zero_bubble_rows(pp: int, m: int, costs: Costs, label: str) -> list[Row]:
    """The proof rows of ZB-H1's idle time and ZB-H2's makespan and peak under `costs`."""
    setting = f"p={pp} m={m} {label}"
    h1, h2 = _ours("zb_h1", pp, m, 1, costs), _ours("zb_h2", pp, m, 1, costs)
    return [
        (
            "zb_h1 idle per rank (p−1)(F+B−W)",
            setting,
            (pp - 1) * (costs.F + costs.B - costs.W),
            max(h1.idle),
        ),
        (
            "zb_h2 makespan ≥ m(F+B+W)+(p−1)F (bound)",
            setting,
            m * (costs.F + costs.B + costs.W) + (pp - 1) * costs.F,
            h2.makespan,
        ),
        ("zb_h2 peak in-flight ≤ 2p−1", setting, 2 * pp - 1, max(h2.peak_inflight)),
    ]


def _zb_v_rows(pp: int, m: int, unit: Costs) -> list[Row]:
    """The proof rows of ZB-H1's peak and ZB-V's makespan (against ZB-H1's) and peak."""
    setting = f"p={pp} m={m}"
    h1_peak = max(_ours("zb_h1", pp, m, 1, unit).peak_inflight)
    h1_makespan = _ours("zb_h1", pp, m, 1, unit).makespan
    v_makespan = _ours("zb_v", pp, m, 2, unit).makespan
    v_peak = max(_ours("zb_v", pp, m, 2, unit).peak_inflight)
    return [
        ("zb_h1 peak in-flight = p", setting, pp, h1_peak),
        ("zb_v makespan ≤ zb_h1's", setting, h1_makespan, v_makespan),
        ("zb_v peak in-flight ≤ p (1F1B)", setting, pp, v_peak),
    ]


def _v_shape_rows(pp: int, m: int, unit: Costs) -> list[Row]:
    """The proof rows of V-Min's, V-Half's and ZB-V's peak activations (microbatches) and bubble
    rate (the paper's per-rank measure) against the paper's table at F = B = W, and their p2p
    messages per microbatch against 1F1B's 2(p−1)."""
    setting, rows = f"p={pp} m={m}", []
    claims = [("v_min", (pp + 4) // 3, 2 * pp / (3 * m), "(p+4)//3", "2p/(3m)"),
              ("v_half", (pp + 2) // 2, pp / (2 * m), "(p+2)//2", "p/(2m)"),
              ("zb_v", pp, 0.0, "p", "0")]  # fmt: skip
    for name, peak, rate, peak_text, rate_text in claims:
        got = _ours(name, pp, m, 2, unit)
        rows.append((f"{name} peak activations {peak_text}", setting, peak, max(got.peak_inflight)))
        rows.append((f"{name} bubble rate ≈ {rate_text}", setting, rate, got.bubble_rate_paper))
    where = placement("v_min", pp, 2)
    hops = sum(where.locate(s)[0] != where.locate(s + 1)[0] for s in range(2 * pp - 1))
    rows.append(("V-shape p2p messages per microbatch 4(p−1)", setting, 4 * (pp - 1), 2 * hops))
    return rows


def _seq1f1b_rows(pp: int, m: int, unit: Costs) -> list[Row]:
    """The proof rows of Seq1F1B's peak and bubble for k = 2 and 4 segments at p = `pp`, `m`."""
    setting, rows = f"p={pp} m={m}", []
    for k in (2, 4):
        seq = simulate(build_schedule("seq1f1b", pp, m, 1, k), unit, placement("seq1f1b", pp))
        rows.append(
            (
                f"seq1f1b k={k} peak (p+k−1)/k",
                setting,
                (pp + k - 1) / k,
                max(seq.peak_inflight),
            )
        )
        rows.append(
            (
                f"seq1f1b k={k} bubble (p−1)/(mk+p−1) (1f1b: (p−1)/(m+p−1))",
                setting,
                (pp - 1) / (m * k + pp - 1),
                seq.bubble_fraction,
            )
        )
    return rows


def proof_table() -> str:
    lines = ["| claim (paper) | setting | closed form / bound | simulated |", "|---|---|---:|---:|"]
    for claim, setting, expected, simulated in proof_rows():
        lines.append(f"| {claim} | {setting} | {expected:.4g} | {simulated:.4g} |")
    return "\n".join(lines)


# What each schedule's paper states of its memory and bubble, beside the simulated row (p ranks,
# m microbatches; peak activations in microbatches of one rank's share of the layers).
PAPER = {
    "gpipe": "peak m; bubble (p−1)/(m+p−1) (GPipe §2.2)",
    "1f1b": "peak p; bubble (p−1)/(m+p−1) (PipeDream-2BW §2.2, DAPPLE)",
    "interleaved_1f1b": "peak p(1+(p−1)/(pv)); bubble ((p−1)/v)/(m+(p−1)/v) (Megatron-LM §2.2)",
    "zb_h1": "peak p; idle (p−1)(F+B−W), B the input backward (Zero Bubble §3.1)",
    "zb_h2": "peak 2p−1; idle ≈ 0 (Zero Bubble §3.1)",
    "zb_v": "peak p; idle ≈ 0 at F=B=W (Zero Bubble §4 / Controllable Memory V-ZB)",
    "zb_auto": "list schedule under a memory limit (Zero Bubble §3.2)",
    "v_half": "peak (p+2)//2; bubble rate ≈ p/(2m) (Controllable Memory)",
    "v_min": "peak (p+4)//3; bubble rate ≈ 2p/(3m) (Controllable Memory)",
    "dualpipe_v": "activations 2p+1 chunks; idle (p/2−1)(F&B+B−3W), B the full backward "
    "(DeepSeek-V3 Table 2)",
    "dualpipe": "parameters 2×; activations p+1; idle (p/2−1)(F&B+B−3W), B the full backward "
    "(DeepSeek-V3 Table 2)",
    "seq1f1b": "k sequence segments: activations and bubble about 1/k of 1F1B's (Seq1F1B §3)",
    "pipedream_async": "no flush: 1F1B order, weights stashed per microbatch (PipeDream §3.3)",
}


def summary_table(pp: int = 4, m: int = 16, segments: int = 2) -> str:
    """One row per registered schedule at F = B = W = 1: makespan, bubble fraction, peak
    activations, p2p messages per microbatch (stage boundaries that cross ranks, forward and
    backward, per sequence segment) and parameters per rank, beside the paper's statement."""
    unit = Costs()
    lines = [
        f"| schedule (p={pp}, m={m}) | makespan | bubble | peak activations | p2p messages per "
        "microbatch | parameters per rank | the paper |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, spec in SCHEDULES.items():
        vpp, k = shape_for(name, 2, segments)
        where = placement(name, pp, vpp)
        result = simulate(build_schedule(name, pp, m, vpp, k), unit, where)
        hops = sum(
            where.locate(s, 0)[0] != where.locate(s + 1, 0)[0] for s in range(where.num_stages - 1)
        )
        params = "2×" if spec.placement == "dual" else "1×"
        lines.append(
            f"| `{name}` | {result.makespan:g} | {result.bubble_fraction:.3f} | "
            f"{max(result.peak_inflight):g} | {2 * hops * k} | {params} | {PAPER.get(name, '')} |"
        )
    return "\n".join(lines)


def write_plots(folder: str) -> list[str]:
    from megapipe.pipeline.plot import save_timelines

    written = []
    figures = {
        "schedules_p4_m8.png": [
            "gpipe",
            "1f1b",
            "interleaved_1f1b",
            "zb_h1",
            "zb_h2",
            "zb_v",
            "seq1f1b",
        ],
        "zero_bubble_p4_m8.png": ["1f1b", "zb_h1", "zb_h2", "zb_v"],
        "controllable_memory_p4_m8.png": ["1f1b", "v_min", "v_half", "zb_v"],  # Qi et al. 2024
    }
    for filename, names in figures.items():
        panels = []
        for name in names:
            vpp = 2 if name == "interleaved_1f1b" else SCHEDULES[name].chunks[0]
            k = 2 if name == "seq1f1b" else 1
            r = simulate(build_schedule(name, 4, 8, vpp, k), Costs(), placement(name, 4, vpp))
            title = (
                f"{name} (v={vpp}, k={k}): makespan {r.makespan:g}, bubble "
                f"{r.bubble_fraction:.3f}, peak {max(r.peak_inflight):g}"
            )
            panels.append((title, r.timeline, 4))
        save_timelines(panels, f"{folder}/{filename}")
        written.append(f"{folder}/{filename}")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py schedules", description=__doc__.split("\n")[0])
    parser.add_argument("--cost", default="F=1,B=1,W=1,comm=0")
    parser.add_argument("--proofs", action="store_true", help="print the proof table instead")
    parser.add_argument("--plots", metavar="DIR", help="also write timeline PNGs into DIR")
    parser.add_argument("--summary", action="store_true", help="print one row per schedule")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary_table())
    elif args.proofs:
        print(proof_table())
    else:
        table, losses = peer_table(Costs.parse(args.cost))
        print(table)
        print(f"\ncells where ours is worse: {', '.join(losses) if losses else 'none'}")
    for path in write_plots(args.plots) if args.plots else []:
        print(f"wrote {path}")
    return 0
