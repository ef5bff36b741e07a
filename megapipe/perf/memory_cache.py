"""Peak memory per rank for the performance model and the planner: the one memory model
(config/memory_plan.py), made cheap to call many times.

`train/meta_memory.memory_plan(cfg)` builds the meta-device chunks of every (pp, tp) rank to count
parameters and replays the schedule's simulated timeline; for a 1T model on 3072 GPUs that is
512 meta GPTs and 64 passes over 65536 actions (seconds). Here the same plan comes from bounded
caches, each keyed by a frozen record of exactly what its function reads: parameter counts per
chunk shape (ChunkKey: layers are all alike; each shape summed from one-block chunks), the
unit-cost timeline per schedule and costs (plan/dag.py's Dag, timed as plan/simulate.py times
it), and whole plans (PlanKey).
tests/test_perf_model.py holds `plan` equal to `train/meta_memory.memory_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from megapipe.config import Config
from megapipe.config.flops import is_moe_layer
from megapipe.config.grad_buckets import HeadWeight, Unit
from megapipe.config.memory_plan import MemoryPlan, Timeline, memory_plan
from megapipe.config.muon_terms import MuonMatrix
from megapipe.config.pipeline_split import schedule_costs
from megapipe.perf.pipeline import ScheduleKey, schedule_dag
from megapipe.plan.dag import KIND_INDEX, run
from megapipe.plan.schedules import placement
from megapipe.plan.simulate import Costs, cost_table, pair_saving
from megapipe.train import meta_memory as train_memory

KINDS = {index: kind for kind, index in KIND_INDEX.items()}


class BoundedCache:
    """At most `size` values by key, the least recently used dropped first: functools'
    lru_cache for a function whose key is a record of what it reads, not its arguments."""

    def __init__(self, size: int):
        self.size = size
        self._values: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of `key`, from build() when it is not held."""
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = self._values[key] = build()
        if len(self._values) > self.size:
            self._values.popitem(last=False)
        return value


@dataclass(frozen=True)
class ChunkKey:
    """What a chunk's parameter count reads: the model, tp and sp, its tp rank, its shape
    (holds the embedding, how many layers, holds the head; layers are all alike), and ep."""

    model: tuple
    tp: int
    sequence_parallel: bool
    tp_rank: int
    embed: bool
    layers: int
    head: bool
    ep: int = 1  # a MoE layer's experts held: E/ep

    @staticmethod
    def of(cfg: Config, blocks: range, tp_rank: int) -> ChunkKey:
        p, head_block = cfg.parallel, cfg.model.n_layers + 1
        embed, head = 0 in blocks, head_block in blocks
        layers = len(blocks) - embed - head
        model = dataclasses.astuple(cfg.model)
        return ChunkKey(model, p.tp, p.sequence_parallel, tp_rank, embed, layers, head, p.ep)


_COUNTS = BoundedCache(4096)


def chunk_params(cfg: Config, blocks: range, tp_rank: int) -> int:
    """train/meta_memory.chunk_params of `blocks`, counted once per ChunkKey on a chunk of the same
    shape."""
    key = ChunkKey.of(cfg, blocks, tp_rank)
    start = cfg.model.n_layers + 1 - key.layers - key.embed if key.head else int(not key.embed)
    shape = range(start, start + key.embed + key.layers + key.head)  # a chunk of that shape
    return _COUNTS.get(key, lambda: _summed(cfg, shape, tp_rank))


def _summed(cfg: Config, shape: range, tp_rank: int) -> int:
    """train/meta_memory.chunk_params of `shape`, summed over its blocks: a chunk is its blocks'
    modules (the embedding or a tied head's table copy, each layer, the head), each counted
    once on a one-block chunk of its kind. The chunk holding both ends (pp = 1) shares the tied
    table between them, so it is counted whole. A search asks for hundreds of chunk shapes; a
    few one-block chunks count them all (building each shape's layers was ~25% of a search)."""
    head = cfg.model.n_layers + 1
    if 0 in shape and head in shape:
        return train_memory.chunk_params(cfg, shape, tp_rank)
    return sum(_block_params(cfg, b, tp_rank) for b in shape)


def _block_params(cfg: Config, block: int, tp_rank: int) -> int:
    """train/meta_memory.chunk_params of the one block `block`, counted once per ChunkKey and
    the layer's kind (a layer's parameters depend on its index only through whether it is a
    MoE layer, models/gpt.py make_mlp)."""
    layer = 1 <= block < cfg.model.n_layers + 1
    kind = is_moe_layer(cfg.model, block - 1) if layer else block
    key = (ChunkKey.of(cfg, range(block, block + 1), tp_rank), kind)
    one = range(block, block + 1)
    return _COUNTS.get(key, lambda: train_memory.chunk_params(cfg, one, tp_rank))


