"""``bench pipeline``: measured pipeline step time against torch.distributed.pipelining, the
simulator's fidelity, and measured bubbles.

    python -m benchmarks.bench pipeline [--steps 9] [--warmup 2] [--schedules 1f1b,zb_v]
        [--out FILE] [--pv-block 4] [--pv-rounds 5] [--no-post-validation]

Two gloo ranks on this CPU (spawned by harness.spawn, one thread each), m=8 microbatches,
float32. The model is configs/pipeline_bench.yaml (tools/plot_timeline.py draws the same):
GPT-2 arch, 8 layers, d=256, 4 heads, seq 128, vocab 256 (untied), global batch 16, so a
microbatch is 2×128 tokens and stages exchange 256 KB activations.

- Both sides run the same megapipe chunks (`build_model` on `rank_blocks`, same seed, so the same
  weights), the same microbatches (torch chunks the batch along dim 0 as we do) and the same
  loss (summed cross entropy / global tokens; torch: logits out of the last stage, `loss_fn`
  outside). torch's stages call them with the built-in linear (F.linear): its B/W split
  (stage_backward_input / stage_backward_weight) walks autograd nodes and a built-in node
  computes only the grads asked for, while ours defers weight grads in its own linear.
- Timed: one pipelined forward + backward of all microbatches (our `Pipeline.forward_backward`,
  torch's `schedule.step`) between two barriers; no optimizer step. Rounds visit every
  schedule in turn so machine noise hits all alike; medians over rounds after warm-up.
- The losses and the global grad norm of every run must agree (same model, same math).
- zb_v and zb_auto (ZB-1p and ZB-2p, Qi et al. 2023 §3.1, at parallel.zb_memory 1p / 2p) are
  built as in training (parallel.schedule_costs=profile): the two warm-up rounds run the
  unit-time order, and the timed rounds the order built for the costs the second measured.
- Then post-validation on and off (Zero Bubble §4, bench_post_validation.py): whole training
  steps, optimizer included, back to back, with the simulator's multi-iteration figure beside
  each and the overlap of consecutive steps read from the measured timeline
  (`--no-post-validation` leaves them out; `--schedules ""` runs only them).
- Fidelity: our runtime's spans give mean compute per (kind, chunk) (timeline.profile_costs);
  simulate.py runs the actions that ran, with those costs (no comm cost), against the measured
  makespan, per step.
- Bubble: measured 1 − busy/(p·makespan) from the spans beside the simulated one.
- Noise floor (A/A): our runs that ran the same actions on every rank (interleaved_1f1b and
  torch's Interleaved1F1B order at pp=2, m=8) are timed against each other; on a shared
  machine their per-round ratio spreads as far as any ours / torch ratio
  (docs/benchmarks/2026-11-26-interleaved-runtime-cpu.md).

Pairs (torch → ours): GPipe → gpipe (Huang et al. 2019); 1F1B → 1f1b (PipeDream-Flush);
Interleaved1F1B → interleaved_1f1b v=2 (Narayanan et al. 2021 §2.2); InterleavedZeroBubble, ZB-H1
(Qi et al. 2023 §3.1) on two looped chunks → both our zero-bubble schedules at the same 1F1B
memory: zb_h1 (ZB-H1 as in the paper, one chunk) and zb_v (two chunks, V placement);
ZBVZeroBubble → zb_v (Qi et al. 2024); InterleavedZeroBubble → zb_auto 1p and 2p; DualPipeV →
dualpipe_v (DeepSeek-V3 §3.2.1: torch's order, whose F&B pairs both runtimes run in turn).
Schedules
are data, so our runtime also runs torch's own action orders (bench_schedules.torch_order):
"runtime only" rows, same order on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import bench_post_validation as pv
from benchmarks.bench_post_validation import CONFIG
from benchmarks.bench_schedules import torch_order
from benchmarks.harness import spawn, write_json
from megapipe.parallel.tensor.layers import ParallelLinear

M, PP = 8, 2
OURS = {  # our run -> (schedule giving the config and placement, vpp, torch order it runs)
    "gpipe": ("gpipe", 1, None),
    "1f1b": ("1f1b", 1, None),
    "interleaved_1f1b": ("interleaved_1f1b", 2, None),
    "zb_h1": ("zb_h1", 1, None),
    "zb_v": ("zb_v", 2, None),
    "zb_auto_1p": ("zb_auto", 1, None),
    "zb_auto_2p": ("zb_auto", 1, None),
    "torch_order:Interleaved1F1B": ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B"),
    "torch_order:InterleavedZeroBubble": ("interleaved_1f1b", 2, "ScheduleInterleavedZeroBubble"),
    "torch_order:ZBVZeroBubble": ("zb_v", 2, "ScheduleZBVZeroBubble"),
    "dualpipe_v": ("dualpipe_v", 2, None),
    "torch_order:DualPipeV": ("dualpipe_v", 2, "ScheduleDualPipeV"),  # its pairs unmarked
}
TORCH = {
    "ScheduleGPipe": (1, "loop"),
    "Schedule1F1B": (1, "loop"),
    "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleInterleavedZeroBubble": (2, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"),
    "ScheduleDualPipeV": (2, "v"),
}
BOTH, RUNTIME = "schedule + runtime", "runtime only"
PAIRS = [  # (torch schedule, our run, what differs); a torch run's peers are timed next to it
    ("ScheduleGPipe", "gpipe", BOTH),
    ("Schedule1F1B", "1f1b", BOTH),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", BOTH),
    ("ScheduleInterleaved1F1B", "torch_order:Interleaved1F1B", RUNTIME),
    ("ScheduleInterleavedZeroBubble", "zb_h1", BOTH),
    ("ScheduleInterleavedZeroBubble", "zb_v", BOTH),
    ("ScheduleInterleavedZeroBubble", "zb_auto_1p", BOTH),
    ("ScheduleInterleavedZeroBubble", "zb_auto_2p", BOTH),
    ("ScheduleInterleavedZeroBubble", "torch_order:InterleavedZeroBubble", RUNTIME),
    ("ScheduleZBVZeroBubble", "zb_v", BOTH),
    ("ScheduleZBVZeroBubble", "torch_order:ZBVZeroBubble", RUNTIME),
    ("ScheduleDualPipeV", "dualpipe_v", RUNTIME),  # the same order, F&B pairs run in turn
    ("ScheduleDualPipeV", "torch_order:DualPipeV", RUNTIME),  # read from torch, pairs unmarked
]


def our_actions(name: str):
    """(schedule, placement) of our run `name`: our generator's, or torch's order."""
    from megapipe.plan.schedules import build_schedule, placement

    schedule, vpp, torch_class = OURS[name]
    where = placement(schedule, PP, vpp)
    if torch_class is None:
        return build_schedule(schedule, PP, M, vpp), where
    return torch_order(torch_class, PP, M, where.style), where


def make_config(schedule: str, vpp: int, extra: tuple[str, ...] = ()):
    from megapipe.config import load_config

    return load_config(
        str(CONFIG),
        [
            f"parallel.pp={PP}",
            f"parallel.vpp={vpp}",
            f"parallel.schedule={schedule}",
            f"parallel.microbatches={M}",
            *extra,
            f"run.dir={tempfile.mkdtemp()}",
        ],
    )


def extra_of(name: str) -> tuple[str, ...]:
    """zb_auto's memory limit from the run's name (zb_auto_1p, zb_auto_2p)."""
    return (f"parallel.zb_memory={name.rsplit('_', 1)[1]}",) if name.startswith("zb_auto") else ()


class TorchStage(nn.Module):
    """A megapipe chunk as a torch stage module: tokens or activations in, activations or
    logits out (the loss is torch's `loss_fn`)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk
        for module in chunk.modules():  # torch's B/W split needs built-in autograd nodes
            if isinstance(module, ParallelLinear):
                module.use_builtin_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x)


