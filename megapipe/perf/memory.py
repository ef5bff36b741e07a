"""Peak memory per rank for the performance model: train/memory.py's `memory_plan`, made cheap
to call many times.

`memory_plan(cfg)` builds the meta-device chunks of every (pp, tp) rank to count parameters and
replays the unit-cost simulated timeline of the schedule once per pp rank; for a 1T model on
3072 GPUs that is 512 meta GPTs and 64 passes over 65536 actions (seconds). The same plan comes
out here from two caches: parameter counts per chunk shape (which blocks: the embedding, how
many layers, the head; layers are all alike) and per tp rank, and the unit-cost timeline per
schedule (plan/simulate.py's timing of the Dag cached by perf/pipeline.py), grouped by rank.
tests/test_perf_model.py holds `plan` equal to `memory_plan`.
"""

from __future__ import annotations

import dataclasses

import torch

from megapipe.config import Config
from megapipe.config.memory import GRAD_BYTES, WEIGHT_BYTES, optimizer_bytes, segments
from megapipe.config.stages import placement_of, rank_blocks, schedule_costs
from megapipe.parallel.tensor.sharding import TPInfo
from megapipe.perf.pipeline import config_dag, schedule_key
from megapipe.plan.dag import KIND_INDEX, run
from megapipe.plan.simulate import cost_table
from megapipe.train.memory import (
    MemoryPlan,
    RankMemory,
    _change,
    _segment_activations,
    chunk_activations,
    chunk_deferred,
    count_params,
)
from models.gpt import GPT

KINDS = {index: kind for kind, index in KIND_INDEX.items()}


def _model_key(cfg: Config) -> tuple:
    """What a chunk's parameter count depends on besides its blocks: the model and tp/sp."""
    p, m = cfg.parallel, cfg.model
    return (tuple(getattr(m, f.name) for f in dataclasses.fields(m)), p.tp, p.sequence_parallel)


def _shape(blocks: range, n_layers: int) -> tuple[bool, int, bool]:
    """(holds the embedding, number of transformer layers, holds the head) of a chunk."""
    embed, head = 0 in blocks, n_layers + 1 in blocks
    return embed, len(blocks) - embed - head, head


_COUNT_CACHE: dict[tuple, int] = {}


def chunk_params(cfg: Config, blocks: range, tp_rank: int) -> int:
    """Parameters of the chunk holding `blocks` on `tp_rank`, counted once per chunk shape on a
    meta-device GPT of that shape (train/memory.rank_chunks builds the same chunk)."""
    n_layers = cfg.model.n_layers
    embed, layers, head = shape = _shape(blocks, n_layers)
    key = (_model_key(cfg), shape, tp_rank)
    if key not in _COUNT_CACHE:
        start = n_layers + 1 - layers - embed if head else (0 if embed else 1)
        rep = range(start, start + embed + layers + head)  # a chunk of the same shape
        tp = TPInfo(cfg.parallel.tp, tp_rank, None, cfg.parallel.sequence_parallel)
        with torch.device("meta"):
            chunk = GPT(cfg.model, blocks=rep, seed=cfg.train.seed, tp=tp, init=False)
        _COUNT_CACHE[key] = count_params([chunk])
    return _COUNT_CACHE[key]


def peak_inflight(cfg: Config, device: str = "cuda") -> list[float]:
    """train/memory.peak_inflight, from the cached timeline."""
    p = cfg.parallel
    if p.pp == 1:
        return [1.0]
    timeline = _timeline(cfg)
    peaks = []
    for rank in range(p.pp):
        chunks = rank_blocks(cfg, rank)
        size, kept = {}, {}
        for c, blocks in enumerate(chunks):
            for k, i in enumerate(segments(cfg)):
                size[c, k] = _segment_activations(cfg, blocks, device, i)
                kept[c, k] = chunk_deferred(cfg, blocks, i)
        unit = sum(size.values()) or 1.0
        events = [
            _change(kind, start, end, size[c, k] / unit, kept[c, k] / unit)
            for kind, c, k, start, end in timeline[rank]
        ]
        live = peak = 0.0
        for _, delta in sorted(events):
            live += delta
            peak = max(peak, live)
        peaks.append(round(peak, 9))
    return peaks


_TIMELINES: dict[tuple, dict[int, list]] = {}


def _timeline(cfg: Config) -> dict[int, list]:
    """The timeline train/memory.peak_inflight replays (plan/simulate.simulate of the schedule
    with its schedule_costs), from the cached Dag, per rank: [(kind, chunk, seg, start, end)].
    The same floats: the Dag's pass adds and compares exactly as simulate does."""
    key = schedule_key(cfg)
    if key not in _TIMELINES:
        dag, place = config_dag(cfg), placement_of(cfg)
        table, delay = cost_table(dag, schedule_costs(cfg), place)
        timing = run(dag, table, delay)
        out: dict[int, list] = {r: [] for r in range(dag.pp)}
        for i in range(dag.size):
            out[dag.rank[i]].append(
                (KINDS[dag.kind[i]], dag.chunk[i], dag.seg[i], timing.start[i], timing.end[i])
            )
        if len(_TIMELINES) > 64:
            _TIMELINES.clear()
        _TIMELINES[key] = out
    return _TIMELINES[key]


_PLANS: dict[str, MemoryPlan] = {}


def plan(cfg: Config, device: str = "cuda") -> MemoryPlan:
    """The same MemoryPlan as train/memory.memory_plan(cfg, device), cached per config."""
    key = repr((dataclasses.astuple(cfg.model), dataclasses.astuple(cfg.parallel),
                dataclasses.astuple(cfg.recompute), cfg.train.global_batch, cfg.train.dtype,
                device))  # fmt: skip
    if key in _PLANS:
        return _PLANS[key]
    p = cfg.parallel
    inflight = peak_inflight(cfg, device)
    ranks = []
    for pp_rank in range(p.pp):
        held = rank_blocks(cfg, pp_rank)
        acts = tuple(chunk_activations(cfg, b, device) for b in held)
        for tp_rank in range(p.tp):
            n = sum(chunk_params(cfg, b, tp_rank) for b in held)
            ranks.append(
                RankMemory(
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    params=n,
                    weights=n * WEIGHT_BYTES,
                    grads=n * GRAD_BYTES,
                    optimizer=optimizer_bytes(n, cfg),
                    chunk_activations=acts,
                    inflight=inflight[pp_rank],
                )
            )
    result = MemoryPlan(tuple(ranks), device)
    if len(_PLANS) > 4096:
        _PLANS.clear()
    _PLANS[key] = result
    return result
