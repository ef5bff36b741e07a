"""`train.py --dry-run`: the mesh, the pipeline partition, per-rank parameter counts and a peak
memory estimate, no training.

Needs no process group. Each (pp, tp) coordinate builds its chunks on the meta device from the
partition training uses (config/stages.py `rank_blocks`: the schedule's placement, vpp chunks,
parallel.balance) with a `TPInfo(tp, rank)` (ShardSpec gives the local sizes). The peak counts
the microbatches the configured schedule keeps in flight, from running that schedule through the
planner's simulator: a pipeline rank's activation memory is its stash of microbatches that went
forward but not yet backward (Narayanan et al. 2021 §2.2; Qi et al. 2023 §3).
"""

from __future__ import annotations

import torch

from megapipe.config import Config
from megapipe.config.flops import flops_per_token, segment_bounds
from megapipe.config.memory import BYTES_PER_PARAM, activation_bytes_per_layer, peak_bytes
from megapipe.config.stages import (
    describe_partition,
    placement_of,
    rank_blocks,
    schedule_costs,
    schedule_of,
)
from megapipe.parallel.recompute import layer_mode
from megapipe.parallel.tensor.sharding import TPInfo
from megapipe.plan.partition import stage_text
from megapipe.plan.simulate import Costs, simulate
from models.gpt import GPT


def rank_chunks(cfg: Config, pp_rank: int, tp_rank: int) -> list[GPT]:
    """The meta-device chunks of the rank at (pp_rank, tp_rank), in local chunk order."""
    tp = TPInfo(cfg.parallel.tp, tp_rank, None, cfg.parallel.sequence_parallel)
    with torch.device("meta"):
        return [
            GPT(cfg.model, blocks=blocks, seed=cfg.train.seed, tp=tp, init=False)
            for blocks in rank_blocks(cfg, pp_rank)
        ]


def rank_params(cfg: Config, pp_rank: int, tp_rank: int) -> tuple[int, int]:
    """(parameters held, layers held) by the rank at (pp_rank, tp_rank), over all its chunks."""
    chunks = rank_chunks(cfg, pp_rank, tp_rank)
    return _count(chunks), sum(len(c.layers) for c in chunks)


def peak_inflight(cfg: Config) -> list[float]:
    """Per pp rank, the most microbatches whose activations it holds at once, in units of one
    microbatch through the rank's whole share (a vpp chunk counts 1/vpp, a Seq1F1B segment its
    token share). E.g. 1F1B: pp−r on rank r (warm-up of pp−r−1 forwards, Narayanan et al. 2021
    §2.2); GPipe: all m; ZB-H2 holds more than 1F1B to fill the bubble (Qi et al. 2023 §3)."""
    if cfg.parallel.pp == 1:  # no pipeline: the microbatches run one after another
        return [1.0]
    tokens = [(end - start) / cfg.model.seq_len for start, end in segment_bounds(cfg)]
    shares = {r: _chunk_shares(cfg, rank_chunks(cfg, r, 0)) for r in range(cfg.parallel.pp)}
    result = simulate(
        schedule_of(cfg),
        schedule_costs(cfg),
        placement_of(cfg),
        token_shares=tokens,
        chunk_shares=shares,
    )
    return result.peak_inflight


def _chunk_acts(cfg: Config, chunk: GPT) -> float:
    """Activation bytes of one microbatch through `chunk`'s layers, each at its recompute mode
    (recompute.layers leaves later layers at "none")."""
    modes = (layer_mode(cfg.recompute, int(index)) for index in chunk.layers)
    return sum(activation_bytes_per_layer(cfg, mode) for mode in modes)


def _chunk_shares(cfg: Config, chunks: list[GPT]) -> list[float]:
    """Each chunk's part of the rank's activations: chunks of a rank may hold different numbers
    of layers (e.g. E,t,t | t), so an in-flight microbatch weighs what its chunk holds."""
    acts = [_chunk_acts(cfg, c) for c in chunks]
    total = sum(acts)
    return [a / total for a in acts] if total else [1.0 / len(chunks)] * len(chunks)


def describe(cfg: Config) -> str:
    p, d = cfg.parallel, cfg.derived
    lines = [
        f"mesh: pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp} (world size {d.world_size}; "
        "rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank)",
        f"schedule: {p.schedule}, vpp={p.vpp}, microbatches={p.microbatches}, "
        f"micro_batch_size={d.micro_batch_size}, sequence_parallel={p.sequence_parallel}",
    ]
    if p.pp > 1:
        lines.append(describe_partition(cfg))
    inflight = peak_inflight(cfg)
    for pp_rank in range(p.pp):
        for tp_rank in range(p.tp):
            lines.append(_rank_line(cfg, pp_rank, tp_rank, inflight[pp_rank]))
    lines += _notes(cfg)
    lines.append(f"training FLOPs per token: {flops_per_token(cfg):.3e}")
    return "\n".join(lines)


def _notes(cfg: Config) -> list[str]:
    """How the per-rank memory lines were worked out, and what they leave out."""
    p = cfg.parallel
    if p.pp == 1:
        flight = "one microbatch at a time (no pipeline)"
    else:
        costs = "the given" if schedule_costs(cfg) != Costs() else "unit"
        flight = (
            f"the most microbatches {p.schedule} keeps in flight on it (simulated, {costs} costs)"
        )
    notes = [
        f"(memory per rank: float32 weights+grads+AdamW at {BYTES_PER_PARAM} B/parameter; "
        "activations of one microbatch through the rank's layers, Korthikanti et al. 2022, "
        f"embedding and head not counted, times {flight})"
    ]
    if p.schedule == "pipedream_async":
        notes.append(
            "(pipedream_async's weight snapshots, up to one per in-flight microbatch "
            "(PipeDream §3.3), are not counted)"
        )
    return notes


def _rank_line(cfg: Config, pp_rank: int, tp_rank: int, inflight: float) -> str:
    chunks = rank_chunks(cfg, pp_rank, tp_rank)
    n, layers = _count(chunks), sum(len(c.layers) for c in chunks)
    head = cfg.model.n_layers + 1
    held = " | ".join(stage_text(c.blocks, head) for c in chunks)
    acts = sum(_chunk_acts(cfg, c) for c in chunks)
    return (
        f"pp={pp_rank} tp={tp_rank}: {n:,} parameters, {layers} layers (chunks: {held}); "
        f"memory weights+grads+AdamW {_size(n * BYTES_PER_PARAM)}, activations "
        f"~{_size(acts)} per microbatch, peak in flight {_amount(inflight)} microbatches "
        f"-> peak ~{_size(peak_bytes(n, acts, inflight))}"
    )


def _count(chunks: list[GPT]) -> int:
    return sum(q.numel() for c in chunks for q in c.parameters())


def _amount(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.2f} MiB"
