"""The planner: every mesh, schedule and memory setting of a model on N GPUs of a cluster, the
ones that fit ranked by projected throughput (docs/architecture.md, "Layers", perf;
`python tools/plan.py search`). The space (`Candidate`, `candidates`) is perf/space.py's, the
bounds (`Bounds`) perf/bounds.py's.

The search (`search`): for each candidate two lower bounds from arithmetic alone, no schedule
built (perf/bounds.py): memory and step time. Candidates whose memory bound exceeds the GPU's
are dropped; the rest are taken in order of their time bound, each checked against the config
rules (config/checks.py: a ConfigError drops it), its exact memory planned (perf/memory_cache.plan,
the schedule's Dag compiled and cached), and, if it fits, projected (perf/model.project). The
search stops when the next time bound is no faster than the tenth best projection: what is
left cannot enter the top ten, so the best is the best of the whole space
(tests/test_plan_search.py holds it to an exhaustive enumeration).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from megapipe.config import Config, ConfigError, apply_override, load_config
from megapipe.config.checks import validate
from megapipe.perf.bounds import EPS, Bound, Bounds
from megapipe.perf.cluster import Cluster
from megapipe.perf.cost_terms import CALIBRATION, Calibration
from megapipe.perf.model import GIB, Projection, project
from megapipe.perf.software import MEGAPIPE, Runtime
from megapipe.perf.space import (
    COSTS_BUILT_MAX,
    COSTS_BUILT_MAX_PP,
    Candidate,
    candidates,
    too_costly,
)
from megapipe.plan.schedules import SCHEDULES

TOP = 10

# the keys the planner chooses: each reset to its default unless given on the command line
SEARCHED = {
    "parallel.tp": 1,
    "parallel.pp": 1,
    "parallel.dp": 1,
    "parallel.cp": 1,
    "parallel.cp_comm": "ring",
    "parallel.cp_a2a": 1,
    "parallel.vpp": 1,
    "parallel.schedule": "1f1b",
    "parallel.microbatches": 1,
    "parallel.sequence_parallel": False,
    "parallel.zero": 0,
    "parallel.seq_segments": 1,
    "parallel.zb_memory": "1p",
    "parallel.ep": 1,
    "parallel.dp_shard": 0,
    "recompute.mode": "none",
}


class PlanError(ValueError):
    """The search has no answer (a world size that cannot be made, nothing valid, nothing that
    fits): one line naming the cause."""


class NothingFits(PlanError):
    """No candidate fits in the GPU's memory; `gib` is the least any of them needs."""

    def __init__(self, message: str, gib: float, candidate: Candidate | None):
        super().__init__(message)
        self.gib, self.candidate = gib, candidate


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    config: Config
    projection: Projection

    @property
    def step_time_s(self) -> float:
        return self.projection.step_time_s


@dataclass
class SearchResult:
    ranked: list[Ranked]  # best first
    gpus: int
    cluster: Cluster
    runtime: Runtime
    seconds: float = 0.0  # wall clock
    counts: dict[str, int] = field(default_factory=dict)
    cpu_seconds: float = 0.0  # this process's CPU time (the wall clock counts other load)

    @property
    def best(self) -> Ranked:
        return self.ranked[0]


# -- the command line's keys ----------------------------------------------------------------


def _key(item: str) -> str:
    return item[2:].split("=", 1)[0] if item.startswith("--") else item.split("=", 1)[0]


def base_config(path: str | None, overrides: Iterable[str]) -> tuple[Config, dict[str, Any]]:
    """The config the search starts from and the searched keys held fixed: the file and every
    override that is not a searched key, with the searched keys at their defaults (the file's
    mesh is a starting point, not a constraint); the searched keys given as overrides, parsed."""
    overrides = list(overrides)
    searched = [o for o in overrides if _key(o) in SEARCHED]
    rest = [o for o in overrides if _key(o) not in SEARCHED]
    resets = [f"{k}={_yaml(v)}" for k, v in SEARCHED.items()]
    base = load_config(path, [*resets, *rest])
    scratch = Config()
    fixed: dict[str, Any] = {}
    for item in searched:
        apply_override(scratch, item)  # types checked, one-line ConfigError
        section, name = _key(item).split(".", 1)
        fixed[_key(item)] = getattr(getattr(scratch, section), name)
    return base, fixed


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_world(gpus: int, fixed: dict[str, Any]) -> None:
    """PlanError when the fixed parallel.dp/pp/cp/tp cannot make `gpus` ranks."""
    if gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    axes = [a for a in ("dp", "pp", "cp", "tp") if f"parallel.{a}" in fixed]
    given = {a: fixed[f"parallel.{a}"] for a in axes}
    product = math.prod(given.values())
    names = "·".join(given)
    values = "·".join(str(v) for v in given.values())
    if len(given) == 4 and product != gpus:
        raise PlanError(
            f"world size parallel.dp·pp·cp·tp = {values} = {product} does not match --gpus "
            f"{gpus}; change --gpus or the parallel sizes"
        )
    if given and gpus % product:
        raise PlanError(
            f"parallel.{names} = {values} = {product} does not divide --gpus {gpus}; change "
            "--gpus or the parallel sizes"
        )


