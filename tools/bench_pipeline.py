"""``bench pipeline``: measured pipeline step time against torch.distributed.pipelining, the
simulator's fidelity, and measured bubbles.

    python tools/bench.py pipeline [--steps 7] [--warmup 2] [--out bench_pipeline.json]

Two gloo ranks on this CPU (spawned, one thread each), m=8 microbatches, float32. The model is
plot_timeline.MODEL: GPT-2 arch, 8 layers, d=256, 4 heads, seq 128, vocab 256 (untied), global
batch 16, so a microbatch is 2×128 tokens and stages exchange 256 KB activations.

- Both sides run the same megapipe chunks (`build_model` on `rank_blocks`, same seed, so the same
  weights), the same microbatches (torch chunks the batch along dim 0 as we do) and the same
  loss (summed cross entropy / global tokens; torch: logits out of the last stage, `loss_fn`
  outside). torch's stages call them with the built-in linear (F.linear): its B/W split
  (stage_backward_input / stage_backward_weight) walks autograd nodes and a built-in node
  computes only the grads asked for, while ours defers weight grads in its own linear.
- Timed: one pipelined forward + backward of all microbatches (our `PipelineRuntime.run`,
  torch's `schedule.step`) between two barriers; no optimizer step. Rounds visit every
  schedule in turn so machine noise hits all alike; medians over rounds after warm-up.
- The losses and the global grad norm of every run must agree (same model, same math).
- Fidelity: our runtime's spans give mean compute per (kind, chunk) (timeline.profile_costs);
  simulate.py with those costs (no comm cost) against the measured makespan, per step.
- Bubble: measured 1 − busy/(p·makespan) from the spans beside the simulated one.

Pairs (torch → ours): GPipe → gpipe (Huang et al. 2019), 1F1B → 1f1b (PipeDream-Flush), Interleaved1F1B
→ interleaved_1f1b v=2 (Narayanan et al. 2021 §2.2), InterleavedZeroBubble (ZB-H1 on two
looped chunks, Qi et al. 2023) → zb_v v=2, the two-chunk zero-bubble schedule at the same 1F1B
memory (zb_h1, one chunk, shown for reference), ZBVZeroBubble → zb_v (Qi et al. 2024).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_timeline import MODEL, ROOT, spawn  # noqa: E402

M, PP = 8, 2
OURS = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2)]
TORCH = [("ScheduleGPipe", 1, "loop"), ("Schedule1F1B", 1, "loop"),
         ("ScheduleInterleaved1F1B", 2, "loop"), ("ScheduleInterleavedZeroBubble", 2, "loop"),
         ("ScheduleZBVZeroBubble", 2, "v")]
PAIRS = [("ScheduleGPipe", "gpipe", True), ("Schedule1F1B", "1f1b", True),
         ("ScheduleInterleaved1F1B", "interleaved_1f1b", True),
         ("ScheduleInterleavedZeroBubble", "zb_v", True),
         ("ScheduleInterleavedZeroBubble", "zb_h1", False),
         ("ScheduleZBVZeroBubble", "zb_v", True)]


def make_config(schedule: str, vpp: int):
    from megapipe.config import load_config

    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        *MODEL, f"parallel.pp={PP}", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}",
        f"parallel.microbatches={M}", f"run.dir={tempfile.mkdtemp()}"])


@contextlib.contextmanager
def builtin_linear():
    """megapipe's layers call F.linear directly (see module docstring: torch's B/W split)."""
    from megapipe.tensor_parallel import layers

    deferrable = layers.linear
    layers.linear = lambda x, weight, bias, owner: F.linear(x, weight, bias)
    try:
        yield
    finally:
        layers.linear = deferrable


class TorchStage(nn.Module):
    """A megapipe chunk as a torch stage module: tokens or activations in, activations or
    logits out (the loss is torch's `loss_fn`)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with builtin_linear():
            return self.chunk(x)


class Ours:
    def __init__(self, name: str, vpp: int, mesh) -> None:
        from megapipe.pipeline.engine import Pipeline

        self.name, self.vpp = name, vpp
        self.pipe = Pipeline.build(make_config(name, vpp), mesh)
        self.params = [p for c in self.pipe.chunks for p in c.parameters()]

    def step(self, inputs, targets, tokens) -> float:
        from megapipe.pipeline.runtime import MicroBatch

        micro = [MicroBatch(*mb) for mb in zip(inputs.chunk(M), targets.chunk(M))]
        return self.pipe.runtime.run(self.pipe.actions, micro, tokens).item()


class Theirs:
    def __init__(self, class_name: str, vpp: int, style: str, mesh) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        from megapipe.pipeline.actions import Placement
        from megapipe.pipeline.partition import rank_blocks
        from megapipe.trainer import build_model

        self.name, place = class_name, Placement(PP, vpp, style)
        cfg, rank = make_config("1f1b", 1), mesh.coord("pp")
        chunks = [build_model(cfg, mesh, "cpu", b) for b in rank_blocks(cfg, rank, place)]
        self.params = [p for c in chunks for p in c.parameters()]
        stages = [PipelineStage(TorchStage(c), place.stage(rank, i), PP * vpp, torch.device("cpu"),
                                group=mesh.group("pp")) for i, c in enumerate(chunks)]
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.tokens = cfg.train.global_batch * cfg.model.seq_len
        cls = getattr(schedules, class_name)
        self.schedule = cls(stages[0] if vpp == 1 else stages, M, loss_fn=self.loss,
                            scale_grads=False)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / \
            self.tokens

    def step(self, inputs, targets, tokens) -> float:
        losses = []
        self.schedule.step(*([inputs] if self.first else []),
                           target=targets if self.last else None, losses=losses,
                           return_outputs=False)
        return sum(loss.item() for loss in losses) * tokens


def job(steps: int, warmup: int) -> dict:
    """On each rank: build every run, warm up, time rounds; rank 0's dict has the figures."""
    import torch.distributed as dist

    from megapipe.data import build_data
    from megapipe.mesh import init_distributed
    from megapipe.pipeline import timeline

    cfg = make_config("1f1b", 1)
    mesh = init_distributed(cfg)
    runs = [Ours(n, v, mesh) for n, v in OURS] + [Theirs(*t, mesh) for t in TORCH]
    batch = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    tokens = cfg.train.global_batch * cfg.model.seq_len
    times = {r.name: [] for r in runs}
    spans = {r.name: [] for r in runs if isinstance(r, Ours)}
    checks = {}
    for round_ in range(warmup + steps):
        for run in runs:
            dist.barrier()
            began = time.perf_counter()
            loss = run.step(inputs, targets, tokens)
            dist.barrier()
            elapsed = time.perf_counter() - began
            if round_ == 0:
                checks[run.name] = _loss_and_norm(loss, run.params)
            for p in run.params:
                p.grad = None
            if round_ >= warmup:
                times[run.name].append(elapsed)
                if run.name in spans:
                    spans[run.name].append(timeline.gather_spans(run.pipe.runtime.events))
    return {"times": times, "spans": spans, "checks": checks}


def _loss_and_norm(loss: float, params) -> tuple[float, float]:
    """The step's loss (summed over ranks: only the last stage's is not 0) and grad norm."""
    import torch.distributed as dist

    sq = sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)
    both = torch.tensor([loss, float(sq)], dtype=torch.float64)
    dist.all_reduce(both)
    return both[0].item(), both[1].sqrt().item()


