"""The planner: every mesh, schedule and memory setting of a model on N GPUs of a cluster, the
ones that fit ranked by projected throughput (docs/architecture.md, "Layers", perf;
`python tools/plan.py search`).

The space (`candidates`): tp among the divisors of the node size (tp ≤ gpus-per-node), cp
(1, or up to seq_len/128 where the config rules allow it: seq_len divisible by 2·cp, no
dropout), pp with pp ≤ n_layers, dp = N/(tp·cp·pp) dividing the global batch, every micro-batch
size b dividing global_batch/dp (microbatches m = global_batch/(dp·b)), recompute none /
selective / full (recompute.layers as the config has it), sequence parallelism on or off under
tp > 1, zero 0 or 1 under dp·cp > 1, and under pp > 1 every registered schedule
(plan/schedules.SCHEDULES) with the chunk counts its rule allows (vpp up to VPP_MAX and
pp·vpp ≤ n_layers), Seq1F1B's segments (SEGMENTS), zb_auto's memory limits (ZB_MEMORY) and
the defaults of any other option. Left out: pipedream_async (its asynchronous updates do not
train the model one process trains, and it cannot tie embeddings under pp) and schedules built
for costs (zb_v, zb_auto) above COSTS_BUILT_MAX of pp·m·vpp or COSTS_BUILT_MAX_PP of pp
(their builders grow faster than linearly: seconds beyond; the summary counts them). A
searched key given on the command line is held at its value (even outside these ranges);
`balance`, `schedule_costs` and the rest keep the config's.

The search (`search`): for each candidate two lower bounds from arithmetic alone, no schedule
built: memory (each rank's weights, grads and AdamW state plus one microbatch's activations
through its chunks: every schedule has at least that in flight on every rank when the last
chunk's forward of the first microbatch starts) and step time (below). Candidates whose memory
bound exceeds the GPU's are dropped; the rest are taken in order of their time bound, each
checked against the config rules (config/checks.py: a ConfigError drops it), its exact memory
planned (perf/memory.plan, the schedule's Dag compiled and cached), and, if it fits, projected
(perf/model.project). The search stops when the next time bound is no faster than the tenth
best projection: what is left cannot enter the top ten, so the best is the best of the whole
space (tests/test_plan_search.py holds it to an exhaustive enumeration).

The time bound, from the per-stage costs the projection uses (perf/costs.py): a rank cannot
start before the first microbatch's forwards on the stages below its lowest one (head), then
runs all of its actions one after another (busy); the last backward that sends a gradient from
its lowest stage (its last action, or under a B/W split its last B, after all of its F and B)
is followed by the input-grad chain down to stage 0 (tail). So the pipeline ends no earlier
than max over ranks of head + busy and head + (busy, less W under a split) + tail; the dp
reduction adds at least its last bucket (overlapped) or all of it (not overlapped), then the
optimizer step. For 1F1B on equal stages this is its makespan, (m + pp − 1)·(F + B).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megapipe.config import Config, ConfigError, apply_override, load_config
from megapipe.config import stages as config_stages
from megapipe.config.checks import validate
from megapipe.config.flops import segment_bounds
from megapipe.config.memory import (
    GRAD_BYTES,
    WEIGHT_BYTES,
    attention_path,
    optimizer_bytes,
    segments,
)
from megapipe.config.stages import partition, placement_of, schedule_of
from megapipe.parallel.recompute import layer_mode
from megapipe.perf.cluster import Cluster
from megapipe.perf.comm import group_link, ring_time
from megapipe.perf.costs import (
    CALIBRATION,
    ZERO,
    BlockCosts,
    Calibration,
    CostModel,
    Work,
    shapes,
)
from megapipe.perf.memory import chunk_params
from megapipe.perf.model import GIB, Projection, _dp_plan, _optimizer, project
from megapipe.perf.pipeline import _PLAIN_OPTIONS, KIND_INDEX, schedule_key
from megapipe.perf.runtime import MEGAPIPE, Runtime
from megapipe.plan.actions import FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD, Placement
from megapipe.plan.schedules import SCHEDULES
from megapipe.train.memory import _segment_activations, chunk_activations, chunk_deferred

VPP_MAX = 8  # chunks per rank tried for interleaving (the paper's runs use 2 to 4)
SEGMENTS = (2, 4, 8)  # Seq1F1B segments per microbatch
ZB_MEMORY = ("1p", "2p")  # zb_auto's memory limits (Qi et al. 2023: ZB-1p, ZB-2p)
CP_MIN_TOKENS = 128  # cp only while every cp rank keeps at least this many tokens
# A schedule built for costs (zb_v, zb_auto) is not built above this pp·m·vpp nor above this
# pp: a zb_auto build takes about a second at pp·m = 256 and grows faster than linearly (zb_v
# ~ pp^2.6·m), and the exact memory check builds one per candidate that reaches it.
COSTS_BUILT_MAX = 256
COSTS_BUILT_MAX_PP = 8
EXCLUDED = {
    "pipedream_async": "asynchronous weight updates (not the model one process trains)",
}
TOP = 10
EPS = 1e-9  # relative slack on the bounds: they sum the same floats in another order

# the keys the planner chooses: each reset to its default unless given on the command line
SEARCHED = {
    "parallel.tp": 1,
    "parallel.pp": 1,
    "parallel.dp": 1,
    "parallel.cp": 1,
    "parallel.vpp": 1,
    "parallel.schedule": "1f1b",
    "parallel.microbatches": 1,
    "parallel.sequence_parallel": False,
    "parallel.zero": 0,
    "parallel.seq_segments": 1,
    "parallel.zb_memory": "1p",
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
class Candidate:
    """One point of the space: the searched keys' values."""

    tp: int
    pp: int
    dp: int
    cp: int
    vpp: int
    schedule: str
    microbatches: int
    sequence_parallel: bool
    zero: int
    recompute: str
    seq_segments: int = 1
    zb_memory: str = "1p"

    def config(self, base: Config, check: bool = True) -> Config:
        """`base` with this candidate's keys (validated: a ConfigError when a rule breaks)."""
        par = dataclasses.replace(
            base.parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            vpp=self.vpp,
            schedule=self.schedule,
            microbatches=self.microbatches,
            sequence_parallel=self.sequence_parallel,
            zero=self.zero,
            seq_segments=self.seq_segments,
            zb_memory=self.zb_memory,
        )
        rec = dataclasses.replace(base.recompute, mode=self.recompute)
        cfg = dataclasses.replace(base, parallel=par, recompute=rec)
        if check:
            validate(cfg)
        return cfg

    @property
    def schedule_label(self) -> str:
        if self.pp == 1:
            return "-"
        if self.seq_segments > 1:
            return f"{self.schedule} k={self.seq_segments}"
        if "memory" in SCHEDULES[self.schedule].options:
            return f"{self.schedule} {self.zb_memory}"
        return self.schedule


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