# -- the search -----------------------------------------------------------------------------

# the tallies a search keeps (SearchResult.counts, in this order)
_COUNTS = ("candidates", "skipped_costly", "invalid", "over_memory_bound", "over_memory",
           "over_memory_inflight", "bounded", "projected", "pruned")  # fmt: skip


def search(
    base: Config,
    gpus: int,
    cluster: Cluster,
    runtime: Runtime = MEGAPIPE,
    cal: Calibration = CALIBRATION,
    fixed: dict[str, Any] | None = None,
    top: int = TOP,
    fp8s: tuple[str, ...] | None = None,
) -> SearchResult:
    """The `top` fastest candidates that pass the config rules and fit in the GPU's memory,
    best first (module docstring); `fp8s`: the train.fp8 recipes searched (None: the
    config's). PlanError when there are none."""
    began, cpu = time.perf_counter(), time.process_time()
    fixed = fixed or {}
    check_world(gpus, fixed)
    space = candidates(base, gpus, cluster.gpus_per_node, fixed, fp8s=fp8s)
    state = _SearchState(base, cluster, runtime, cal, Bounds(base, cluster, runtime, cal), top)
    state.counts["candidates"] = len(space)
    state.seed(space)
    ranked = state.rank()
    state.counts["pruned"] = state.pruned()
    if not ranked:
        raise state.no_answer(gpus)
    return SearchResult(
        ranked, gpus, cluster, runtime, time.perf_counter() - began, state.counts,
        time.process_time() - cpu,
    )  # fmt: skip


