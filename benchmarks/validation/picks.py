"""The planner against the published meshes: for each published run, the planner's fastest
configuration (megapipe/perf/search.py) under the run's GPUs, cluster, runtime, model, global
batch and device memory, beside the mesh the authors ran, both projected by the same model.

The planner searches megapipe's own configurations, so its memory is megapipe's (config/
states.py): where the published mesh does not fit that memory, the planner cannot pick it, and
the row says so (`published_fits`) with the plan's peak. The run's own settings the search
does not vary (precision, FP8, tp comm overlap, grad reduce dtype, layer balance) are held at
the row's, for the published mesh too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.validation import h100_validation, published
from megapipe.perf.cluster import load_cluster
from megapipe.perf.model import Projection, project
from megapipe.perf.search import PlanError, Ranked, describe, search


@dataclass(frozen=True)
class Pick:
    row: published.Row
    published: Projection  # the authors' mesh, projected with memory
    pick: Ranked | None  # the planner's best; None: nothing in its space fits (`why`)
    why: str = ""

    @property
    def ratio(self) -> float:
        """The pick's projected step time over the published mesh's: <= 1 is the target
        (infinite when nothing fits)."""
        if self.pick is None:
            return math.inf
        return self.pick.step_time_s / self.published.step_time_s

    @property
    def same_mesh(self) -> bool:
        """The pick is the published mesh (tp, pp, dp, cp, vpp)."""
        if self.pick is None:
            return False
        c, r = self.pick.candidate, self.row
        vpp = c.vpp if c.pp > 1 else 1
        return (c.tp, c.pp, c.dp, c.cp, vpp) == (r.tp, r.pp, r.dp, r.cp, r.vpp)


def pick(row: published.Row) -> Pick:
    """One row: its published mesh projected and the planner's best (module docstring)."""
    m = published.measured(row)
    cluster = load_cluster(m.cluster, row.gpus_per_node)
    runtime = h100_validation.runtime_of(row)
    base = m.config
    mine = project(base, cluster, runtime, memory=True)
    try:
        return Pick(row, mine, search(base, row.gpus, cluster, runtime).best)
    except PlanError as err:  # nothing in the planner's space fits: said in the row
        return Pick(row, mine, None, str(err))


def rows(max_gpus: int = 0) -> list[published.Row]:
    """Every priced published row (h100_validation.rows, and the FP8 rows), or those of at
    most `max_gpus` GPUs."""
    every = h100_validation.rows() + published.load_all(published.FP8_SOURCES)
    return [r for r in every if not max_gpus or r.gpus <= max_gpus]


HEADER = (
    "| row | GPUs | published mesh | step s | GiB | fits | planner's pick | step s | GiB "
    "| pick / published |\n|---|---:|---|---:|---:|---|---|---:|---:|---:|"
)


def row_line(p: Pick) -> str:
    """One row of the comparison table (HEADER)."""
    r, mine = p.row, p.published
    mesh = f"tp{r.tp} pp{r.pp} dp{r.dp} cp{r.cp}" + (f" vp{r.vpp}" if r.vpp > 1 else "")
    head = f"| {r.label} | {r.gpus} | {mesh} | {mine.step_time_s:.3f} | {mine.peak_memory_gib:.1f} "
    if p.pick is None:
        return head + f"| {'yes' if mine.fits else 'no'} | {p.why} | - | - | - |"
    best = p.pick.projection
    return (
        f"| {r.label} | {r.gpus} | {mesh} | {mine.step_time_s:.3f} "
        f"| {mine.peak_memory_gib:.1f} | {'yes' if mine.fits else 'no'} "
        f"| {'the same mesh: ' if p.same_mesh else ''}{describe(p.pick.candidate)} "
        f"| {best.step_time_s:.3f} | {best.peak_memory_gib:.1f} | {p.ratio:.3f} |"
    )


def summary(results: list[Pick]) -> str:
    """How often and by how much the pick differs, and which project slower."""
    differ = [p for p in results if not p.same_mesh]
    slower = [p for p in results if p.ratio > 1.0]
    ratios = sorted(p.ratio for p in differ if p.pick is not None)
    return (
        f"{len(differ)} of {len(results)} picks differ from the published mesh"
        + (f" (step time {ratios[0]:.3f} to {ratios[-1]:.3f} of its)" if ratios else "")
        + f"; {len(slower)} project slower than it"
        + (": " + ", ".join(_why_slower(p) for p in slower) if slower else "")
        + "."
    )


def _why_slower(p: Pick) -> str:
    if p.pick is None:
        return f"{p.row.label} (nothing in the planner's space fits)"
    why = "" if p.published.fits else f", its mesh needs {p.published.peak_memory_gib:.1f} GiB"
    return f"{p.row.label} ({p.ratio - 1:+.1%}{why})"
