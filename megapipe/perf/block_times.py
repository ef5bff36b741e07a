"""The seconds the planner's time bounds sum (perf/bounds.py): one microbatch's F, B and W
through a run of blocks, from the cost model the projection uses (perf/costs.py), cached over
a search's candidates by what the costs depend on.

Seq1F1B: `block_sums` prices a segmented run from the whole sequence's costs with the attention
core at its FLOPs at e_max (a segment's GEMMs, on fewer rows, and its other work cost no less:
perf/costs.py) and the first segment's GEMMs for the chains, without the segments' bounds
(plan/seq1f1b.balanced_segments, milliseconds each): the group bound and a candidate's first,
looser bound use it; `segment_sums` sums the segments' own costs (the candidate's refined bound).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from megapipe.config import Config
from megapipe.config.flops import segment_bounds
from megapipe.config.schema import layer_mode, recompute_modules
from megapipe.perf.cluster import Cluster
from megapipe.perf.comm import group_link
from megapipe.perf.cost_terms import ZERO, BlockCosts, Calibration, Work, shapes
from megapipe.perf.costs import CostModel
from megapipe.perf.software import Runtime
from megapipe.plan.schedules import SCHEDULES


class BlockTimes:
    """One microbatch's seconds through a run of blocks (module docstring), cached: the cost
    models, shared by the configs whose blocks cost the same, and their sums."""

    def __init__(self, cluster: Cluster, runtime: Runtime, cal: Calibration):
        self.cluster, self.runtime, self.cal = cluster, runtime, cal
        self._models: dict[tuple, tuple[Config, CostModel]] = {}
        self._plains: dict[tuple, tuple[Config, CostModel]] = {}
        self._sums: dict[tuple, tuple] = {}
        self._layers: dict[tuple, tuple] = {}

    def plain(self, cfg: Config) -> tuple[Config, CostModel]:
        """`cfg` unsegmented (1f1b) and its cost model, shared by the configs whose blocks
        cost the same: the same tp, cp, micro-batch size, sequence parallelism, recompute, fp8,
        and the same links for the tp and cp groups (what CostModel reads of pp and dp)."""
        p = cfg.parallel
        mesh = (p.tp, p.cp, p.cp_comm, p.cp_a2a, p.pp, p.dp, p.microbatches, p.sequence_parallel,
                cfg.recompute.mode, cfg.recompute.modules, cfg.train.fp8)  # fmt: skip
        if mesh not in self._plains:
            shape = (p.pp, p.dp, p.cp, p.tp)
            links = (group_link(self.cluster, shape, ("tp",)),
                     group_link(self.cluster, shape, ("cp",)))  # fmt: skip
            key = block_key(cfg, links)
            if key not in self._models:
                plain = dataclasses.replace(
                    cfg, parallel=dataclasses.replace(p, schedule="1f1b", vpp=1, seq_segments=1)
                )
                self._models[key] = (plain, CostModel(plain, self.cluster, self.runtime, self.cal))
            self._plains[mesh] = self._models[key]
        return self._plains[mesh]

    def block_sums(self, cfg: Config, blocks: range, split: bool) -> tuple:
        """Over `blocks`, one microbatch: (F + B + W; F + B, with W under no split; the first
        segment's F; its chain backward: B, with W under no split). Unsegmented: the cost
        model's stage costs. Segmented: those of the whole sequence less each layer's attention
        excess, and the first segment's layer GEMMs."""
        _, cm = self.plain(cfg)
        is_segmented = segmented(cfg)
        seg_key = segment_key(cfg) if is_segmented else None
        key = (id(cm), blocks.start, blocks.stop, split, seg_key)
        if key not in self._sums:
            self._sums[key] = self._block_sums_of(cfg, cm, blocks, split, is_segmented)
        return self._sums[key]

    def _block_sums_of(self, cfg, cm, blocks, split, is_segmented) -> tuple:
        x = _stage(cm, blocks)
        total = x.F.total + x.B.total + x.W.total
        fb = x.F.total + x.B.total + (0.0 if split else x.W.total)
        if not is_segmented:
            return total, fb, x.F.total, x.B.total + (0.0 if split else x.W.total)
        less, f0, g0 = 0.0, 0.0, 0.0
        n_layers = cfg.model.n_layers
        modes = Counter(layer_mode(cfg.recompute, i - 1) for i in blocks if 0 < i <= n_layers)
        for mode, n in modes.items():
            excess, f, b, w = self._layer_floor(cfg, mode)
            less, f0, g0 = less + n * excess, f0 + n * f, g0 + n * (b + (0.0 if split else w))
        return total - less, fb - less, f0, g0  # (the excess is in F and B, never in W)

    def segment_sums(self, cfg: Config, blocks: range, split: bool) -> tuple:
        """block_sums from the segments' own costs: summed over the segments, and the
        smallest segment's F and chain backward."""
        p = cfg.parallel
        shape = (p.pp, p.dp, p.cp, p.tp)
        links = (group_link(self.cluster, shape, ("tp",)), group_link(self.cluster, shape, ("cp",)))
        key = block_key(cfg, links, segment_key(cfg))
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
        plain, cm = self.plain(cfg)
        key = (id(cm), mode, segment_key(cfg))
        if key not in self._layers:
            start, end = segment_bounds(cfg)[0]
            x, dev = shapes(plain), cm.dev
            fwd, bwd = cm.attention_seconds(x)
            flops = 4.0 * x.hd * x.pairs * x.b * x.h
            best = dev.peak * dev.cal.gemm
            bwd_flops = (2.5 if cm.attention in ("fused", "ring", "hybrid") else 2.0) * flops
            core = mode == "selective" and "core_attn" in recompute_modules(cfg.recompute)
            again = 1 if mode == "full" or core else 0
            excess = (fwd - flops / best) * (1 + again) + (bwd - bwd_flops / best)
            first = dataclasses.replace(x, q=end - start, n=x.b * (end - start))
            gemms = cm.gemm_shapes(first)
            f = sum(dev.gemm(m, n, k, 1, cm.c) for m, n, k in gemms)
            b = sum(dev.gemm(m, k, n, 1, cm.c) for m, n, k in gemms)
            w = sum(dev.gemm(k, n, m, 1, cm.c) for m, n, k in gemms)
            self._layers[key] = (excess, f, b + (f if mode == "full" else 0.0), w)
        return self._layers[key]


def segmented(cfg: Config) -> bool:
    """Whether `cfg` runs Seq1F1B's segments: a pipeline, a segmented schedule, > 1 segment."""
    p = cfg.parallel
    return p.pp > 1 and SCHEDULES[p.schedule].segmented and p.seq_segments > 1


def segment_key(cfg: Config) -> tuple[int, int]:
    """What a segmented config's Seq1F1B segment bounds depend on besides the model (fixed in a
    search): the segment count and the sequence-parallel grain (config/flops.segment_bounds)."""
    p = cfg.parallel
    return p.seq_segments, p.tp if p.sequence_parallel else 1


def block_key(cfg: Config, *extra) -> tuple:
    """What a block's costs depend on here (the model fixed in a search): tp, cp (and
    cp_comm, cp_a2a: the attention's collectives, whose links they also fix), micro-batch
    size, sequence parallelism, recompute, train.fp8, `extra` (the groups' links, segment_key), and
    whether a pipeline runs: without one the head makes its grads in forward and the tied
    lookup adds into the head's table grad (config/memory_terms.head_grad_in_forward,
    tied_lookup_with_head)."""
    p, mbs = cfg.parallel, cfg.derived.micro_batch_size
    cp = (p.cp, p.cp_comm, p.cp_a2a)
    rec = (cfg.recompute.mode, cfg.recompute.modules)
    return (p.tp, *cp, mbs, p.sequence_parallel, *rec, cfg.train.fp8, *extra,
            p.pp == 1)  # fmt: skip


def _stage(cm: CostModel, blocks: range, segment: int | None = None) -> BlockCosts:
    """cm.stage(blocks, segment) from its blocks counted by kind (the embedding, the layers of
    each recompute mode, the head): the bounds sum a few thousand stages per search, and a
    loop over a 1T model's blocks each time was most of a search's time. The same sum as
    cm.stage up to float rounding (perf/bounds.EPS covers it)."""
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
        fixed_f, fixed_b = cm.fixed(index)
        f = f + (cost.F + Work(compute=fixed_f)) * count
        b = b + (cost.B + Work(compute=fixed_b)) * count
        w = w + cost.W * count
    return BlockCosts(f, b, w)