class Ours:
    def __init__(self, name: str, mesh) -> None:
        from megapipe.parallel.data.levels import PLAIN
        from megapipe.pipeline.engine import build_pipeline

        schedule, self.vpp, _ = OURS[name]
        cfg = make_config(schedule, self.vpp, extra_of(name))
        self.name, self.pipe = name, build_pipeline(cfg, mesh, PLAIN)  # pp only: no replicas
        if OURS[name][2] is not None:  # torch's order on our runtime
            self.pipe.use_schedule(our_actions(name)[0])
        self.params = [p for c in self.pipe.chunks for p in c.parameters()]

    def step(self, inputs, targets, tokens) -> float:
        from megapipe.pipeline.runtime import MicroBatch

        micro = [MicroBatch(*mb) for mb in zip(inputs.chunk(M), targets.chunk(M))]
        return self.pipe.forward_backward(micro, tokens).item()


class Theirs:
    def __init__(self, class_name: str, mesh) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        from megapipe.config.pipeline_split import rank_blocks
        from megapipe.pipeline.stages import build_model
        from megapipe.plan.actions import Placement

        vpp, style = TORCH[class_name]
        self.name, place = class_name, Placement(PP, vpp, style)
        cfg, rank = make_config("1f1b", 1), mesh.coord("pp")
        chunks = [build_model(cfg, mesh, "cpu", b) for b in rank_blocks(cfg, rank, place)]
        self.params = [p for c in chunks for p in c.parameters()]
        stages = [
            PipelineStage(
                TorchStage(c),
                place.stage(rank, i),
                PP * vpp,
                torch.device("cpu"),
                group=mesh.group("pp"),
            )
            for i, c in enumerate(chunks)
        ]
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.tokens = cfg.derived.tokens_per_step
        cls = getattr(schedules, class_name)
        self.schedule = cls(
            stages[0] if vpp == 1 else stages, M, loss_fn=self.loss, scale_grads=False
        )

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / self.tokens
        )

    def step(self, inputs, targets, tokens) -> float:
        losses = []
        self.schedule.step(
            *([inputs] if self.first else []),
            target=targets if self.last else None,
            losses=losses,
            return_outputs=False,
        )
        return sum(loss.item() for loss in losses) * tokens


