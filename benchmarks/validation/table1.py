"""Validation on Megatron-LM's Table 1 (Narayanan et al. 2021, arXiv 2104.04473): ten GPT runs
from 1.7B parameters on 32 A100s to 1T on 3072, with their measured hardware TFLOP/s per GPU.

Each row becomes a megapipe Config with its own shape and mesh (data/…table1.csv; its header
says how the paper counts): model.arch gpt2 (learned positions, tied embeddings, GeLU MLP of
4·d, biases: the paper's GPT), model.seq_len 2048, model.vocab_size 51200, model.dropout 0.1
(Megatron's default hidden and attention dropout), parallel.tp/pp/dp as given,
parallel.microbatches = gbs / (dp · mbs) (so the micro-batch is mbs sequences),
parallel.schedule interleaved_1f1b with parallel.vpp = v when v > 1 (else 1f1b),
train.global_batch gbs, recompute.mode full, train.dtype bfloat16. It is projected on the A100
profile under the `megatron2021` runtime (megapipe/perf/software.py: the software that ran
them), and its hardware TFLOP/s per GPU (the recompute's forward counted, §5.1) is compared
with the paper's.

The model's three constants (megapipe/perf/cost_terms.Calibration: e_max, κ, μ) are fitted to
these rows by least squares on log(projected / measured) (Levenberg-Marquardt over the constants'
logits / logs, so they stay in range); the leave-one-out error of a row is its error
when the constants are fitted on the other nine.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megapipe.config import Config, load_config
from megapipe.perf.cluster import Cluster, load_cluster
from megapipe.perf.cost_terms import CALIBRATION, Calibration
from megapipe.perf.model import project
from megapipe.perf.software import MEGATRON_2021, Runtime

TABLE1 = Path(__file__).resolve().parent / "data" / "megatron_2104.04473_table1.csv"
TARGET_MEAN, TARGET_MAX = 0.05, 0.10  # mean and max absolute relative error (issue 14)


@dataclass(frozen=True)
class MegatronShape:
    """A published Megatron-LM GPT run's model and mesh (Table 1's rows, megatron_runs'):
    what megatron_config reads."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    gbs: int
    mbs: int
    v: int

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.dp * self.mbs)


SHAPE_INTS = ("heads", "hidden", "layers", "tp", "pp", "dp", "gpus", "gbs", "mbs", "v")


def shape_fields(rec: dict[str, str]) -> dict:
    """MegatronShape's fields of one CSV record."""
    return {"params_b": float(rec["params_b"]), **{k: int(rec[k]) for k in SHAPE_INTS}}


@dataclass(frozen=True)
class Row(MegatronShape):
    tflops_per_gpu: float  # measured hardware TFLOP/s per GPU
    pct_peak: float

    @property
    def label(self) -> str:
        return f"{self.params_b:g}B"


def rows(path: Path | str = TABLE1) -> list[Row]:
    with open(path) as f:
        lines = [line for line in f if not line.startswith("#")]
    out = []
    for rec in csv.DictReader(lines):
        out.append(
            Row(
                **shape_fields(rec),
                tflops_per_gpu=float(rec["tflops_per_gpu"]),
                pct_peak=float(rec["pct_peak"]),
            )
        )
    return out


def row_config(row: Row) -> Config:
    """The megapipe config of one Table 1 row (module docstring)."""
    return megatron_config(row)


def megatron_config(
    run: MegatronShape, recompute: str = "full", sequence_parallel: bool = False
) -> Config:
    """The megapipe config of a published Megatron-LM GPT run (Table 1's or megatron_runs'):
    `run`'s model and mesh; GPT-2's 51200-token
    padded vocabulary, 2048 tokens, dropout 0.1, bf16, interleaved 1F1B where v > 1."""
    schedule = "interleaved_1f1b" if run.v > 1 else "1f1b"
    return load_config(
        None,
        [
            "model.arch=gpt2",
            f"model.n_layers={run.layers}",
            f"model.d_model={run.hidden}",
            f"model.n_heads={run.heads}",
            "model.vocab_size=51200",
            "model.seq_len=2048",
            "model.dropout=0.1",
            f"parallel.tp={run.tp}",
            f"parallel.pp={run.pp}",
            f"parallel.dp={run.dp}",
            f"parallel.vpp={run.v}",
            f"parallel.schedule={schedule}",
            f"parallel.microbatches={run.microbatches}",
            f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
            f"train.global_batch={run.gbs}",
            "train.dtype=bfloat16",
            f"recompute.mode={recompute}",
        ],
    )


@dataclass(frozen=True)
class Result:
    row: Row
    projected: float  # hardware TFLOP/s per GPU
    step_time_s: float
    bubble_fraction: float
    peak_memory_gib: float | None

    @property
    def error(self) -> float:
        return self.projected / self.row.tflops_per_gpu - 1.0