def summarise(result: dict, steps: int, warmup: int) -> dict:
    """Per schedule: median step time, fidelity and bubbles; per pair: ours / torch."""
    from megapipe.pipeline import timeline
    from megapipe.pipeline.schedules import build_schedule, placement
    from megapipe.pipeline.simulate import simulate

    ours = {}
    for name, vpp in OURS:
        sims, gots = [], []
        for per_rank in result["spans"][name]:
            costs = timeline.profile_costs([per_rank], vpp)
            sims.append(simulate(build_schedule(name, PP, M, vpp), costs,
                                 placement(name, PP, vpp)))
            gots.append(timeline.measured(per_rank))
        errors = [s.makespan / g["makespan"] - 1 for s, g in zip(sims, gots)]
        ours[name] = {
            "vpp": vpp, "step_s": statistics.median(result["times"][name]),
            "measured_makespan_s": statistics.median(g["makespan"] for g in gots),
            "simulated_makespan_s": statistics.median(s.makespan for s in sims),
            "fidelity_error": statistics.median(errors),
            "measured_bubble": statistics.median(g["bubble_fraction"] for g in gots),
            "simulated_bubble": statistics.median(s.bubble_fraction for s in sims),
            "costs_ms": _costs_ms(timeline.profile_costs(result["spans"][name], vpp)),
        }
    theirs = {name: statistics.median(result["times"][name]) for name, *_ in TORCH}
    pairs = [{"torch": t, "ours": o, "judged": judged, "torch_step_s": theirs[t],
              "ours_step_s": ours[o]["step_s"], "ratio": ours[o]["step_s"] / theirs[t]}
             for t, o, judged in PAIRS]
    checks = result["checks"]
    ref_loss, ref_norm = checks["gpipe"]
    spread = max(max(abs(loss / ref_loss - 1), abs(norm / ref_norm - 1))
                 for loss, norm in checks.values())
    return {"setup": {"pp": PP, "microbatches": M, "model": MODEL, "threads_per_rank": 1,
                      "steps": steps, "warmup": warmup, "dtype": "float32"},
            "ours": ours, "torch_step_s": theirs, "pairs": pairs,
            "loss_and_grad_norm_max_rel_diff": spread, "raw_times_s": result["times"]}


def _costs_ms(costs) -> dict:
    return {k: [round(v * 1e3, 2) for v in getattr(costs, k)] for k in ("F", "B", "W", "BW")
            if isinstance(getattr(costs, k), tuple)}


def markdown(s: dict) -> str:
    lines = ["| torch schedule | ours | torch step (ms) | ours step (ms) | ours / torch |",
             "|---|---|---:|---:|---:|"]
    for p in s["pairs"]:
        vpp = s["ours"][p["ours"]]["vpp"]
        mark = "" if p["judged"] else " (ref.)"
        lines.append(f"| {p['torch'][8:]} | {p['ours']} (v={vpp}){mark} | "
                     f"{p['torch_step_s'] * 1e3:.0f} | {p['ours_step_s'] * 1e3:.0f} | "
                     f"{p['ratio']:.2f} |")
    lines += ["", "| ours | measured makespan (ms) | simulated (ms) | sim error | "
              "measured bubble | simulated bubble |", "|---|---:|---:|---:|---:|---:|"]
    for name, o in s["ours"].items():
        lines.append(f"| {name} (v={o['vpp']}) | {o['measured_makespan_s'] * 1e3:.0f} | "
                     f"{o['simulated_makespan_s'] * 1e3:.0f} | {o['fidelity_error']:+.1%} | "
                     f"{o['measured_bubble']:.3f} | {o['simulated_bubble']:.3f} |")
    lines.append(f"\nloss and grad norm, all runs: max relative difference "
                 f"{s['loss_and_grad_norm_max_rel_diff']:.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write every figure as JSON here")
    args = parser.parse_args(argv)
    summary = summarise(spawn(PP, job, args.steps, args.warmup)[0], args.steps, args.warmup)
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
