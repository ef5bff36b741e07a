"""Held-out validation on the other published 2021-2022 Megatron-LM runs on A100
(data/megatron_2021_2022_runs.csv; its header names each figure's source and what is derived):
Narayanan et al. 2021's Table 2 (175B and 530B, 384 to 2240 GPUs, full recompute) and
Korthikanti et al. 2022's end-to-end runs (Tables 3 and 5: 22B to 1T, full recompute, and
sequence parallelism with selective recompute).

Each row becomes a megapipe Config as table1.row_config builds Table 1's (gpt2 arch,
seq_len 2048, vocab 51200, dropout 0.1, bf16, the row's mesh, micro-batch and schedule), with
the row's recompute.mode and parallel.sequence_parallel, and is projected on the A100 profile
under a runtime: `megatron2021` for every row (the issue's held-out check), or the runtime of
the row's code (`by_code`: megatron2021 for Narayanan et al. 2021's runs, megatron2022 for
Korthikanti et al. 2022's). A row's error is projected / measured throughput − 1: the hardware
TFLOP/s per GPU where the paper publishes that (§5.1's count, as Table 1), else measured /
projected iteration time − 1 (the same ratio). Nothing is fitted on these rows.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from benchmarks.validation.table1 import MegatronShape, megatron_config, shape_fields
from megapipe.config import Config
from megapipe.perf.cluster import Cluster, load_cluster
from megapipe.perf.cost_terms import CALIBRATION, Calibration
from megapipe.perf.model import project
from megapipe.perf.software import MEGATRON_2021, RUNTIMES, Runtime

DATA = Path(__file__).resolve().parent / "data" / "megatron_2021_2022_runs.csv"
TARGET_MEAN, TARGET_MAX = 0.08, 0.15  # issue 34's held-out target for these runs


@dataclass(frozen=True)
class Run(MegatronShape):
    label: str
    source: str
    code: str  # the runtime of the code the run used (by its paper's date)
    recompute: str
    sequence_parallel: bool
    iteration_s: float | None
    tflops_per_gpu: float | None
    measure: str  # "tflops" or "time": which published figure the comparison uses


def runs(path: Path | str = DATA) -> list[Run]:
    """The rows of the data file, checked: dp = gpus / (tp·pp), whole microbatches."""
    with open(path) as f:
        lines = [line for line in f if not line.startswith("#")]
    out = []
    for rec in csv.DictReader(lines):
        run = Run(
            label=rec["label"],
            source=rec["source"],
            code=rec["code"],
            **shape_fields(rec),
            recompute=rec["recompute"],
            sequence_parallel=rec["sequence_parallel"] == "1",
            iteration_s=float(rec["iteration_s"]) if rec["iteration_s"] else None,
            tflops_per_gpu=float(rec["tflops_per_gpu"]) if rec["tflops_per_gpu"] else None,
            measure=rec["measure"],
        )
        if run.tp * run.pp * run.dp != run.gpus or run.gbs % (run.dp * run.mbs):
            raise ValueError(f"{Path(path).name}: {run.label}: mesh and batch do not divide")
        out.append(run)
    return out


def run_config(run: Run) -> Config:
    """The megapipe config of one run (module docstring)."""
    return megatron_config(run, run.recompute, run.sequence_parallel)


@dataclass(frozen=True)
class Result:
    run: Run
    runtime: str
    step_time_s: float
    hw_tflops_per_gpu: float  # projected, §5.1's count (the recompute's forward included)

    @property
    def error(self) -> float:
        """Projected / measured throughput − 1."""
        if self.run.measure == "tflops":
            return self.hw_tflops_per_gpu / self.run.tflops_per_gpu - 1.0
        return self.run.iteration_s / self.step_time_s - 1.0

    @property
    def measured_tflops(self) -> float:
        """The measured hardware TFLOP/s per GPU (derived from the time on time rows)."""
        if self.run.measure == "tflops":
            return self.run.tflops_per_gpu
        return self.hw_tflops_per_gpu * self.step_time_s / self.run.iteration_s


def compare(
    runtime: Runtime | None = MEGATRON_2021,
    cal: Calibration = CALIBRATION,
    cluster: Cluster | None = None,
    table: list[Run] | None = None,
) -> list[Result]:
    """Every run projected under `runtime`; None: each under the runtime of its code."""
    cluster = cluster or load_cluster("a100")
    out = []
    for run in table or runs():
        rt = runtime or RUNTIMES[run.code]
        proj = project(run_config(run), cluster, rt, cal, memory=False)
        out.append(Result(run, rt.name, proj.step_time_s, proj.hw_tflops_per_gpu))
    return out


def errors(results: list[Result]) -> tuple[float, float]:
    """(mean, max) absolute relative error."""
    errs = [abs(r.error) for r in results]
    return sum(errs) / len(errs), max(errs)


def markdown(results: list[Result]) -> str:
    """The comparison as a markdown table, then mean and max errors."""
    lines = [
        "| run | runtime | gpus | tp | pp | dp | m | v | recompute | SP "
        "| measured | projected | HW TFLOP/s measured / projected | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        w = r.run
        if w.measure == "tflops":
            meas, proj = f"{w.tflops_per_gpu:.0f} TFLOP/s", f"{r.hw_tflops_per_gpu:.1f} TFLOP/s"
        else:
            meas, proj = f"{w.iteration_s:.2f} s", f"{r.step_time_s:.2f} s"
        lines.append(
            f"| {w.label} | {r.runtime} | {w.gpus} | {w.tp} | {w.pp} | {w.dp} "
            f"| {w.microbatches} | {w.v} | {w.recompute} | {'on' if w.sequence_parallel else ''} "
            f"| {meas} | {proj} | {r.measured_tflops:.0f} / {r.hw_tflops_per_gpu:.0f} "
            f"| {r.error:+.1%} |"
        )
    mean, worst = errors(results)
    lines.append("")
    lines.append(
        f"mean |error| {mean:.1%}, max {worst:.1%} "
        f"(target ≤ {TARGET_MEAN:.0%}, ≤ {TARGET_MAX:.0%}; nothing fitted on these rows)"
    )
    return "\n".join(lines)