def compare(
    cal: Calibration = CALIBRATION,
    runtime: Runtime = MEGATRON_2021,
    cluster: Cluster | None = None,
    table: list[Row] | None = None,
    memory: bool = False,
) -> list[Result]:
    """Every row projected with `cal`."""
    cluster = cluster or load_cluster("a100")
    out = []
    for row in table or rows():
        proj = project(row_config(row), cluster, runtime, cal, memory=memory)
        out.append(
            Result(
                row,
                proj.hw_tflops_per_gpu,
                proj.step_time_s,
                proj.bubble_fraction,
                proj.peak_memory_gib,
            )
        )
    return out


def errors(results: list[Result]) -> tuple[float, float]:
    """(mean, max) absolute relative error."""
    errs = [abs(r.error) for r in results]
    return sum(errs) / len(errs), max(errs)


# -- calibration ----------------------------------------------------------------------------

BOUNDS = {"gemm": (0.2, 1.0), "knee": (1e-3, 50.0), "memory": (0.2, 1.0)}


def to_free(cal: Calibration) -> list[float]:
    """The constants as unbounded values: logits within BOUNDS, log κ (what the fit moves)."""
    out = []
    for name, (lo, hi) in BOUNDS.items():
        x = (getattr(cal, name) - lo) / (hi - lo) if name != "knee" else None
        x = None if x is None else min(max(x, 1e-9), 1 - 1e-9)  # a constant at its bound
        out.append(math.log(x / (1 - x)) if x is not None else math.log(cal.knee))
    return out


def from_free(z: list[float]) -> Calibration:
    """to_free's inverse, clamped into BOUNDS."""
    values = {}
    for (name, (lo, hi)), v in zip(BOUNDS.items(), z):
        if name == "knee":
            values[name] = min(max(math.exp(min(v, 50.0)), lo), hi)
        else:
            values[name] = lo + (hi - lo) / (1 + math.exp(-min(max(v, -50.0), 50.0)))
    return Calibration(**values)


def residuals(
    cal: Calibration, table: list[Row], cluster: Cluster, runtime: Runtime
) -> list[float]:
    """log(projected / measured) per row."""
    res = compare(cal, runtime, cluster, table)
    return [math.log(r.projected / r.row.tflops_per_gpu) for r in res]


def levenberg_marquardt(f, z0: list[float], iters: int = 30, step: float = 1e-4):
    """Minimise ‖f(z)‖² (f: the residual vector) by Levenberg-Marquardt (Marquardt 1963) with
    a forward-difference Jacobian; returns (z, ‖f(z)‖²)."""
    z = np.array(z0, dtype=float)
    r = np.array(f(list(z)))
    cost, lam = float(r @ r), 1e-3
    for _ in range(iters):
        jac = np.empty((len(r), len(z)))
        for j in range(len(z)):
            dz = z.copy()
            dz[j] += step
            jac[:, j] = (np.array(f(list(dz))) - r) / step
        jtj, grad = jac.T @ jac, jac.T @ r
        gain = 0.0
        while lam < 1e8:
            delta = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-12), -grad)
            trial = z + delta
            rt = np.array(f(list(trial)))
            if float(rt @ rt) < cost:
                gain = cost - float(rt @ rt)
                z, r, cost, lam = trial, rt, float(rt @ rt), lam / 3
                break
            lam *= 4
        if gain < 1e-12:
            break
    return list(z), cost


def fit(
    table: list[Row] | None = None,
    start: Calibration = CALIBRATION,
    runtime: Runtime = MEGATRON_2021,
) -> Calibration:
    """The constants that minimise the squared log errors over `table` (default all ten)."""
    table = table or rows()
    cluster = load_cluster("a100")
    z, _ = levenberg_marquardt(
        lambda z: residuals(from_free(z), table, cluster, runtime), to_free(start)
    )
    return from_free(z)


def leave_one_out(table: list[Row] | None = None, start: Calibration = CALIBRATION) -> list[Result]:
    """Each row projected with the constants fitted on the other nine (from `start`)."""
    table = table or rows()
    out = []
    for i, row in enumerate(table):
        cal = fit(table[:i] + table[i + 1 :], start)
        out += compare(cal, table=[row])
    return out


def markdown(results: list[Result], loo: list[Result] | None = None) -> str:
    """The comparison as a markdown table, then mean and max errors."""
    head = "| model | gpus | tp | pp | dp | mbs | v | paper TFLOP/s | projected | error |"
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if loo:
        head += " leave-one-out |"
        rule += "---:|"
    lines = [head, rule]
    for k, r in enumerate(results):
        w = r.row
        line = (
            f"| {w.label} | {w.gpus} | {w.tp} | {w.pp} | {w.dp} | {w.mbs} | {w.v} "
            f"| {w.tflops_per_gpu:.0f} | {r.projected:.1f} | {r.error:+.1%} |"
        )
        if loo:
            line += f" {loo[k].error:+.1%} |"
        lines.append(line)
    mean, worst = errors(results)
    lines.append("")
    lines.append(f"mean |error| {mean:.1%}, max {worst:.1%} (target ≤ 5%, ≤ 10%)")
    if loo:
        mean, worst = errors(loo)
        lines.append(f"leave-one-out: mean |error| {mean:.1%}, max {worst:.1%}")
    return "\n".join(lines)