def muon_matrices(cfg: Config, blocks: range, tp_rank: int) -> list[MuonMatrix]:
    """train/meta_memory.muon_matrices of `blocks`, each block's counted once per ChunkKey and
    layer kind (as _block_params; the tied table is AdamW's, so blocks add up)."""
    out = []
    for b in blocks:
        layer = 1 <= b < cfg.model.n_layers + 1
        kind = is_moe_layer(cfg.model, b - 1) if layer else b
        one = range(b, b + 1)
        key = (ChunkKey.of(cfg, one, tp_rank), kind, "muon")
        out += _COUNTS.get(key, lambda one=one: train_memory.muon_matrices(cfg, one, tp_rank))
    return out


def chunk_units(cfg: Config, blocks: range, tp_rank: int) -> tuple[list[Unit], HeadWeight | None]:
    """train/meta_memory.chunk_units of `blocks`: a chunk holding both ends (whose head may
    read the embedding's table) counted once per ChunkKey, any other from its blocks' units,
    each counted once per ChunkKey and layer kind (as _block_params)."""
    head = cfg.model.n_layers + 1
    if 0 in blocks and head in blocks:
        key = (ChunkKey.of(cfg, blocks, tp_rank), "units")
        return _COUNTS.get(key, lambda: train_memory.chunk_units(cfg, blocks, tp_rank))
    out, weight = [], None
    for b in blocks:
        layer = 1 <= b < head
        kind = is_moe_layer(cfg.model, b - 1) if layer else b
        one = range(b, b + 1)
        key = (ChunkKey.of(cfg, one, tp_rank), kind, "units")
        units, at = _COUNTS.get(key, lambda one=one: train_memory.chunk_units(cfg, one, tp_rank))
        if at is not None:  # the head's block: its units after those before it
            weight = HeadWeight(at.unit + len(out), at.index, at.head + len(out))
        out += units
    return out, weight


def timeline(cfg: Config) -> Timeline:
    """The timeline config/memory_plan.unit_timeline replays (plan/simulate.simulate of the
    schedule with its schedule_costs), from the cached Dag. The same floats: the Dag's pass
    adds and compares exactly as simulate does."""
    return _timeline(ScheduleKey.of(cfg), schedule_costs(cfg))


@functools.lru_cache(maxsize=64)
def _timeline(key: ScheduleKey, costs: Costs) -> Timeline:
    dag, place = schedule_dag(key), placement(key.schedule, key.pp, key.vpp)
    table, delay = cost_table(dag, costs, place)
    timing = run(dag, table, delay, saving=pair_saving(dag, costs, place))
    out: Timeline = {r: [] for r in range(dag.pp)}
    for i in range(dag.size):
        out[dag.rank[i]].append(
            (KINDS[dag.kind[i]], dag.chunk[i], dag.seg[i], timing.start[i], timing.end[i])
        )
    return out


@dataclass(frozen=True)
class PlanKey:
    """What a memory plan reads of its config: the model, parallel and recompute sections, the
    global batch (the micro-batch size), the compute and weights' dtypes, document masking
    (per-row masks and RoPE tables); the device whose kernels it counts and its memory (the LM
    head's chunk size)."""

    model: tuple
    parallel: tuple
    recompute: tuple
    global_batch: int
    dtype: str
    params_dtype: str
    device: str
    memory: float | None = None
    optimizer: str = "adamw"  # train.optimizer: Muon's state differs (config/muon_terms.py)
    # what the linears keep and cast (train.fp8, fp8_keep_bf16) and the main grads' bytes
    fp8: tuple[str, str] = ("none", "")
    main_grads_dtype: str = "float32"
    document_mask: bool = False

    @staticmethod
    def of(cfg: Config, device: str, memory: float | None = None) -> PlanKey:
        sections = (
            dataclasses.astuple(getattr(cfg, s)) for s in ("model", "parallel", "recompute")
        )
        t = cfg.train
        keys = (t.global_batch, t.dtype, t.params_dtype, device, memory, t.optimizer)
        fp8 = (t.fp8, t.fp8_keep_bf16)
        return PlanKey(*sections, *keys, fp8, t.main_grads_dtype, cfg.data.document_mask)


_PLANS = BoundedCache(4096)


def plan(cfg: Config, device: str = "cuda", memory: float | None = None) -> MemoryPlan:
    """The same MemoryPlan as train/meta_memory.memory_plan(cfg, device, memory=memory) (`memory`:
    the device's bytes, sizing the LM head's chunks), cached per PlanKey."""

    def build() -> MemoryPlan:
        flight = timeline(cfg) if cfg.parallel.pp > 1 else None
        counts, muon, units = (
            functools.partial(f, cfg) for f in (chunk_params, muon_matrices, chunk_units)
        )
        return memory_plan(cfg, device, counts, flight, memory, muon, units)

    return _PLANS.get(PlanKey.of(cfg, device, memory), build)