@dataclass
class _SearchState:
    """One search in progress: its best-first heap of (bound, order, level, payload) entries,
    the candidates over memory (`heavy`, for the least-memory message), the errors and the
    tallies. Level 0: a group under its coarse bound; 1: a Seq1F1B candidate under its cheap
    bound; 2: a candidate under its own bound; 3: a projection under its step time (exact). A
    popped entry is refined and pushed back under the larger bound; a projection popped is
    the next best."""

    base: Config
    cluster: Cluster
    runtime: Runtime
    cal: Calibration
    bound: Bounds
    top: int
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    heap: list[tuple] = field(default_factory=list)
    order: Iterator[int] = field(default_factory=itertools.count)
    heavy: list[tuple[float, int, Candidate]] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)  # the projected step times so far, sorted

    @property
    def hbm(self) -> float:
        """The GPU's memory in bytes."""
        return self.cluster.hbm_bytes

    def _over(self, nbytes: float) -> bool:
        """Whether `nbytes` exceeds the GPU's memory (beyond the bounds' rounding)."""
        return nbytes > self.hbm * (1 + EPS)

    def _push(self, bound: float, level: int, payload: Any) -> None:
        """Push `payload` at `level` under `bound` (ties: first pushed, first popped)."""
        heapq.heappush(self.heap, (bound, next(self.order), level, payload))

    def _invalid(self, err: Exception, n: int = 1) -> None:
        """Count `n` candidates against a config rule and keep the error."""
        self.counts["invalid"] += n
        self.errors.append(err)

    def _groups(self, space: list[Candidate]) -> dict[tuple, list[Candidate]]:
        """The candidates not too costly to build, grouped as their coarse bound is shared."""
        groups: dict[tuple, list[Candidate]] = {}
        for c in space:
            if too_costly(c):
                self.counts["skipped_costly"] += 1
            else:
                groups.setdefault(self.bound.group(c), []).append(c)
        return groups

    def seed(self, space: list[Candidate]) -> None:
        """Push each group under its coarse time bound, or set it aside when its memory bound
        is over the GPU's."""
        for members in self._groups(space).values():
            pipedream = any(c.pp > 1 and c.schedule == "pipedream_async" for c in members)
            try:
                t_lb, m_lb = self.bound.coarse(members[0], pipedream)
            except (ConfigError, ValueError) as err:
                self._invalid(err, len(members))
                continue
            if self._over(m_lb):
                self.counts["over_memory_bound"] += len(members)
                self.heavy += [(m_lb, 0, c) for c in members]
                continue
            self._push(t_lb * (1 - EPS), 0, members)

    def rank(self) -> list[Ranked]:
        """The `top` best projections, best first: entries popped and refined until that many
        projections have come off the heap (or it is empty)."""
        ranked: list[Ranked] = []
        while self.heap and len(ranked) < self.top:
            lb, _, level, payload = heapq.heappop(self.heap)
            if level == 3:
                ranked.append(payload)
            elif level == 0:
                self._bound_each(lb, payload, refined=False)
            elif self._fits_in_flight(*payload):
                if level == 1:
                    self._bound_each(lb, [payload[0]], refined=True)
                else:
                    self._project(lb, payload[0])
        return ranked

    def _fits_in_flight(self, c: Candidate, cb: Bound) -> bool:
        """Whether `c` (its bound `cb`) fits in memory with what it holds in flight over the
        `top`-th best step time so far (set aside in `heavy` when not)."""
        kth = self.steps[self.top - 1] if len(self.steps) >= self.top else math.inf
        if self._over(cb.memory_by(kth)):
            self.counts["over_memory_inflight"] += 1
            self.heavy.append((cb.memory, 1, c))
            return False
        return True

    def _bound_each(self, lb: float, members: list[Candidate], refined: bool) -> None:
        """Push each candidate under its own bound (the cheap one, level 1, for a segmented
        pipeline not yet `refined`), or set it aside when its memory bound is over the GPU's."""
        for c in members:
            fine = refined or not (c.pp > 1 and SCHEDULES[c.schedule].segmented)
            try:
                cb = self.bound(c, fine)
            except (ConfigError, ValueError) as err:
                self._invalid(err)
                continue
            self.counts["bounded"] += fine
            if self._over(cb.memory):
                self.counts["over_memory_bound"] += 1
                self.heavy.append((cb.memory, 1, c))
                continue
            self._push(max(lb, cb.time * (1 - EPS)), 2 if fine else 1, (c, cb))

    def _project(self, lb: float, c: Candidate) -> None:
        """Plan `c`'s memory exactly and, if it fits, push its projection under its step time."""
        cfg, mem, where = _exact_memory(
            c, self.base, self.bound, self.counts, self.errors, self.hbm
        )
        if mem == math.inf:
            return
        if cfg is None:
            self.counts["over_memory"] += 1
            self.heavy.append((mem, 2, c))
            return
        proj = project(cfg, self.cluster, self.runtime, self.cal, memory=False)
        proj = dataclasses.replace(proj, peak_memory_gib=mem / GIB, memory_rank=where, fits=True)
        self.counts["projected"] += 1
        bisect.insort(self.steps, proj.step_time_s)
        self._push(max(lb, proj.step_time_s), 3, Ranked(c, cfg, proj))

    def pruned(self) -> int:
        """How many candidates are left on the heap (a group counts its members)."""
        return sum(len(p) if level == 0 else 1 for _, _, level, p in self.heap)

    def no_answer(self, gpus: int) -> PlanError:
        """The error when nothing was ranked: NothingFits with the least memory any candidate
        needs, else a PlanError (naming the first config rule broken, if any)."""
        if not self.heavy:
            why = f": {self.errors[0]}" if self.errors else ""
            return PlanError(f"no configuration of {gpus} GPUs passes the config rules{why}")
        gib, least = _least_memory(self.heavy, self.base, self.bound)
        where = f" ({describe(least)})" if least is not None else ""
        plural = "s" if gpus > 1 else ""
        return NothingFits(
            f"nothing fits in {self.cluster.hbm_gib:g} GiB per GPU ({self.cluster.name}) on "
            f"{gpus} GPU{plural}: "
            f"the least any configuration needs is {gib:.1f} GiB per GPU{where}; use more "
            "GPUs, a GPU with more memory, or a smaller model or batch",
            gib,
            least,
        )


def _exact_memory(
    c: Candidate, base: Config, bound: Bounds, counts: dict, errors: list, hbm: float = math.inf
) -> tuple[Config | None, float, tuple[int, int]]:
    """(config, peak bytes, its (pp, tp) rank), as perf/memory_cache.plan's (Bounds.memory); the
    config rules checked when it fits in `hbm` (else None, its peak); (None, inf, ...) when it
    breaks a rule (counted)."""
    try:
        cfg = c.config(base, check=False)
        peak, where = bound.memory(cfg)
        if peak <= hbm:
            validate(cfg)
        return (cfg if peak <= hbm else None), peak, where
    except (ConfigError, ValueError) as err:
        counts["invalid"] += 1
        errors.append(err)
        return None, math.inf, (0, 0)


