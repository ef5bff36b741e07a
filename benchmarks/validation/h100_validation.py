"""Validation on published H100/H200 training runs (published.py reads them: NVIDIA's
Megatron-Core recipes, torchtitan's benchmarks, ...), as table1.py validates on Table 1.

Each row is projected on its own cluster profile (megapipe/perf/clusters/<gpu>.yaml) with the
runtime of the code base that ran it (megapipe/perf/software.py: `megatron_core`, `torchtitan`),
that runtime's defaults set as the row's run set them (`runtime_of`: TE's userbuffers tp overlap
where the recipe turns it on, torch.compile's fusion where the run compiled, TE's flash backend
where the recipe disables cuDNN's), and its projected tokens/s per GPU compared with the
published figure. The H100 profile's e_max is fitted on these rows (h100_fit.py: the constant the
kernel benchmarks cannot give, as Table 1 fits the A100's); the rows of FIT_LEFT_OUT's sources
are projected and printed but neither fitted on nor held to the targets, for the reason given
there. `leave_one_out` projects each fitted row with e_max fitted on the other fitted rows.

`beside_megapipe` projects megapipe's own runtime on the Megatron-Core rows: the same model,
mesh, batch and sharding, with bf16 weights (train.params_dtype=bfloat16: the layout of
Megatron's distributed optimizer), train.compile where the config allows it (megapipe_config)
and megapipe's facts (runtime.resolved_for).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from benchmarks.validation import h100_fit, published
from megapipe.config import Config
from megapipe.perf.cluster import load_cluster
from megapipe.perf.cost_terms import Calibration
from megapipe.perf.model import Projection, project
from megapipe.perf.software import MEGAPIPE, RUNTIMES, Runtime, resolved_for
from megapipe.plan.schedules import SCHEDULES

TARGET_MEAN, TARGET_MAX = 0.08, 0.15  # mean and max absolute relative error (issue 34)


def runtime_of(row: published.Row) -> Runtime:
    """The row's code base's runtime with the switches its run set (module docstring)."""
    rt = RUNTIMES[row.runtime]
    if row.runtime == "torchtitan":
        rt = dataclasses.replace(rt, fused_elementwise=bool(row.compile))
    # the recipe's NVTE_FUSED_ATTN=0 (said once per model and source, "as the ... row" after)
    flash = {(r.source, r.model) for r in published.load_all() if "NVTE_FUSED_ATTN=0" in r.notes}
    if (row.source, row.model) in flash:
        rt = dataclasses.replace(rt, attention_kernel="flash")  # TE's flash-attn backend
    return rt


class TokensError:
    """A projection (`projection`) beside a published tokens/s per GPU (`measured`): the
    projected figure and the relative error (validated results of dense and MoE rows)."""

    measured: float
    projection: Projection

    @property
    def projected(self) -> float:
        """Projected tokens/s per GPU."""
        p = self.projection
        return p.tokens_per_step / p.step_time_s / p.world_size

    @property
    def error(self) -> float:
        return self.projected / self.measured - 1.0


@dataclass(frozen=True)
class Result(TokensError):
    row: published.Row
    measured: float  # tokens/s per GPU as published (or derived, published.measured)
    measured_tflops: float  # model TFLOP/s per GPU on megapipe's count
    projection: Projection


# Rows held but not validated, by data file: why the model cannot price them as they ran.
NOT_PRICED = {
    "torchtitan_h100_bf16.csv": "Meta's 96 GB HBM2e H100s at a 500 W limit: no cluster profile "
    "describes them (perf/clusters/h100.yaml is the 80 GB HBM3 SXM5 at 700 W)",
    "meta_llama3_2407.21783_table4.csv": "Meta's own training stack: no runtime states its facts",
}


def rows(runtimes: tuple[str, ...] = ("megatron_core", "torchtitan", "llm_foundry", "maxtext"),
         priced: bool = True) -> list[published.Row]:  # fmt: skip
    """The published rows whose code base has a runtime here and (`priced`) whose hardware a
    cluster profile describes (NOT_PRICED); `priced=False`: the others."""
    return [
        r for r in published.load_all()
        if (r.runtime in runtimes and r.source not in NOT_PRICED) == priced
    ]  # fmt: skip


def compare(table: list[published.Row] | None = None, cal: Calibration | None = None,
            memory: bool = False) -> list[Result]:  # fmt: skip
    """Every row projected with its own runtime on its own cluster, with e_max, κ and μ `cal`
    in place of the profile's (None: the profile's)."""
    out = []
    for row in rows() if table is None else table:
        m = published.measured(row)
        cluster = load_cluster(m.cluster, row.gpus_per_node)
        if cal is not None:
            cluster = h100_fit.with_constants(cluster, cal)
        proj = project(m.config, cluster, runtime_of(row), memory=memory)
        out.append(Result(row, m.tokens_per_s_per_gpu, m.model_tflops_per_gpu, proj))
    return out


FP8_TARGET_MEAN, FP8_TARGET_MAX = 0.10, 0.20  # on published H100 FP8 runs (issue 49)


def compare_fp8(cal: Calibration | None = None) -> list[Result]:
    """The published FP8 runs (published.FP8_SOURCES), held out of every fit, projected as
    compare() projects the bf16 ones: train.fp8 on the row's runtime (Megatron-Core's casts and
    amax reductions are Transformer Engine's delayed scaling: runtime.fp8_scaling)."""
    return compare(published.load_all(published.FP8_SOURCES), cal)