def job(steps: int, warmup: int, pairs: list) -> dict:
    """On each rank: build every run, warm up, time rounds; the figures (rank 0's count)."""
    import torch.distributed as dist

    from megapipe.data.loader import build_data
    from megapipe.distributed.launch import init_distributed
    from megapipe.pipeline import timeline

    cfg = make_config("1f1b", 1)
    mesh = init_distributed(cfg)
    runs = {}  # paired order: each of ours next to the torch schedule it is held against
    for t, o, _ in pairs:
        if o not in runs:
            runs[o] = Ours(o, mesh)
        if t not in runs:
            runs[t] = Theirs(t, mesh)
    batch = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    tokens = cfg.derived.tokens_per_step
    wall, cpu = {name: [] for name in runs}, {name: [] for name in runs}
    spans = {name: [] for name, run in runs.items() if isinstance(run, Ours)}
    checks = {}
    for round_ in range(warmup + steps):
        order = list(runs.items())
        for name, run in order if round_ % 2 else order[::-1]:  # alternate who goes first
            dist.barrier()
            began, cpu0 = time.perf_counter(), time.process_time()
            loss = run.step(inputs, targets, tokens)
            cpu1 = time.process_time()
            dist.barrier()
            elapsed = time.perf_counter() - began
            if round_ == 0:
                checks[name] = _loss_and_norm(loss, run.params)
            for p in run.params:
                p.grad = None
            if round_ >= warmup:
                wall[name].append(elapsed)
                cpu[name].append(_sum_over_ranks(cpu1 - cpu0))
                if name in spans:
                    spans[name].append(timeline.gather_spans(run.pipe.events))
    return {"wall": wall, "cpu": cpu, "spans": spans, "checks": checks}


