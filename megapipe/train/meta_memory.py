"""The memory plan of a config (config/memory_plan.py, the one memory model) with its chunks'
parameters counted on meta-device GPTs: what `train.py --dry-run` prints. tests/test_memory_model
.py runs real steps and holds each rank's live saved bytes to it.
"""

from __future__ import annotations

import functools

import torch

from megapipe.config import Config
from megapipe.config.grad_buckets import HeadWeight, Unit
from megapipe.config.memory_plan import MemoryPlan, Timeline
from megapipe.config.memory_plan import memory_plan as plan_of
from megapipe.config.muon_terms import MuonMatrix
from megapipe.config.pipeline_split import rank_blocks
from megapipe.distributed.devices import memory as device_memory
from megapipe.models.gpt import GPT
from megapipe.parallel.expert.sharding import EPInfo
from megapipe.parallel.tensor.grad_sync import synced_elements
from megapipe.parallel.tensor.sharding import TPInfo
from megapipe.pipeline.stages import weight_blocks
from megapipe.train.muon import muon_groups


def memory_plan(
    cfg: Config,
    device: str = "cuda",
    timeline: Timeline | None = None,
    memory: float | None = None,
) -> MemoryPlan:
    """config/memory_plan.memory_plan of `cfg` on `device`, parameters from chunk_params;
    `memory`: the device's bytes, which size the LM head's chunks (None: 256 rows)."""
    counts, units = functools.partial(chunk_params, cfg), functools.partial(chunk_units, cfg)
    muon = functools.partial(muon_matrices, cfg)
    return plan_of(cfg, device, counts, timeline, memory, muon, units)


def local_memory(device: str = "cuda") -> int | None:
    """Bytes of memory of this machine's CUDA device where the plan is for CUDA and one is
    present (the budget parallel/tensor/cross_entropy sizes the LM head's chunks by), else
    None (256-row chunks, config/memory_terms.head_chunk_rows)."""
    return device_memory(None) if device == "cuda" else None


def chunk(cfg: Config, blocks: range, tp_rank: int) -> GPT:
    """The meta-device chunk holding `blocks` on `tp_rank` (its E/ep experts under parallel.ep:
    every ep rank holds as many)."""
    p = cfg.parallel
    tp = TPInfo(p.tp, tp_rank, None, p.sequence_parallel)
    ep = EPInfo(p.ep, 0, None)
    with torch.device("meta"):
        return GPT(cfg.model, blocks=blocks, seed=cfg.train.seed, tp=tp, init=False, ep=ep)


def chunk_params(cfg: Config, blocks: range, tp_rank: int) -> int:
    """Parameters of the chunk holding `blocks` on `tp_rank` (a tied table's copy included)."""
    return count_params([chunk(cfg, blocks, tp_rank)])


def chunk_units(cfg: Config, blocks: range, tp_rank: int) -> tuple[list[Unit], HeadWeight | None]:
    """The weight units of the chunk holding `blocks` on `tp_rank` (config/grad_buckets.py):
    each unit's own parameters' elements in backward order, a parameter the first reader's in
    forward order (parallel/data/zero3.Zero3Reducer._pack), and where its head's weight is."""
    model, seen, out = chunk(cfg, blocks, tp_rank), set(), []
    units = weight_blocks(model)
    head = model.head
    weight = None if head is None else head.out.weight if head.out is not None else model.tied_table
    found = None
    for k, unit in enumerate(units):
        own = [p for p in unit.forward if id(p) not in seen][::-1]
        seen.update(id(p) for p in own)
        out.append(tuple(p.numel() for p in own))
        at = [i for i, p in enumerate(own) if p is weight]
        found = (k, at[0]) if at else found
    heads = [k for k, unit in enumerate(units) if unit.module is head]
    return out, HeadWeight(*found, heads[0]) if found and heads else None


def tp_synced_params(cfg: Config, blocks: range, tp_rank: int) -> int:
    """Elements of the chunk holding `blocks` on `tp_rank` whose grads tp sums once a step
    (parallel/tensor/grad_sync.synced_elements): under SP the parameters whole on every tp
    rank, and replicated kv heads."""
    return synced_elements(chunk(cfg, blocks, tp_rank))


def muon_matrices(cfg: Config, blocks: range, tp_rank: int) -> list[MuonMatrix]:
    """The Muon parameters of the chunk holding `blocks` on `tp_rank` (train/muon.muon_groups):
    each one's local elements and the whole shapes of its logical matrices."""
    hidden, _ = muon_groups(chunk(cfg, blocks, tp_rank), 0.0)
    pairs = zip(hidden["params"], hidden["layouts"], strict=True)
    return [(p.numel(), layout.logical_shapes()) for p, layout in pairs]


def rank_chunks(cfg: Config, pp_rank: int, tp_rank: int) -> list[GPT]:
    """The meta-device chunks of the rank at (pp_rank, tp_rank), in local chunk order."""
    return [chunk(cfg, blocks, tp_rank) for blocks in rank_blocks(cfg, pp_rank)]


def model_params(cfg: Config) -> int:
    """The model's parameters, each once (one process's meta-device GPT: no tp shards, one
    tied table)."""
    with torch.device("meta"):
        whole = GPT(cfg.model, seed=cfg.train.seed, init=False)
    return count_params([whole])


def count_params(chunks: list[GPT]) -> int:
    return sum(q.numel() for c in chunks for q in c.parameters())