def fp8_markdown(results: list[Result]) -> str:
    """The FP8 rows as markdown() shows the others, each beside its bf16 twin's measured and
    projected speedup where the bf16 tables hold the same run (label without "-fp8")."""
    twins = {r.label: r for r in published.load_all()}
    lines = [
        "| row | gpus | tp | pp | cp | dp | vpp | measured tok/s/GPU | projected | error "
        "| FP8/bf16 measured | projected |",
        "|---|" + "---:|" * 11,
    ]
    for r in results:
        w, twin = r.row, twins.get(r.row.label.removesuffix("-fp8"))
        speedup = " | |"
        if twin is not None and (twin.tp, twin.pp, twin.cp) == (w.tp, w.pp, w.cp):
            base = compare([twin])[0]
            speedup = f" {r.measured / base.measured:.2f} | {r.projected / base.projected:.2f} |"
        lines.append(
            f"| {w.label} | {w.gpus} | {w.tp} | {w.pp} | {w.cp} | {w.dp} | {w.vpp} "
            f"| {r.measured:.0f} | {r.projected:.0f} | {r.error:+.1%} |" + speedup
        )
    mean, worst = errors(results)
    lines += ["", f"the {len(results)} FP8 rows, held out: mean |error| {mean:.1%}, max "
              f"{worst:.1%} (target ≤ {FP8_TARGET_MEAN:.0%}, ≤ {FP8_TARGET_MAX:.0%})"]  # fmt: skip
    return "\n".join(lines)


# Sources whose rows are projected but neither fitted on nor held to the targets, and why.
FIT_LEFT_OUT = {
    "llm_foundry_h100_bf16.csv": "the source does not pin the software the rows ran: the sweep "
    "that produced the table (scripts/train/benchmarking/sweep.sh, whose lines match each "
    "row's GPUs, micro-batch and accumulation) names LLM Foundry v0.0.4 (May 2023) and, in its "
    "two revisions, the images mosaicml/pytorch 2.0.1 cu118 and 2.1.0 cu121: a 2023 eager "
    "PyTorch FSDP1 stack whose losses no runtime fact here prices",
}


def fitted(results: list[Result]) -> list[Result]:
    """The results the fit and the targets take (not FIT_LEFT_OUT's)."""
    return [r for r in results if r.row.source not in FIT_LEFT_OUT]


def cases(results: list[Result]) -> list[h100_fit.Case]:
    """The fitted rows of `results` made ready for h100_fit."""
    return h100_fit.cases([r.row for r in fitted(results)], runtime_of)


def refit(results: list[Result], names: tuple[str, ...] | None = None) -> Calibration:
    """The H100 constants `names` (default h100_fit.CHOSEN's) fitted on the fitted rows,
    starting from the profile's."""
    table = cases(results)
    names = names or h100_fit.FITS[h100_fit.CHOSEN]
    return h100_fit.fit(table, names, h100_fit.constants(table[0].cluster))