def _sum_over_ranks(value: float) -> float:
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def _loss_and_norm(loss: float, params) -> tuple[float, float]:
    """The step's loss (summed over ranks: only the last stage's is not 0) and grad norm."""
    import torch.distributed as dist

    sq = sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)
    both = torch.tensor([loss, float(sq)], dtype=torch.float64)
    dist.all_reduce(both)
    return both[0].item(), both[1].sqrt().item()


def summarise(result: dict, steps: int, warmup: int, pairs: list) -> dict:
    """Per schedule: median step time, fidelity and bubbles; per pair: ours / torch, as the
    ratio of medians and as the median of per-round ratios (robust to slow load drifts)."""
    wall, cpu, med = result["wall"], result["cpu"], statistics.median
    ours = {name: _our_run(name, spans, wall, cpu) for name, spans in result["spans"].items()}
    theirs = {t: {"step_s": med(wall[t]), "cpu_s": med(cpu[t])} for t, _, _ in pairs}
    table = _pair_rows(pairs, ours, theirs, wall)
    spread = _check_spread(result["checks"])
    same = _same_order_rows(result["spans"], wall)
    return {
        "setup": {
            "pp": PP,
            "microbatches": M,
            "config": CONFIG.name,
            "threads_per_rank": 1,
            "steps": steps,
            "warmup": warmup,
            "dtype": "float32",
        },
        "ours": ours,
        "torch": theirs,
        "pairs": table,
        "same_order": same,
        "loss_and_grad_norm_max_rel_diff": spread,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def _our_run(name: str, steps_spans: list, wall: dict, cpu: dict) -> dict:
    """One of our runs: its median step, wall and CPU, and its measured makespan and bubble
    against the simulator's, each step simulated from its own costs and actions."""
    from megapipe.pipeline import timeline
    from megapipe.plan.simulate import simulate

    med = statistics.median
    vpp, where = OURS[name][1], our_actions(name)[1]
    sims, gots = [], []
    for per_rank in steps_spans:
        costs = timeline.profile_costs([per_rank], vpp)
        sims.append(simulate(timeline.ran(per_rank), costs, where))
        gots.append(timeline.measured(per_rank))
    return {
        "vpp": vpp,
        "step_s": med(wall[name]),
        "cpu_s": med(cpu[name]),
        "measured_makespan_s": med(g["makespan"] for g in gots),
        "simulated_makespan_s": med(s.makespan for s in sims),
        "fidelity_error": med(s.makespan / g["makespan"] - 1 for s, g in zip(sims, gots)),
        "measured_bubble": med(g["bubble_fraction"] for g in gots),
        "simulated_bubble": med(s.bubble_fraction for s in sims),
        "costs_ms": _costs_ms(timeline.profile_costs(steps_spans, vpp)),
    }


def _pair_rows(pairs: list, ours: dict, theirs: dict, wall: dict) -> list[dict]:
    """Per (torch schedule, our run) pair: both steps, the ratio of medians, the median of the
    per-round ratios and the CPU-time ratio."""
    return [
        {
            "torch": t,
            "ours": o,
            "differs": differs,
            "torch_step_s": theirs[t]["step_s"],
            "ours_step_s": ours[o]["step_s"],
            "ratio": ours[o]["step_s"] / theirs[t]["step_s"],
            "paired_ratio": statistics.median(a / b for a, b in zip(wall[o], wall[t])),
            "cpu_ratio": ours[o]["cpu_s"] / theirs[t]["cpu_s"],
        }
        for t, o, differs in pairs
    ]


def _same_order_rows(spans: dict, wall: dict) -> list[dict]:
    """Pairs of our runs that ran the same actions on every rank (interleaved_1f1b and torch's
    Interleaved1F1B order at pp=2, m=8): an A/A control, so the spread of their per-round
    ratio is this run's noise floor for every ours / torch ratio."""
    from megapipe.pipeline import timeline

    ran = {name: timeline.ran(steps[-1]) for name, steps in spans.items() if steps}
    names = list(ran)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if ran[a] == ran[b] and OURS[a][1] == OURS[b][1]:
                ratios = sorted(x / y for x, y in zip(wall[a], wall[b]))
                rows.append(
                    {
                        "a": a,
                        "b": b,
                        "paired_ratio": statistics.median(ratios),
                        "min": ratios[0],
                        "max": ratios[-1],
                    }
                )
    return rows


def _check_spread(checks: dict) -> float:
    """The largest relative difference of any run's loss or grad norm from the first run's."""
    runs = list(checks.values())
    return max(max(abs(loss / runs[0][0] - 1), abs(norm / runs[0][1] - 1)) for loss, norm in runs)


def _costs_ms(costs) -> dict:
    return {
        k: [round(v * 1e3, 2) for v in getattr(costs, k)]
        for k in ("F", "B", "W", "BW")
        if isinstance(getattr(costs, k), tuple)
    }


def _label(name: str, s: dict) -> str:
    if name.startswith("torch_order:"):
        return f"torch's {name[12:]} order"
    return f"{name} (v={s['ours'][name]['vpp']})"


def markdown(s: dict) -> str:
    lines = [
        "| torch schedule | ours | compared | torch step (ms) | ours step (ms) | "
        "ours / torch | per-round ratio | CPU-time ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in s["pairs"]:
        lines.append(
            f"| {p['torch'][8:]} | {_label(p['ours'], s)} | {p['differs']} | "
            f"{p['torch_step_s'] * 1e3:.0f} | {p['ours_step_s'] * 1e3:.0f} | "
            f"{p['ratio']:.2f} | {p['paired_ratio']:.2f} | {p['cpu_ratio']:.2f} |"
        )
    lines += [
        "",
        "| ours | measured makespan (ms) | simulated (ms) | sim error | "
        "measured bubble | simulated bubble |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, o in s["ours"].items():
        lines.append(
            f"| {_label(name, s)} | {o['measured_makespan_s'] * 1e3:.0f} | "
            f"{o['simulated_makespan_s'] * 1e3:.0f} | {o['fidelity_error']:+.1%} | "
            f"{o['measured_bubble']:.3f} | {o['simulated_bubble']:.3f} |"
        )
    for r in s.get("same_order", []):
        lines.append(
            f"\nsame actions, same runtime (A/A): {_label(r['a'], s)} / {_label(r['b'], s)} "
            f"per-round ratio {r['paired_ratio']:.2f} (rounds {r['min']:.2f}-{r['max']:.2f}): "
            "a gap this size between ours and torch is noise"
        )
    lines.append(
        f"\nloss and grad norm, all runs: max relative difference "
        f"{s['loss_and_grad_norm_max_rel_diff']:.1e}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="timed rounds (medians)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--schedules",
        default=",".join(dict.fromkeys(o for _, o, _ in PAIRS)),
        help="ours to run, each with its torch peers",
    )
    parser.add_argument("--out", help="write every figure as JSON here")
    parser.add_argument(
        "--pv-block", type=int, default=4, help="post-validation rows: steps back to back"
    )
    parser.add_argument("--pv-rounds", type=int, default=5, help="post-validation rows: rounds")
    parser.add_argument(
        "--no-post-validation", action="store_true", help="leave out the post-validation rows"
    )
    args = parser.parse_args(argv)
    if args.pv_block < 2:  # the overlap of consecutive steps needs two steps in a block
        parser.error(f"--pv-block {args.pv_block}: must be at least 2")
    pairs = [p for p in PAIRS if p[1] in args.schedules.split(",")]
    summary = {}
    if pairs:
        result = spawn(PP, job, args.steps, args.warmup, pairs)[0]
        summary = summarise(result, args.steps, args.warmup, pairs)
        print(markdown(summary), flush=True)
    if not args.no_post_validation:
        found = spawn(PP, pv.job, args.pv_block, args.pv_rounds, 1)[0]
        summary["post_validation"] = pv.summarise(found, args.pv_block)
        print(pv.markdown(summary["post_validation"]))
    if args.out:
        write_json(args.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