def _least_memory(heavy: list[tuple[float, int, Candidate]], base: Config, bound: Bounds):
    """The least exact peak memory (GiB) over `heavy` and the candidate that needs it, best
    first: (bound, level, candidate) entries, level 0 a group's bound, 1 the candidate's own,
    2 exact; each popped entry refined until an exact one comes first."""
    heap = [(lb, level, i, c) for i, (lb, level, c) in enumerate(heavy)]
    heapq.heapify(heap)
    order = itertools.count(len(heap))
    while heap:
        lb, level, _, c = heapq.heappop(heap)
        if level == 2:
            return lb / GIB, c
        if level == 0:
            try:
                value = bound(c).memory
            except (ConfigError, ValueError):
                continue
        else:
            value = _exact_memory(c, base, bound, {"invalid": 0}, [])[1]
            if value == math.inf:
                continue
        heapq.heappush(heap, (max(lb, value), level + 1, next(order), c))
    return math.inf, None


# -- output -------------------------------------------------------------------------------


def describe(c: Candidate) -> str:
    """One line: the candidate's keys."""
    parts = [f"tp={c.tp}", f"pp={c.pp}", f"dp={c.dp}", f"cp={c.cp}"]
    if c.pp > 1:
        parts += [f"vpp={c.vpp}", f"schedule={c.schedule_label.replace(' ', ':')}"]
    parts += [f"microbatches={c.microbatches}", f"recompute={c.recompute}",
              f"sp={int(c.sequence_parallel)}", f"zero={c.zero}"]  # fmt: skip
    if c.fp8 != "none":
        parts.append(f"fp8={c.fp8}")
    if c.ep > 1:
        parts.append(f"ep={c.ep}")
    if c.dp_shard:
        parts.append(f"dp_shard={c.dp_shard}")
    if c.cp > 1 and c.cp_comm != "ring":
        parts.append(f"cp_comm={c.cp_comm}" + (f":{c.cp_a2a}" if c.cp_comm == "hybrid" else ""))
    return " ".join(parts)


BREAKDOWN = (
    ("compute_s", "compute"),
    ("tp_comm_s", "tp"),
    ("cp_comm_s", "cp"),
    ("pipeline_bubble_p2p_s", "bubble+p2p"),
    ("dp_comm_s", "dp"),
    ("optimizer_s", "opt"),
)


def markdown(result: SearchResult) -> str:
    """The ranking as a markdown table: mesh, schedule, memory, throughput and the breakdown
    (share of the step on the busiest pp rank)."""
    head = (
        "| # | tp | pp | dp | cp | vpp | schedule | m | mbs | recompute | sp | zero | fp8 | step s "
        "| TFLOP/s | MFU | bubble | GiB | " + " | ".join(name for _, name in BREAKDOWN) + " |"
    )
    rule = "|" + "---:|" * 6 + "---|" + "---:|" * 2 + "---|" + "---:|" * 2 + "---|"
    rule += "---:|" * (6 + len(BREAKDOWN))
    lines = [head, rule]
    for i, r in enumerate(result.ranked, 1):
        c, p = r.candidate, r.projection
        mbs = r.config.derived.micro_batch_size
        parts = " | ".join(f"{p.breakdown[k] / p.step_time_s:.0%}" for k, _ in BREAKDOWN)
        lines.append(
            f"| {i} | {c.tp} | {c.pp} | {c.dp} | {c.cp} | {c.vpp if c.pp > 1 else '-'} "
            f"| {c.schedule_label} | {c.microbatches} | {mbs} | {c.recompute} "
            f"| {'on' if c.sequence_parallel else '-'} | {c.zero} | {_fp8_label(r.config)} "
            f"| {p.step_time_s:.3g} "
            f"| {p.tflops_per_gpu:.1f} | {p.mfu:.1%} | {p.bubble_fraction:.1%} "
            f"| {p.peak_memory_gib:.1f} | {parts} |"
        )
    return "\n".join(lines)


def _fp8_label(cfg: Config) -> str:
    """train.fp8's recipe, with `+params` where the candidate holds FP8 weights; `-`: none."""
    if cfg.train.fp8 == "none":
        return "-"
    return cfg.train.fp8 + ("+params" if cfg.train.fp8_params else "")


def summary(result: SearchResult) -> str:
    """What was searched, dropped and pruned, and how long it took."""
    n = result.counts
    over = n["over_memory_bound"] + n["over_memory_inflight"] + n["over_memory"]
    return (
        f"{n['candidates']} candidates in {result.seconds:.1f} s ({result.cpu_seconds:.1f} s "
        f"CPU): {n['projected']} projected, {n['pruned']} pruned by the time bounds, {over} "
        f"over memory ({n['over_memory_inflight']} by the in-flight bound, {n['over_memory']} "
        f"by the exact plan), {n['invalid']} against a config rule, {n['skipped_costly']} "
        f"with a schedule built for costs at pp > {COSTS_BUILT_MAX_PP} or pp·m·vpp > "
        f"{COSTS_BUILT_MAX} not built"
    )