def leave_one_out(results: list[Result], names: tuple[str, ...] | None = None,
                  cal: Calibration | None = None) -> list[Result]:  # fmt: skip
    """Each fitted row projected with the constants `names` fitted on the other fitted rows
    (from `cal`, default the profile's); a row outside the fit keeps its result (it had no
    part in the fit)."""
    table = cases(results)
    names = names or h100_fit.FITS[h100_fit.CHOSEN]
    start = cal or h100_fit.constants(table[0].cluster)
    fits = {c.row.label: (i, c) for i, c in enumerate(table)}
    out = []
    for r in results:
        if r.row.label not in fits:
            out.append(r)
            continue
        i, case = fits[r.row.label]
        fold = h100_fit.fit(table[:i] + table[i + 1 :], names, start)
        out.append(dataclasses.replace(r, projection=h100_fit.projection(case, fold)))
    return out


def errors(results: list[Result]) -> tuple[float, float]:
    """(mean, max) absolute relative error."""
    errs = [abs(r.error) for r in results]
    return sum(errs) / len(errs), max(errs)


def markdown(results: list[Result], loo: list[Result] | None = None) -> str:
    """The comparison as a markdown table (with `loo`'s errors as a leave-one-out column), then
    mean and max errors over the fitted rows (the targets'), by runtime, and the rows left out."""
    lines = [
        "| row | runtime | gpus | tp | pp | cp | dp | vpp | measured tok/s/GPU | projected "
        "| error | TFLOP/s measured | projected |" + (" leave-one-out |" if loo else ""),
        "|---|---|" + "---:|" * (11 + bool(loo)),
    ]
    for k, r in enumerate(results):
        w, p = r.row, r.projection
        line = (
            f"| {w.label} | {w.runtime} | {w.gpus} | {w.tp} | {w.pp} | {w.cp} | {w.dp} | {w.vpp} "
            f"| {r.measured:.0f} | {r.projected:.0f} | {r.error:+.1%} "
            f"| {r.measured_tflops:.0f} | {p.tflops_per_gpu:.0f} |"
        )
        if loo:
            line += f" {loo[k].error:+.1%} |" if w.source not in FIT_LEFT_OUT else " (not fitted) |"
        lines.append(line)
    mean, worst = errors(fitted(results))
    n = len(fitted(results))
    lines += ["", f"the {n} fitted rows: mean |error| {mean:.1%}, max {worst:.1%}"]
    if loo:
        mean, worst = errors(fitted(loo))
        lines.append(f"leave-one-out: mean |error| {mean:.1%}, max {worst:.1%} "
                     f"(target ≤ {TARGET_MEAN:.0%}, ≤ {TARGET_MAX:.0%})")  # fmt: skip
    for name in sorted({r.row.runtime for r in results}):
        part = [r for r in results if r.row.runtime == name]
        mean, worst = errors(part)
        lines.append(f"- {name}: {len(part)} rows, mean {mean:.1%}, max {worst:.1%}")
    for source, why in FIT_LEFT_OUT.items():
        n = sum(r.row.source == source for r in results)
        lines.append(f"- not fitted, not in the targets ({n} rows of {source}): {why}")
    held = rows(priced=False)
    for source in sorted({r.source for r in held}):
        labels = [r.label for r in held if r.source == source]
        why = NOT_PRICED.get(source, "no runtime states its code base's facts")
        lines.append(f"- not validated ({len(labels)} rows of {source}): {why}")
    return "\n".join(lines)


# -- megapipe's runtime beside Megatron-Core's --------------------------------------------------


@dataclass(frozen=True)
class Beside:
    row: published.Row
    megatron_core: Projection
    megapipe: Projection

    @property
    def ratio(self) -> float:
        return self.megapipe.tflops_per_gpu / self.megatron_core.tflops_per_gpu


def megapipe_config(cfg: Config) -> Config:
    """A Megatron-Core row's config as megapipe would run it best: bf16 weights (the layout of
    Megatron's distributed optimizer) and train.compile where the config checks allow it (not
    with parallel.zero=3, nor Seq1F1B's segments over a pipeline); parallel.tp_overlap as the
    row sets it for both."""
    p = cfg.parallel
    segmented = SCHEDULES[p.schedule].segmented and p.pp > 1
    train = dataclasses.replace(
        cfg.train, params_dtype="bfloat16", compile=p.zero != 3 and not segmented
    )
    return dataclasses.replace(cfg, train=train)