# -- the space ------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pick(fixed: dict[str, Any], key: str, values: Iterable) -> list:
    """`values`, or the fixed value alone when the key is fixed."""
    return [fixed[key]] if key in fixed else list(values)


def structures(base: Config, pp: int, fixed: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    """(schedule, vpp, seq_segments, zb_memory) the space holds at this pp."""
    f = fixed
    if pp == 1:  # one stage: the replica engine, no schedule runs
        return [(f.get("parallel.schedule", "1f1b"), f.get("parallel.vpp", 1),
                 f.get("parallel.seq_segments", 1), f.get("parallel.zb_memory", "1p"))]  # fmt: skip
    n_layers, out = base.model.n_layers, []
    names = [n for n in SCHEDULES if n not in EXCLUDED]
    for name in _pick(f, "parallel.schedule", names):
        spec = SCHEDULES[name]
        least, most = spec.chunks
        top = min(most or VPP_MAX, VPP_MAX)
        vpps = [v for v in range(least, max(top, least) + 1) if pp * v <= n_layers]
        segs = SEGMENTS if spec.segmented else (1,)
        mems = ZB_MEMORY if "memory" in spec.options else ("1p",)
        for vpp in _pick(f, "parallel.vpp", vpps):
            for k in _pick(f, "parallel.seq_segments", segs):
                for mem in _pick(f, "parallel.zb_memory", mems):
                    out.append((name, vpp, k, mem))
    return out


def candidates(
    base: Config, gpus: int, gpus_per_node: int, fixed: dict[str, Any] | None = None
) -> list[Candidate]:
    """Every point of the space (module docstring) for `gpus` GPUs in nodes of
    `gpus_per_node`; the config rules are checked later (Candidate.config)."""
    f = fixed or {}
    m, gbs = base.model, base.train.global_batch
    out = []
    tps = [t for t in _divisors(gpus_per_node) if gpus % t == 0]
    for tp in _pick(f, "parallel.tp", tps):
        if gpus % tp:
            continue
        cps = [
            c for c in _divisors(gpus // tp)
            if c == 1 or (m.dropout == 0 and m.seq_len % (2 * c) == 0
                          and m.seq_len // c >= CP_MIN_TOKENS)
        ]  # fmt: skip
        for cp in _pick(f, "parallel.cp", cps):
            if gpus % (tp * cp):
                continue
            pps = [p for p in _divisors(gpus // (tp * cp)) if p <= m.n_layers]
            for pp in _pick(f, "parallel.pp", pps):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if f.get("parallel.dp", dp) != dp or gbs % dp:
                    continue
                ms = [gbs // (dp * b) for b in _divisors(gbs // dp)]
                shapes = structures(base, pp, f)
                recs = ("none", "selective", "full")
                sps = (False, True) if tp > 1 else (False,)
                zeros = (0, 1) if dp * cp > 1 else (0,)
                for mb, rec, sp, zero in itertools.product(
                    _pick(f, "parallel.microbatches", ms),
                    _pick(f, "recompute.mode", recs),
                    _pick(f, "parallel.sequence_parallel", sps),
                    _pick(f, "parallel.zero", zeros),
                ):
                    for name, vpp, k, mem in shapes:
                        out.append(Candidate(tp, pp, dp, cp, vpp, name, mb, sp, zero, rec, k, mem))
    return out


def too_costly(c: Candidate) -> bool:
    """A schedule built for costs whose builder would take seconds (COSTS_BUILT_MAX, _PP)."""
    spec = SCHEDULES[c.schedule]
    big = c.pp * c.microbatches * c.vpp > COSTS_BUILT_MAX or c.pp > COSTS_BUILT_MAX_PP
    return c.pp > 1 and spec.built_for_costs and big


# -- the bounds ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """A candidate's lower bounds: step time, peak memory, and what bounds its memory if its
    step is to take at most a given time (`memory_by`)."""

    time: float
    memory: float
    states: list[float]  # per pp rank: weights, grads and AdamW bytes (tp rank 0)
    spans: list[float]  # per pp rank: a microbatch's least time from its forward to its
    # backward on the rank's lowest stage (the stages above: F, then B back down)
    firsts: list[float]  # per pp rank: one microbatch's activations on that stage (bytes)
    microbatches: int
    after: float  # the optimizer's least seconds after the pipeline

    def memory_by(self, step: float) -> float:
        """Peak memory bound given a step of at most `step` seconds. Each microbatch holds its
        activations on a rank's lowest stage from its forward to its backward there, at least
        `spans` apart, so in a pipeline of at most step − after seconds at least
        m · span / (step − after) of them are held at once (the m intervals' total length over
        the pipeline's): a schedule that keeps fewer in flight is slower than `step`."""
        room = step - self.after
        if room <= 0:
            return math.inf
        return max(
            s + max(1, math.ceil(self.microbatches * span * (1 - EPS) / room)) * a
            for s, span, a in zip(self.states, self.spans, self.firsts)
        )


class Bounds:
    """Lower bounds on candidates' step time and peak memory (module docstring).

    Three levels share cached parts: `coarse` bounds a group of candidates (any schedule and
    vpp) from whole-model sums; `__call__` bounds one candidate from its partition and
    placement. Seq1F1B's segment costs are left to the projection (the segments' bounds call
    plan/seq1f1b.balanced_segments, milliseconds each): its bounds use the whole sequence's
    costs with the attention core at its FLOPs at e_max (a segment's GEMMs, on fewer rows, and
    its other work cost no less: perf/costs.py), and the first segment's GEMMs for the chains.
    """

    def __init__(self, base: Config, cluster: Cluster, runtime: Runtime, cal: Calibration):
        self.base, self.cluster, self.runtime, self.cal = base, cluster, runtime, cal
        self.device = getattr(cluster, "device", "cuda")  # the kernels the memory plan counts
        self._models: dict[tuple, tuple[Config, CostModel]] = {}
        self._plains: dict[tuple, tuple[Config, CostModel]] = {}
        self._parts: dict[int, list[range]] = {}
        self._stage_costs: dict[tuple, tuple] = {}
        self._pipes: dict[tuple, tuple] = {}
        self._states: dict[tuple, tuple] = {}
        self._acts: dict[tuple, float] = {}
        self._layers: dict[tuple, tuple] = {}
        self._segments: dict[tuple, list] = {}
        self._counts: dict[tuple, int] = {}
        self._bytes: dict[tuple, float] = {}
        self._sums: dict[tuple, tuple] = {}
        self._schedules: dict[tuple, dict] = {}

    @staticmethod
    def group(c: Candidate) -> tuple:
        """The candidates `coarse` bounds together: one mesh, micro-batch count, sequence
        parallelism, recompute, Seq1F1B segment count and zero; any schedule and vpp."""
        segs = c.seq_segments if c.pp > 1 and SCHEDULES[c.schedule].segmented else 1
        return (c.tp, c.cp, c.pp, c.dp, c.microbatches, c.sequence_parallel, c.recompute, segs,
                c.zero)  # fmt: skip

    # -- the group bound -------------------------------------------------------------------

    def coarse(self, c: Candidate, pipedream: bool = False) -> tuple[float, float]:
        """(step time, peak memory) bounds for c's whole group, whatever the schedule and
        vpp: the busiest rank has at least the mean work, m · (F + B + W of every block) / pp,
        and the mean dp reduction after it when the runtime does not overlap it; the first
        microbatch (segment) goes forward through every stage and backward back; then the
        optimizer's mean step. Memory: the mean over pp ranks of the states and one
        microbatch's activations. `pipedream`: a group that steps inside its backwards (no
        dp or optimizer after the pipeline)."""
        tp, cp, pp, dp, mb, sp, rec, segs, zero = self.group(c)
        cfg = c.config(self.base, check=False)
        plain, cm = self._plain(cfg)
        everything = range(0, cfg.model.n_layers + 2)
        total, fb, f0, g0 = self._block_sums(cfg, everything, split=True)
        busy = mb * total / pp
        chain = f0 + g0
        acts = self._activations(plain, everything) if self._acts_bound(cfg) else 0.0
        params = self._params(cfg) / pp  # a rank's mean parameters (tp rank 0)
        states = params * (WEIGHT_BYTES + GRAD_BYTES) + optimizer_bytes(math.ceil(params), cfg)
        memory = states + acts / pp
        if pipedream:
            return max(busy, chain), memory
        shape = (pp, dp, cp, tp)
        opt = _optimizer(cfg, self.cluster, self.runtime, cm, shape, [[params]])
        reduce = 0.0
        if not self.runtime.dp_overlap:  # ring times are affine in bytes: the mean's
            kind = "reduce_scatter" if zero and dp * cp > 1 else "all_reduce"
            link = group_link(self.cluster, shape, ("dp", "cp"))
            reduce = ring_time(kind, params * (self.runtime.grad_bytes or cm.c), dp * cp, link)
        return max(busy + reduce, chain) + opt.step + opt.gather, memory

    def _params(self, cfg: Config) -> float:
        """Parameters over all of tp rank 0's chunks, at least: the embedding, the layers and
        the head each in a chunk of their own (each holds a tied table's copy) under pp > 1;
        one chunk holds both ends, so at least the layers and the larger end, under pp = 1."""
        n_layers = cfg.model.n_layers
        layer = self._chunk_params(cfg, range(1, 2), 0)
        embed = self._chunk_params(cfg, range(0, 1), 0)
        head = self._chunk_params(cfg, range(n_layers + 1, n_layers + 2), 0)
        ends = embed + head if cfg.parallel.pp > 1 else max(embed, head)
        return float(n_layers * layer + ends)

    def _chunk_params(self, cfg: Config, blocks: range, tp_rank: int) -> int:
        """perf/memory.chunk_params, cached by what it depends on here (the model is fixed):
        tp, sequence parallelism, which blocks the chunk holds (the layers are alike)."""
        p, n_layers = cfg.parallel, cfg.model.n_layers
        embed, head = 0 in blocks, n_layers + 1 in blocks
        key = (p.tp, p.sequence_parallel, embed, len(blocks) - embed - head, head, tp_rank)
        if key not in self._counts:
            self._counts[key] = chunk_params(cfg, blocks, tp_rank)
        return self._counts[key]

    # -- the candidate bound ---------------------------------------------------------------

    def __call__(self, c: Candidate, fine: bool = True) -> Bound:
        """The bounds of one candidate (module docstring); a ConfigError or ValueError when
        it breaks a rule the arithmetic meets. `fine=False`: a Seq1F1B candidate's from the
        whole sequence's costs (cheap, looser)."""
        spec = SCHEDULES[c.schedule]
        piped = c.pp > 1
        vpp = c.vpp if piped else 1
        style = spec.placement if piped else "loop"
        split = piped and spec.split_backward
        cfg = None
        key = (self.group(c)[:-1], style, vpp, split, fine)
        if key not in self._pipes:
            cfg = c.config(self.base, check=False)
            self._pipes[key] = self._pipeline(c, cfg, split, fine)
        ends, chain, acts, spans, firsts = self._pipes[key]
        skey = (c.tp, c.cp, c.pp, c.dp, c.sequence_parallel, style, vpp, c.zero)
        if skey not in self._states:
            self._states[skey] = self._state(cfg or c.config(self.base, check=False))
        states, after, opt = self._states[skey]
        memory = max(s + a for s, a in zip(states, acts))
        if piped and c.schedule == "pipedream_async":  # updates inside the backwards
            time_lb, opt = max(max(ends), chain), 0.0
        else:
            time_lb = max(max(e + a for e, a in zip(ends, after)), chain + after[0]) + opt
        return Bound(time_lb, memory, states, spans, firsts, c.microbatches, opt)

    def _pipeline(self, c: Candidate, cfg: Config, split: bool, fine: bool):
        """Per rank: head + busy (the rank's end, at least); the chain bound over all ranks
        (head + its F and B + tail); per rank one microbatch's activations (bytes)."""
        place = placement_of(cfg) if cfg.parallel.pp > 1 else Placement(1, 1)
        segmented = self._segmented(cfg)
        fine = fine and segmented
        plain, cm = self._plain(cfg)
        key = (id(cm), place.num_stages, split, _seg_key(cfg) if segmented else None, fine)
        if key not in self._stage_costs:
            stages = self._stages(cfg, place.num_stages)
            sums = self._segment_sums if fine else self._block_sums
            per = [sums(cfg, blocks, split) for blocks in stages]
            head = list(itertools.accumulate((x[2] for x in per), initial=0.0))
            tail = list(itertools.accumulate((x[3] for x in per), initial=0.0))
            with_acts = fine or self._acts_bound(cfg)
            acts = [self._activations(cfg if fine else plain, b) if with_acts else 0.0
                    for b in stages]  # fmt: skip
            self._stage_costs[key] = ([x[0] for x in per], [x[1] for x in per], head, tail, acts)
        total, fb, head, tail, stage_acts = self._stage_costs[key]
        mb = cfg.parallel.microbatches
        ends, chain, acts, spans, firsts = [], 0.0, [], [], []
        n = place.num_stages
        for r in range(place.pp):
            own = [place.stage(r, k) for k in range(place.vpp)]
            low = min(own)
            ends.append(head[low] + mb * sum(total[s] for s in own))
            chain = max(chain, head[low] + mb * sum(fb[s] for s in own) + tail[low])
            acts.append(sum(stage_acts[s] for s in own))
            spans.append(head[n] - head[low] + tail[n] - tail[low])
            firsts.append(stage_acts[low])
        return ends, chain, acts, spans, firsts

    def _state(self, cfg: Config):
        """Per rank the state bytes (weights, grads, AdamW) and the dp reduction's least part
        after the rank's last action; the optimizer step (seconds)."""
        p = cfg.parallel
        place = placement_of(cfg) if p.pp > 1 else Placement(1, 1)
        stages = self._stages(cfg, place.num_stages)
        held = [
            [self._chunk_params(cfg, stages[place.stage(r, k)], 0) for k in range(place.vpp)]
            for r in range(place.pp)
        ]
        states = [sum(h) * (WEIGHT_BYTES + GRAD_BYTES) + optimizer_bytes(sum(h), cfg) for h in held]
        _, cm = self._plain(cfg)
        shape = (p.pp, p.dp, p.cp, p.tp)
        dp = _dp_plan(cfg, self.cluster, self.runtime, shape, held,
                      self.runtime.grad_bytes or cm.c)  # fmt: skip
        opt = _optimizer(cfg, self.cluster, self.runtime, cm, shape, held)
        last_rank = place.locate(place.num_stages - 1)[0]
        after = [
            (min(dp.last_bucket[r]) if self.runtime.dp_overlap else dp.total[r])
            + (dp.tied if r in (0, last_rank) else 0.0)
            for r in range(place.pp)
        ]
        return states, after, opt.step + opt.gather

    # -- shared parts ----------------------------------------------------------------------

    def _plain(self, cfg: Config) -> tuple[Config, CostModel]:
        """`cfg` unsegmented (1f1b) and its cost model, shared by the configs whose blocks
        cost the same: the same tp, cp, micro-batch size, sequence parallelism and recompute,
        and the same links for the tp and cp groups (what CostModel reads of pp and dp)."""
        p = cfg.parallel
        mesh = (p.tp, p.cp, p.pp, p.dp, p.microbatches, p.sequence_parallel, cfg.recompute.mode)
        if mesh not in self._plains:
            shape = (p.pp, p.dp, p.cp, p.tp)
            links = (group_link(self.cluster, shape, ("tp",)),
                     group_link(self.cluster, shape, ("cp",)))  # fmt: skip
            key = _block_key(cfg, links)
            if key not in self._models:
                plain = dataclasses.replace(
                    cfg, parallel=dataclasses.replace(p, schedule="1f1b", vpp=1, seq_segments=1)
                )
                self._models[key] = (plain, CostModel(plain, self.cluster, self.runtime, self.cal))
            self._plains[mesh] = self._models[key]
        return self._plains[mesh]

    def _stages(self, cfg: Config, n_stages: int) -> list[range]:
        if n_stages not in self._parts:  # the partition depends on the model and balance only
            self._parts[n_stages] = partition(cfg, n_stages)
        return self._parts[n_stages]

    def _segmented(self, cfg: Config) -> bool:
        p = cfg.parallel
        return p.pp > 1 and SCHEDULES[p.schedule].segmented and p.seq_segments > 1

    def _block_sums(self, cfg: Config, blocks: range, split: bool) -> tuple:
        """Over `blocks`, one microbatch: (F + B + W; F + B, with W under no split; the first
        segment's F; its chain backward: B, with W under no split). Unsegmented: the cost
        model's stage costs. Segmented: those of the whole sequence less each layer's attention
        excess, and the first segment's layer GEMMs."""
        _, cm = self._plain(cfg)
        p = cfg.parallel
        segmented = self._segmented(cfg)
        seg_key = (p.seq_segments, p.tp if p.sequence_parallel else 1) if segmented else None
        key = (id(cm), blocks.start, blocks.stop, split, seg_key)
        if key not in self._sums:
            self._sums[key] = self._block_sums_of(cfg, cm, blocks, split, segmented)
        return self._sums[key]

    def _block_sums_of(self, cfg, cm, blocks, split, segmented) -> tuple:
        x = _stage(cm, blocks)
        total = x.F.total + x.B.total + x.W.total
        fb = x.F.total + x.B.total + (0.0 if split else x.W.total)
        if not segmented:
            return total, fb, x.F.total, x.B.total + (0.0 if split else x.W.total)
        less, f0, g0 = 0.0, 0.0, 0.0
        n_layers = cfg.model.n_layers
        modes = Counter(layer_mode(cfg.recompute, i - 1) for i in blocks if 0 < i <= n_layers)
        for mode, n in modes.items():
            excess, f, b, w = self._layer_floor(cfg, mode)
            less, f0, g0 = less + n * excess, f0 + n * f, g0 + n * (b + (0.0 if split else w))
        return total - less, fb - less, f0, g0  # (the excess is in F and B, never in W)

    def _segment_sums(self, cfg: Config, blocks: range, split: bool) -> tuple:
        """_block_sums from the segments' own costs: summed over the segments, and the
        smallest segment's F and chain backward."""
        p = cfg.parallel
        shape = (p.pp, p.dp, p.cp, p.tp)
        links = (group_link(self.cluster, shape, ("tp",)), group_link(self.cluster, shape, ("cp",)))
        key = (p.tp, p.cp, _mbs(cfg), p.sequence_parallel,
               cfg.recompute.mode, p.seq_segments, links)  # fmt: skip
        if key not in self._models:
            self._models[key] = (cfg, CostModel(cfg, self.cluster, self.runtime, self.cal))
        cm = self._models[key][1]
        costs = [_stage(cm, blocks, seg) for seg in range(p.seq_segments)]
        grad = [x.B.total + (0.0 if split else x.W.total) for x in costs]
        return (
            sum(x.F.total + x.B.total + x.W.total for x in costs),
            sum(x.F.total for x in costs) + sum(grad),
            min(x.F.total for x in costs),
            min(grad),
        )

    def _layer_floor(self, cfg: Config, mode: str) -> tuple[float, float, float, float]:
        """For one layer at recompute `mode`: its attention core's seconds (F, B and the
        recompute's share) less the same FLOPs at e_max (4·hd·pairs per head forward,
        backward 2.5× fused or 2× unfused: its four GEMMs over the full score matrix),
        and the first Seq1F1B segment's GEMM seconds of F, B (with the recompute's F under
        full) and W."""
        plain, cm = self._plain(cfg)
        p = cfg.parallel
        seg_key = (p.seq_segments, p.tp if p.sequence_parallel else 1)
        key = (id(cm), mode, seg_key)
        if key not in self._layers:
            if seg_key not in self._segments:
                self._segments[seg_key] = segment_bounds(cfg)
            start, end = self._segments[seg_key][0]
            x, dev = shapes(plain), cm.dev
            fwd, bwd = cm._attention(x)
            flops = 4.0 * x.hd * x.pairs * x.b * x.h
            best = dev.peak * dev.cal.gemm
            bwd_flops = (2.5 if cm.attention in ("fused", "ring") else 2.0) * flops
            again = 1 if mode in ("full", "selective") else 0
            excess = (fwd - flops / best) * (1 + again) + (bwd - bwd_flops / best)
            first = dataclasses.replace(x, q=end - start, n=x.b * (end - start))
            gemms = cm._gemms(first)
            f = sum(dev.gemm(m, n, k, 1, cm.c) for m, n, k in gemms)
            b = sum(dev.gemm(m, k, n, 1, cm.c) for m, n, k in gemms)
            w = sum(dev.gemm(k, n, m, 1, cm.c) for m, n, k in gemms)
            self._layers[key] = (excess, f, b + (f if mode == "full" else 0.0), w)
        return self._layers[key]

    def _acts_bound(self, cfg: Config) -> bool:
        """Whether the whole sequence's activations bound a microbatch's: always unsegmented;
        under Seq1F1B unless the attention keeps its s² probabilities (the math path), whose
        segments keep less (config/memory.layer_terms: every other term grows with tokens)."""
        return not self._segmented(cfg) or attention_path(cfg, self.device) != "math"

    def _activations(self, cfg: Config, blocks: range) -> float:
        """One microbatch's activation bytes through `blocks` (over its Seq1F1B segments),
        summed per block (embedding, layer by recompute mode, head): config/memory.py's terms
        add block by block."""
        n_layers, total = cfg.model.n_layers, 0.0
        p = cfg.parallel
        mesh = _block_key(cfg, p.seq_segments if self._segmented(cfg) else 1)
        if (mesh, blocks.start, blocks.stop) in self._acts:
            return self._acts[mesh, blocks.start, blocks.stop]
        for b in blocks:
            if b in (0, n_layers + 1):
                kind = "embedding" if b == 0 else "head"
            else:
                kind = layer_mode(cfg.recompute, b - 1)
            if (mesh, kind) not in self._acts:
                self._acts[mesh, kind] = chunk_activations(cfg, range(b, b + 1), self.device)
            total += self._acts[mesh, kind]
        self._acts[mesh, blocks.start, blocks.stop] = total
        return total

    # -- the exact memory ------------------------------------------------------------------

    def memory(self, cfg: Config) -> tuple[float, tuple[int, int]]:
        """perf/memory.plan(cfg).max and .argmax, without timing the schedule: a rank runs its
        actions one after another, so the events train/memory.peak_inflight sorts by time
        (an F's allocation at its start, a B's, W's or BW's release at its end, releases
        first at a tie) come in the order of the rank's action list, and the peak in flight
        is the running sum's in that order (tests/test_plan_search.py holds the two equal)."""
        p = cfg.parallel
        place = placement_of(cfg) if p.pp > 1 else Placement(1, 1)
        stages = self._stages(cfg, place.num_stages)
        seg_ids = segments(cfg)
        n_seg = len(seg_ids)
        codes = self._codes(cfg, n_seg) if p.pp > 1 else None
        best, where = -math.inf, (0, 0)
        for r in range(place.pp):
            chunks = [stages[place.stage(r, k)] for k in range(place.vpp)]
            size = [[self._block_bytes(cfg, b, i, False) for i in seg_ids] for b in chunks]
            acts = tuple(sum(per_seg) for per_seg in size)
            inflight = 1.0
            if codes is not None:
                unit = sum(x for per_seg in size for x in per_seg) or 1.0
                table = np.zeros(4 * place.vpp * n_seg)
                for c, blocks in enumerate(chunks):
                    for k, i in enumerate(seg_ids):
                        held = size[c][k] / unit
                        keep = self._block_bytes(cfg, blocks, i, True) / unit
                        for kind, delta in _DELTA.items():
                            table[(KIND_INDEX[kind] * place.vpp + c) * n_seg + k] = delta(
                                held, keep
                            )
                live = np.cumsum(table[codes[r]])  # sequential, as the running sum
                inflight = round(max(0.0, float(live.max())) if len(live) else 0.0, 9)
            for tp_rank in range(p.tp):
                n = sum(self._chunk_params(cfg, blocks, tp_rank) for blocks in chunks)
                states = n * WEIGHT_BYTES + n * GRAD_BYTES + optimizer_bytes(n, cfg)
                total = states + sum(acts) * inflight
                if total > best:
                    best, where = total, (r, tp_rank)
        return best, where

    def _codes(self, cfg: Config, n_seg: int) -> list[np.ndarray]:
        """Per rank, the configured schedule's actions (config/stages.schedule_of) as
        indices (kind · vpp + chunk) · segments + segment; cached per schedule."""
        key = _schedule_id(cfg)
        if key not in self._schedules:
            vpp = cfg.parallel.vpp
            self._schedules[key] = [
                np.array(
                    [(KIND_INDEX[a.kind] * vpp + a.chunk) * n_seg + a.seg for a in actions],
                    dtype=np.int64,
                )
                for _, actions in sorted(schedule_of(cfg).items())
            ]
        return self._schedules[key]

    def _block_bytes(self, cfg: Config, blocks: range, segment: int | None, kept: bool) -> float:
        """train/memory._segment_activations (kept: chunk_deferred) of `blocks`, summed block
        by block in the same order from each block's cached share."""
        p = cfg.parallel
        mesh = _block_key(cfg, p.seq_segments if self._segmented(cfg) else 1)
        n_layers, total = cfg.model.n_layers, 0.0 if not kept else 0
        for b in blocks:
            if kept and b == 0:
                continue
            kind = "E" if b == 0 else "H" if b == n_layers + 1 else layer_mode(cfg.recompute, b - 1)
            key = (mesh, kind, segment, kept)
            if key not in self._bytes:
                one = range(b, b + 1)
                if kept:
                    self._bytes[key] = chunk_deferred(cfg, one, segment)
                else:
                    self._bytes[key] = _segment_activations(cfg, one, self.device, segment)
            total += self._bytes[key]
        return float(total)


_MEMORY_OPTIONS = {"memory", "w_share"}  # zb_auto's: the limit and config/stages.zb_w_share


def _schedule_id(cfg: Config) -> tuple:
    """What config/stages.schedule_of(cfg) depends on (perf/pipeline.schedule_key), narrowed
    for a schedule with a memory limit to the limit and the M_W / M_B share it reads
    (config/stages.zb_w_share) instead of the whole config: zb_auto builds in seconds."""
    key = schedule_key(cfg)
    p = cfg.parallel
    extra = set(SCHEDULES[p.schedule].options) - _PLAIN_OPTIONS
    share = getattr(config_stages, "zb_w_share", None)
    if not extra or not extra <= _MEMORY_OPTIONS or share is None:
        return key
    return (*key[:7], p.zb_memory, share(cfg))


def _stage(cm: CostModel, blocks: range, segment: int | None = None) -> BlockCosts:
    """cm.stage(blocks, segment) from its blocks counted by kind (the embedding, the layers of
    each recompute mode, the head): the bounds sum a few thousand stages per search, and a
    loop over a 1T model's blocks each time was most of a search's time. The same sum as
    cm.stage up to float rounding (EPS covers it)."""
    n_layers, rec = cm.cfg.model.n_layers, cm.cfg.recompute
    layers = range(max(blocks.start, 1) - 1, min(blocks.stop, n_layers + 1) - 1)
    covered = len(layers) if not rec.layers else max(0, min(layers.stop, rec.layers) - layers.start)
    parts = [(0, 1 if 0 in blocks else 0), (n_layers + 1, 1 if n_layers + 1 in blocks else 0)]
    if layers:  # blocks 1 + i for layer i; the first rec.layers layers take rec.mode
        parts += [(1 + layers.start, covered), (n_layers, len(layers) - covered)]
    f = b = w = ZERO
    for index, count in parts:
        if count <= 0:
            continue
        cost = cm.block(index, segment)
        fixed_f, fixed_b = cm._fixed(index)
        f = f + (cost.F + Work(compute=fixed_f)) * count
        b = b + (cost.B + Work(compute=fixed_b)) * count
        w = w + cost.W * count
    return BlockCosts(f, b, w)


def _block_key(cfg: Config, *extra) -> tuple:
    """What a block's costs and saved bytes depend on here: tp, cp, micro-batch size, sequence
    parallelism, recompute, `extra` (the groups' links, the segment count), and whether a
    pipeline runs: without one the head makes its grads in forward and the tied lookup adds
    into the head's table grad (config/memory.head_grad_in_forward, tied_lookup_with_head)."""
    p = cfg.parallel
    return (p.tp, p.cp, _mbs(cfg), p.sequence_parallel, cfg.recompute.mode, *extra, p.pp == 1)


def _mbs(cfg: Config) -> int:
    """config.Derived's micro-batch size, without building Derived (a hot path here)."""
    return cfg.train.global_batch // (cfg.parallel.dp * cfg.parallel.microbatches)


def _seg_key(cfg: Config) -> tuple[int, int]:
    """What a config's Seq1F1B segment bounds depend on besides the model."""
    p = cfg.parallel
    return p.seq_segments, p.tp if p.sequence_parallel else 1


_DELTA = {  # change of live activations (train/memory._change) by kind: (size, kept) -> delta
    FORWARD: lambda size, kept: size,
    INPUT_GRAD: lambda size, kept: kept - size,
    WEIGHT_GRAD: lambda size, kept: -kept,
    FULL_BACKWARD: lambda size, kept: -size,
}


# -- the search -----------------------------------------------------------------------------


def search(
    base: Config,
    gpus: int,
    cluster: Cluster,
    runtime: Runtime = MEGAPIPE,
    cal: Calibration = CALIBRATION,
    fixed: dict[str, Any] | None = None,
    top: int = TOP,
) -> SearchResult:
    """The `top` fastest candidates that pass the config rules and fit in the GPU's memory,
    best first (module docstring). PlanError when there are none."""
    began, cpu = time.perf_counter(), time.process_time()
    fixed = fixed or {}
    check_world(gpus, fixed)
    space = candidates(base, gpus, cluster.gpus_per_node, fixed)
    counts = dict.fromkeys(
        ("candidates", "skipped_costly", "invalid", "over_memory_bound", "over_memory",
         "over_memory_inflight", "bounded", "projected", "pruned"), 0)  # fmt: skip
    counts["candidates"] = len(space)
    bound = Bounds(base, cluster, runtime, cal)
    hbm = cluster.hbm_bytes
    groups: dict[tuple, list[Candidate]] = {}
    for c in space:
        if too_costly(c):
            counts["skipped_costly"] += 1
        else:
            groups.setdefault(bound.group(c), []).append(c)

    # best first: (bound, order, level, payload). Level 0: a group under its coarse bound;
    # 1: a Seq1F1B candidate under its cheap bound; 2: a candidate under its own bound; 3: a
    # projection under its step time (exact). A popped entry is refined and pushed back under
    # the larger bound; a projection popped is the next best.
    heap: list[tuple] = []
    order = itertools.count()
    heavy: list[tuple[float, int, Candidate]] = []
    errors: list[Exception] = []
    for members in groups.values():
        pipedream = any(c.pp > 1 and c.schedule == "pipedream_async" for c in members)
        try:
            t_lb, m_lb = bound.coarse(members[0], pipedream)
        except (ConfigError, ValueError) as err:
            counts["invalid"] += len(members)
            errors.append(err)
            continue
        if m_lb > hbm * (1 + EPS):
            counts["over_memory_bound"] += len(members)
            heavy += [(m_lb, 0, c) for c in members]
            continue
        heapq.heappush(heap, (t_lb * (1 - EPS), next(order), 0, members))
    ranked: list[Ranked] = []
    steps: list[float] = []  # the projected step times so far, sorted
    while heap and len(ranked) < top:
        lb, _, level, payload = heapq.heappop(heap)
        if level == 3:
            ranked.append(payload)
            continue
        if level in (1, 2):  # a candidate under its bound: would it fit in the time it needs?
            c, cb = payload
            kth = steps[top - 1] if len(steps) >= top else math.inf
            if cb.memory_by(kth) > hbm * (1 + EPS):
                counts["over_memory_inflight"] += 1
                heavy.append((cb.memory, 1, c))
                continue
        if level == 2:
            cfg, mem, where = _exact_memory(c, base, bound, counts, errors, hbm)
            if mem == math.inf:
                continue
            if cfg is None:
                counts["over_memory"] += 1
                heavy.append((mem, 2, c))
                continue
            proj = project(cfg, cluster, runtime, cal, memory=False)
            proj = dataclasses.replace(
                proj, peak_memory_gib=mem / GIB, memory_rank=where, fits=True
            )
            counts["projected"] += 1
            bisect.insort(steps, proj.step_time_s)
            entry = Ranked(c, cfg, proj)
            heapq.heappush(heap, (max(lb, proj.step_time_s), next(order), 3, entry))
            continue
        for c in payload if level == 0 else [payload[0]]:
            fine = level == 1 or not (c.pp > 1 and SCHEDULES[c.schedule].segmented)
            try:
                cb = bound(c, fine)
            except (ConfigError, ValueError) as err:
                counts["invalid"] += 1
                errors.append(err)
                continue
            counts["bounded"] += fine
            if cb.memory > hbm * (1 + EPS):
                counts["over_memory_bound"] += 1
                heavy.append((cb.memory, 1, c))
                continue
            entry = (max(lb, cb.time * (1 - EPS)), next(order), 2 if fine else 1, (c, cb))
            heapq.heappush(heap, entry)
    counts["pruned"] = sum(len(p) if level == 0 else 1 for _, _, level, p in heap)

    if not ranked:
        if not heavy:
            why = f": {errors[0]}" if errors else ""
            raise PlanError(f"no configuration of {gpus} GPUs passes the config rules{why}")
        gib, least = _least_memory(heavy, base, bound)
        where = f" ({describe(least)})" if least is not None else ""
        plural = "s" if gpus > 1 else ""
        raise NothingFits(
            f"nothing fits in {cluster.hbm_gib:g} GiB per GPU ({cluster.name}) on {gpus} "
            f"GPU{plural}: "
            f"the least any configuration needs is {gib:.1f} GiB per GPU{where}; use more "
            "GPUs, a GPU with more memory, or a smaller model or batch",
            gib,
            least,
        )
    return SearchResult(
        ranked, gpus, cluster, runtime, time.perf_counter() - began, counts,
        time.process_time() - cpu,
    )  # fmt: skip


def _exact_memory(
    c: Candidate, base: Config, bound: Bounds, counts: dict, errors: list, hbm: float = math.inf
) -> tuple[Config | None, float, tuple[int, int]]:
    """(config, peak bytes, its (pp, tp) rank), as perf/memory.plan's (Bounds.memory); the
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
        "| # | tp | pp | dp | cp | vpp | schedule | m | mbs | recompute | sp | zero | step s "
        "| TFLOP/s | MFU | bubble | GiB | " + " | ".join(name for _, name in BREAKDOWN) + " |"
    )
    rule = "|" + "---:|" * 6 + "---|" + "---:|" * 2 + "---|" + "---:|" * (8 + len(BREAKDOWN))
    lines = [head, rule]
    for i, r in enumerate(result.ranked, 1):
        c, p = r.candidate, r.projection
        mbs = r.config.derived.micro_batch_size
        parts = " | ".join(f"{p.breakdown[k] / p.step_time_s:.0%}" for k, _ in BREAKDOWN)
        lines.append(
            f"| {i} | {c.tp} | {c.pp} | {c.dp} | {c.cp} | {c.vpp if c.pp > 1 else '-'} "
            f"| {c.schedule_label} | {c.microbatches} | {mbs} | {c.recompute} "
            f"| {'on' if c.sequence_parallel else '-'} | {c.zero} | {p.step_time_s:.3g} "
            f"| {p.tflops_per_gpu:.1f} | {p.mfu:.1%} | {p.bubble_fraction:.1%} "
            f"| {p.peak_memory_gib:.1f} | {parts} |"
        )
    return "\n".join(lines)


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
