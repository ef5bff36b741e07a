"""The planner's lower bounds (perf/search.py prunes the space with them): for each candidate
two from arithmetic alone, no schedule built: memory (each rank's weights and AdamW state
plus one microbatch's activations through its chunks: every schedule has at least that in
flight on every rank when the last chunk's forward of the first microbatch starts; float32
grads need not exist by then, so the grads count only where a bound takes the larger) and step
time (below); and a candidate's exact memory (`Bounds.memory`: perf/memory_cache.plan's peak without
timing the schedule).

The time bound, from the per-stage costs the projection uses (perf/costs.py, summed per run of
blocks by perf/block_times.py): a rank cannot start before the first microbatch's forwards on
the stages below its lowest one (head), then runs all of its actions one after another (busy);
the last backward that sends a gradient from its lowest stage (its last action, or under a B/W
split its last B, after all of its F and B) is followed by the input-grad chain down to stage 0
(tail). So the pipeline ends no earlier than max over ranks of head + busy and head + (busy,
less W under a split) + tail; the dp reduction adds at least its last bucket (overlapped) or
all of it (not overlapped), then the optimizer step. For 1F1B on equal stages this is its
makespan, (m + pp − 1)·(F + B).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from megapipe.config import Config
from megapipe.config.flops import held_expert_params, is_moe_layer
from megapipe.config.memory_backward import chunk_backward_bytes, weight_grads_queued
from megapipe.config.memory_plan import (
    B_GRADS_AT,
    B_GRADS_MADE,
    GRADS_MADE,
    BlockBytesKey,
    block_activations,
    block_deferred,
    block_role,
    chunk_activations,
    complete_rank,
    live_change,
    rank_head_transient,
)
from megapipe.config.memory_terms import attention_path, segments
from megapipe.config.muon_terms import optimizer_lower_bound
from megapipe.config.pipeline_split import partition, placement_of
from megapipe.config.states import (
    grads_bytes,
    local_grads_bytes,
    local_grads_transient,
    weights_bytes,
)
from megapipe.perf.block_times import BlockTimes, segment_key, segmented
from megapipe.perf.cluster import Cluster
from megapipe.perf.cost_terms import Calibration
from megapipe.perf.data_parallel import dp_plan, optimizer_plan
from megapipe.perf.memory_cache import chunk_params, chunk_units
from megapipe.perf.pipeline import ScheduleKey, built_schedule
from megapipe.perf.software import Runtime
from megapipe.perf.space import Candidate
from megapipe.plan.actions import FORWARD, Placement
from megapipe.plan.dag import KIND_INDEX
from megapipe.plan.schedules import SCHEDULES

EPS = 1e-9  # relative slack on the bounds: they sum the same floats in another order


@dataclass(frozen=True)
class Bound:
    """A candidate's lower bounds: step time, peak memory, and what bounds its memory if its
    step is to take at most a given time (`memory_by`)."""

    time: float
    memory: float
    states: list[float]  # per pp rank: weights and AdamW bytes (tp rank 0; _held)
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
    placement; `memory` is a candidate's exact peak. The blocks' seconds, Seq1F1B's included,
    are perf/block_times.py's (`times`).
    """

    def __init__(self, base: Config, cluster: Cluster, runtime: Runtime, cal: Calibration):
        self.base, self.cluster, self.runtime, self.cal = base, cluster, runtime, cal
        self.device = getattr(cluster, "device", "cuda")  # the kernels the memory plan counts
        self.times = BlockTimes(cluster, runtime, cal)
        self._parts: dict[int, list[range]] = {}
        self._stage_costs: dict[tuple, tuple] = {}
        self._pipes: dict[tuple, tuple] = {}
        self._states: dict[tuple, tuple] = {}
        self._acts: dict[tuple, float] = {}
        self._counts: dict[tuple, int] = {}
        self._unit_counts: dict[tuple, tuple] = {}  # chunk_units by chunk shape
        self._bytes: dict[tuple, float] = {}
        self._ids: dict[BlockBytesKey, int] = {}
        self._schedules: dict[tuple, dict] = {}
        self._grads_from: dict[tuple, list] = {}
        self._backwards: dict[tuple, float] = {}

    @staticmethod
    def group(c: Candidate) -> tuple:
        """The candidates `coarse` bounds together: one mesh, micro-batch count, sequence
        parallelism, recompute, Seq1F1B segment count, zero, ep and dp_shard; any schedule and
        vpp."""
        return (*Bounds._work(c), c.zero, c.ep, c.dp_shard)

    @staticmethod
    def _work(c: Candidate) -> tuple:
        """What a candidate's pipeline bound reads besides its schedule and vpp: the group's
        mesh, micro-batch count, sequence parallelism, recompute, segments and train.fp8 (not
        zero)."""
        segs = c.seq_segments if c.pp > 1 and SCHEDULES[c.schedule].segmented else 1
        cp = (c.cp, c.cp_comm, c.cp_a2a)
        return (c.tp, *cp, c.pp, c.dp, c.microbatches, c.sequence_parallel, c.recompute, segs,
                c.fp8)  # fmt: skip

    # -- the group bound -------------------------------------------------------------------

    def coarse(self, c: Candidate, pipedream: bool = False) -> tuple[float, float]:
        """(step time, peak memory) bounds for c's whole group, whatever the schedule and
        vpp: the busiest rank has at least the mean work, m · (F + B + W of every block) / pp,
        and the mean dp reduction after it when the runtime does not overlap it; the first
        microbatch (segment) goes forward through every stage and backward back; then the
        optimizer's mean step. Memory: the mean over pp ranks of the states and one
        microbatch's activations. `pipedream`: a group that steps inside its backwards (no
        dp or optimizer after the pipeline)."""
        tp, cp, pp, dp, mb = c.tp, c.cp, c.pp, c.dp, c.microbatches
        cfg = c.config(self.base, check=False)
        plain, cm = self.times.plain(cfg)
        everything = range(0, cfg.model.n_layers + 2)
        total, fb, f0, g0 = self.times.block_sums(cfg, everything, split=True)
        busy = mb * total / pp
        chain = f0 + g0
        acts = self._activations(plain, everything) if self._acts_bound(cfg) else 0.0
        params = self._params(cfg) / pp  # a rank's mean parameters (tp rank 0)
        experts = held_expert_params(cfg, everything) / pp  # the routed experts' among them
        # full-size grads wait for the reduction, unless each microbatch's are reduce-scattered
        # as they are made (zero=3, zero=2 per microbatch): then only the shard is held
        grads = grads_bytes(params, cfg, experts) if local_grads_transient(cfg) else (
            local_grads_bytes(params, cfg))  # fmt: skip
        memory = _held(params, cfg, experts) + max(grads, acts / pp)
        if pipedream:
            return max(busy, chain), memory
        shape = (pp, dp, cp, tp)
        opt = optimizer_plan(cfg, self.cluster, self.runtime, cm, shape, [[params]], [[experts]])
        reduce = 0.0
        if not self.runtime.dp_overlap:  # ring times are affine in bytes: the mean's
            plan = dp_plan(cfg, self.cluster, self.runtime, shape, [[params]],
                           self.runtime.grad_bytes or cm.c, [[experts]])  # fmt: skip
            reduce = plan.total[0]
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

    def _units(self, cfg: Config, blocks: range, tp_rank: int):
        """perf/memory_cache.chunk_units, cached by what it depends on here (the model is
        fixed): tp, sp, ep, the chunk's shape and which of its layers are MoE layers."""
        p, n_layers = cfg.parallel, cfg.model.n_layers
        moe = tuple(is_moe_layer(cfg.model, b - 1) for b in blocks if 1 <= b <= n_layers)
        ends = (0 in blocks, n_layers + 1 in blocks)
        key = (p.tp, p.sequence_parallel, p.ep, *ends, len(blocks), tp_rank, moe)
        if key not in self._unit_counts:
            self._unit_counts[key] = chunk_units(cfg, blocks, tp_rank)
        return self._unit_counts[key]

    def _chunk_params(self, cfg: Config, blocks: range, tp_rank: int) -> int:
        """perf/memory_cache.chunk_params, cached by what it depends on here (the model is fixed):
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
        key = (self._work(c), c.ep, style, vpp, split, fine)
        if key not in self._pipes:
            cfg = c.config(self.base, check=False)
            self._pipes[key] = self._pipeline(c, cfg, split, fine)
        ends, chain, acts, spans, firsts = self._pipes[key]
        skey = (c.tp, c.cp, c.pp, c.dp, c.sequence_parallel, style, vpp, c.zero, c.ep, c.dp_shard)
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
        is_segmented = segmented(cfg)
        fine = fine and is_segmented
        plain, cm = self.times.plain(cfg)
        key = (id(cm), place.num_stages, split, segment_key(cfg) if is_segmented else None, fine)
        if key not in self._stage_costs:
            stages = self._stages(cfg, place.num_stages)
            sums = self.times.segment_sums if fine else self.times.block_sums
            per = [sums(cfg, blocks, split) for blocks in stages]
            head = list(itertools.accumulate((x[2] for x in per), initial=0.0))
            tail = list(itertools.accumulate((x[3] for x in per), initial=0.0))
            with_acts = fine or self._acts_bound(cfg)
            acts = [self._activations(cfg if fine else plain, b) if with_acts else 0.0
                    for b in stages]  # fmt: skip
            self._stage_costs[key] = ([x[0] for x in per], [x[1] for x in per], head, tail, acts)
        total, fb, head, tail, stage_acts = self._stage_costs[key]
        # microbatches through each local chunk: all, or under DualPipe's dual placement the
        # half going that chunk's way (a microbatch runs one chunk per rank)
        mb = cfg.parallel.microbatches * place.passes / place.vpp
        ends, chain, acts, spans, firsts = [], 0.0, [], [], []
        n = place.num_stages
        for r in range(place.pp):
            own = [place.stage(r, k) for k in range(place.vpp)]
            low = min(own)
            ends.append(head[low] + mb * sum(total[s] for s in own))
            chain = max(chain, head[low] + mb * sum(fb[s] for s in own) + tail[low])
            one = [stage_acts[s] for s in own]  # one microbatch's: every chunk, or one (dual)
            acts.append(sum(one) if place.passes == place.vpp else min(one))
            spans.append(head[n] - head[low] + tail[n] - tail[low])
            firsts.append(stage_acts[low])
        return ends, chain, acts, spans, firsts

    def _state(self, cfg: Config):
        """Per rank the state bytes (weights, AdamW: _held) and the dp reduction's least part
        after the rank's last action; the optimizer step (seconds)."""
        p = cfg.parallel
        place = placement_of(cfg) if p.pp > 1 else Placement(1, 1)
        stages = self._stages(cfg, place.num_stages)
        held = [
            [self._chunk_params(cfg, stages[place.stage(r, k)], 0) for k in range(place.vpp)]
            for r in range(place.pp)
        ]
        experts = [
            [held_expert_params(cfg, stages[place.stage(r, k)]) for k in range(place.vpp)]
            for r in range(place.pp)
        ]
        states = [_held(sum(h), cfg, sum(e)) for h, e in zip(held, experts)]
        _, cm = self.times.plain(cfg)
        shape = (p.pp, p.dp, p.cp, p.tp)
        dp = dp_plan(cfg, self.cluster, self.runtime, shape, held,
                     self.runtime.grad_bytes or cm.c, experts)  # fmt: skip
        opt = optimizer_plan(cfg, self.cluster, self.runtime, cm, shape, held, experts)
        last_rank = place.locate(place.num_stages - 1)[0]
        after = [
            (min(dp.last_bucket[r]) if self.runtime.dp_overlap else dp.total[r])
            + (dp.tied if r in (0, last_rank) else 0.0)
            for r in range(place.pp)
        ]
        return states, after, opt.step + opt.gather

    # -- shared parts ----------------------------------------------------------------------

    def _stages(self, cfg: Config, n_stages: int) -> list[range]:
        if n_stages not in self._parts:  # the partition depends on the model and balance only
            self._parts[n_stages] = partition(cfg, n_stages)
        return self._parts[n_stages]

    def _acts_bound(self, cfg: Config) -> bool:
        """Whether the whole sequence's activations bound a microbatch's: always unsegmented;
        under Seq1F1B unless the attention keeps its s² probabilities (the math path), whose
        segments keep less (config/memory_terms.layer_terms: every other term grows with tokens)."""
        return not segmented(cfg) or attention_path(cfg, self.device) != "math"

    def _activations(self, cfg: Config, blocks: range) -> float:
        """One microbatch's activation bytes through `blocks` (over its Seq1F1B segments),
        summed per block (embedding, layer by recompute mode, head): config/memory_terms.py's terms
        add block by block."""
        total, mesh = 0.0, self._bytes_id(cfg)
        if (mesh, blocks.start, blocks.stop) in self._acts:
            return self._acts[mesh, blocks.start, blocks.stop]
        for b in blocks:
            role = block_role(cfg, b)
            if (mesh, role) not in self._acts:
                self._acts[mesh, role] = chunk_activations(cfg, range(b, b + 1), self.device)
            total += self._acts[mesh, role]
        self._acts[mesh, blocks.start, blocks.stop] = total
        return total

    # -- the exact memory ------------------------------------------------------------------

    def memory(self, cfg: Config) -> tuple[float, tuple[int, int]]:
        """perf/memory_cache.plan(cfg).max and .argmax, without timing the schedule: a rank runs its
        actions one after another, so the events config/memory_plan.peak_inflight sorts by time
        (an F's allocation at its start, a B's, W's or BW's release at its end, releases
        first at a tie) come in the order of the rank's action list, and the peak in flight
        is the running sum's in that order (tests/test_plan_search.py holds the two equal)."""
        p = cfg.parallel
        place = placement_of(cfg) if p.pp > 1 else Placement(1, 1)
        stages = self._stages(cfg, place.num_stages)
        seg_ids = segments(cfg)
        n_seg = len(seg_ids)
        codes = self._codes(cfg, n_seg) if p.pp > 1 else None
        mesh = self._bytes_id(cfg)
        best, where = -math.inf, (0, 0)
        for r in range(place.pp):
            chunks = [stages[place.stage(r, k)] for k in range(place.vpp)]
            size = [[self._block_bytes(cfg, mesh, b, i, False) for i in seg_ids] for b in chunks]
            acts = tuple(sum(per_seg) for per_seg in size)
            inflight, with_grads = 1.0, 1.0 if p.microbatches > 1 else 0.0
            with_b = with_grads
            if codes is not None:
                unit = sum(x for per_seg in size for x in per_seg) or 1.0
                table = np.zeros(4 * place.vpp * n_seg)
                for c, blocks in enumerate(chunks):
                    for k, i in enumerate(seg_ids):
                        held = size[c][k] / unit
                        keep = self._block_bytes(cfg, mesh, blocks, i, True) / unit
                        for kind, index in KIND_INDEX.items():
                            change = live_change(kind, held, keep)
                            table[(index * place.vpp + c) * n_seg + k] = change
                live = np.cumsum(table[codes[r]])  # sequential, as the running sum
                inflight = round(max(0.0, float(live.max())) if len(live) else 0.0, 9)
                # from the first BW or W on (memory_plan.peak_inflight's GRADS_MADE)
                made = self._first_grads(cfg, n_seg, GRADS_MADE)[r]
                after = live[made:] if made is not None else live[:0]
                with_grads = round(max(0.0, float(after.max())) if len(after) else 0.0, 9)
                with_b = self._with_b(cfg, n_seg, r, live)
            head = rank_head_transient(cfg, chunks, self.device, self.cluster.hbm_bytes)
            back = max(self._backward(cfg, mesh, blocks) for blocks in chunks)
            count = functools.partial(self._chunk_params, cfg)
            units = functools.partial(self._units, cfg)

            def saved(block: int) -> float:  # _activations' per-role bytes of one block
                key = (mesh, block_role(cfg, block))
                if key not in self._acts:
                    self._acts[key] = chunk_activations(cfg, range(block, block + 1), self.device)
                return self._acts[key]

            stage = (acts, (inflight, with_grads, with_b), head, back)
            for tp_rank in range(p.tp):
                rank = complete_rank(
                    cfg, (r, tp_rank), chunks, count, (units, saved), stage, self.device
                )
                total = rank.peak
                if total > best:
                    best, where = total, (r, tp_rank)
        return best, where

    def _codes(self, cfg: Config, n_seg: int) -> list[np.ndarray]:
        """Per rank, the configured schedule's actions (config/pipeline_split.schedule_of) as
        indices (kind · vpp + chunk) · segments + segment; cached per schedule."""
        key = ScheduleKey.of(cfg)
        if key not in self._schedules:
            vpp = cfg.parallel.vpp
            self._schedules[key] = [
                np.array(
                    [(KIND_INDEX[a.kind] * vpp + a.chunk) * n_seg + a.seg for a in actions],
                    dtype=np.int64,
                )
                for _, actions in sorted(built_schedule(key).items())
            ]
        return self._schedules[key]

    def _kinds(self, cfg: Config, n_seg: int) -> list[np.ndarray]:
        """Per rank, its actions' KIND_INDEX in `_codes`' order."""
        return [c // (cfg.parallel.vpp * n_seg) for c in self._codes(cfg, n_seg)]

    def _first_grads(self, cfg: Config, n_seg: int, made_by: tuple) -> list[int | None]:
        """Per rank, the index of its first action of the kinds `made_by` in `_codes` (None: it
        has none)."""
        key = (ScheduleKey.of(cfg), n_seg, made_by)
        if key not in self._grads_from:
            wanted = [KIND_INDEX[k] for k in made_by]
            made = [np.flatnonzero(np.isin(k, wanted)) for k in self._kinds(cfg, n_seg)]
            self._grads_from[key] = [int(m[0]) if len(m) else None for m in made]
        return self._grads_from[key]

    def _with_b(self, cfg: Config, n_seg: int, r: int, live: np.ndarray) -> float:
        """memory_plan.peak_inflight's B_GRADS_MADE on rank `r` from its running sum `live`:
        the live bytes while each F, B or BW after its first B or BW runs (an F's own part
        allocated: its index's; a B's still held: the index before)."""
        made = self._first_grads(cfg, n_seg, B_GRADS_MADE)[r]
        if made is None:
            return 0.0
        kinds = self._kinds(cfg, n_seg)[r][made + 1 :]
        index = np.arange(made + 1, made + 1 + len(kinds))
        during = np.where(kinds == KIND_INDEX[FORWARD], index, index - 1)
        at = np.isin(kinds, [KIND_INDEX[k] for k in B_GRADS_AT])
        values = live[during[at]]
        return round(max(0.0, float(values.max())) if len(values) else 0.0, 9)

    def _backward(self, cfg: Config, mesh: int, blocks: range) -> float:
        """config/memory_backward.chunk_backward_bytes, cached by what it reads besides the
        block bytes' key (`mesh`: _bytes_id): a B/W split, per-microbatch reduction's grads, ep."""
        p = cfg.parallel
        split = weight_grads_queued(cfg)
        key = (mesh, blocks.start, blocks.stop, split, local_grads_transient(cfg), p.ep)
        if key not in self._backwards:
            self._backwards[key] = chunk_backward_bytes(cfg, blocks, self.device)
        return self._backwards[key]

    def _bytes_id(self, cfg: Config) -> int:
        """A small number for cfg's BlockBytesKey (config/memory_plan.py: what a block's bytes
        read of the config), so that the per-block caches hash an int."""
        return self._ids.setdefault(BlockBytesKey.of(cfg), len(self._ids))

    def _block_bytes(
        self, cfg: Config, mesh: int, blocks: range, segment: int | None, kept: bool
    ) -> float:
        """config/memory_plan.segment_activations (kept: chunk_deferred) of `blocks`, summed
        block by block in the same order from each block's cached share; `mesh`: _bytes_id."""
        total = 0.0 if not kept else 0
        for b in blocks:
            if kept and b == 0:
                continue
            key = (mesh, block_role(cfg, b), segment, kept)
            if key not in self._bytes:
                if kept:
                    self._bytes[key] = float(block_deferred(cfg, b, segment))
                else:
                    self._bytes[key] = 0.0 + block_activations(cfg, b, self.device, segment)
            total += self._bytes[key]
        return float(total)


def _held(n_params: float, cfg: Config, experts: float = 0) -> float:
    """The state a rank holds at every moment of the step: weights and AdamW's (at least
    Muon's: config/muon_terms.optimizer_lower_bound). Its grads are left to the bounds (float32
    ones need not exist at the activation peak: config/memory_plan.peak_inflight's
    with_grads), except where a bound adds them itself."""
    return weights_bytes(n_params, cfg, experts) + optimizer_lower_bound(n_params, cfg, experts)