def beside_megapipe(table: list[published.Row] | None = None) -> list[Beside]:
    """Megapipe's runtime with bf16 weights projected beside Megatron-Core's on its rows."""
    out = []
    for row in rows(("megatron_core",)) if table is None else table:
        m = published.measured(row)
        cluster = load_cluster(m.cluster, row.gpus_per_node)
        ours = megapipe_config(m.config)
        core = project(m.config, cluster, runtime_of(row), memory=False)
        out.append(Beside(row, core, project(ours, cluster, MEGAPIPE, memory=False)))
    return out


def beside_markdown(results: list[Beside]) -> str:
    """Per row: each runtime's model TFLOP/s per GPU and MFU, the ratio, and the breakdown
    part that differs most (in seconds of the step)."""
    lines = [
        "| row | gpus | megatron_core TFLOP/s | MFU | megapipe TFLOP/s | MFU | ratio "
        "| most different |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b in results:
        c, o = b.megatron_core, b.megapipe
        parts = {k: o.breakdown[k] - c.breakdown[k] for k in c.breakdown}
        key = max(parts, key=lambda k: abs(parts[k]))
        lines.append(
            f"| {b.row.label} | {b.row.gpus} | {c.tflops_per_gpu:.0f} | {c.mfu:.1%} "
            f"| {o.tflops_per_gpu:.0f} | {o.mfu:.1%} | {b.ratio:.3f} "
            f"| {key[:-2]} {parts[key] / c.step_time_s:+.1%} of the step |"
        )
    worst = min(b.ratio for b in results)
    lines += ["", f"lowest ratio {worst:.3f} (issue 33's target: ≥ 0.90)"]
    return "\n".join(lines)


# the runtime facts where megapipe's differ from Megatron-Core's, in the order `attribution`
# swaps them (each group's Runtime fields)
TERMS = {
    "attention kernel": ("attention", "attention_kernel"),
    "residual fp32": ("residual_bytes",),
    "unfused elementwise, autocast casts": ("fused_elementwise", "autocast_casts",
                                            "compiled_layers"),
    "grad accumulation": ("grad_accum_bytes", "weight_cast_bytes"),
    "tp overlap": ("tp_comm_overlap",),
    "p2p": ("p2p_bytes", "p2p_scatter_gather", "p2p_blocking", "p2p_overlap"),
    "dp buckets and dtype": ("grad_bytes", "dp_bucket_mb", "dp_bucket_first_only",
                             "dp_bucket_per_block", "dp_bucket_params", "dp_bucket_params_per_rank",
                             "param_bytes", "param_gather_overlap"),
    "optimizer": ("optimizer_bytes",),
}  # fmt: skip


def attribution(b: Beside) -> dict[str, float]:
    """Seconds each group of megapipe's facts (TERMS) adds to Megatron-Core's projected step of
    `b`'s row, swapped in one group after another; "LM head by chunks" is the rest (megapipe's
    fused head and loss, costs.FUSED_HEAD_RUNTIMES, which no field carries)."""
    row = b.row
    m = published.measured(row)
    cluster = load_cluster(m.cluster, row.gpus_per_node)
    cfg = megapipe_config(m.config)
    ours = resolved_for(MEGAPIPE, cfg, cluster)
    rt, before, out = runtime_of(row), b.megatron_core.step_time_s, {}
    for term, names in TERMS.items():
        names = [n for n in names if hasattr(ours, n)]
        rt = dataclasses.replace(rt, **{n: getattr(ours, n) for n in names})
        step = project(cfg, cluster, rt, memory=False).step_time_s
        out[term], before = step - before, step
    out["LM head by chunks"] = b.megapipe.step_time_s - before
    return out


def attribution_markdown(results: list[Beside]) -> str:
    """attribution() of each row as a table of shares of Megatron-Core's step."""
    terms = [*TERMS, "LM head by chunks"]
    lines = ["| row | " + " | ".join(terms) + " |", "|---|" + "---:|" * len(terms)]
    for b in results:
        a = attribution(b)
        cells = " | ".join(f"{a[t] / b.megatron_core.step_time_s:+.1%}" for t in terms)
        lines.append(f"| {b.row.label} | {cells} |")
    return "\n".join(lines)
