"""`train.py --dry-run`: the mesh, per-rank parameter counts and a memory estimate, no training.

Needs no process group: each (pp, tp) coordinate's shapes come from building that rank's blocks
on the meta device with a `TPInfo(tp, rank)` (ShardSpec gives the local sizes).
"""

from __future__ import annotations

import torch

from megapipe.config import Config
from megapipe.config.flops import flops_per_token
from megapipe.parallel.tensor.sharding import TPInfo

BYTES_PER_PARAM = 16  # fp32 weight 4 + grad 4 + AdamW exp_avg 4 + exp_avg_sq 4


def activation_bytes_per_layer(cfg: Config) -> float:
    """Activations kept for backward by one layer for one microbatch on one tp rank.

    Korthikanti et al. 2022, eqs. 1-3, at 16-bit: s·b·h·(34 + 5·a·s/h) with no parallelism,
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tp = t, s·b·h·(34/t + 5·a·s/(h·t)) with SP too.
    Full recompute keeps only the layer input (2·s·b·h, /t under SP); selective drops the
    5·a·s/h term. Doubled for float32. Under cp each rank holds s/cp tokens, and ring attention
    keeps q, k, v, out and the log-sum-exp (O(s/cp)) instead of the s² scores: no 5·a·s/h term.
    """
    m, d, t, cp = cfg.model, cfg.derived, cfg.parallel.tp, cfg.parallel.cp
    sp = cfg.parallel.sequence_parallel and t > 1
    sbh = m.seq_len // cp * d.micro_batch_size * m.d_model
    attn = 5 * m.n_heads * m.seq_len / m.d_model / t if cp == 1 else 0.0
    linear = 34 / t if sp else 10 + 24 / t
    per_elem = {"none": linear + attn, "selective": linear, "full": 2 / t if sp else 2}
    scale = 2 if cfg.train.dtype == "float32" else 1
    return sbh * per_elem[cfg.recompute.mode] * scale


def stage_blocks(cfg: Config, pp_rank: int) -> range:
    """Blocks of pipeline rank `pp_rank` under a uniform split of the L + 2 blocks."""
    n, pp = cfg.model.n_layers + 2, cfg.parallel.pp
    return range(pp_rank * n // pp, (pp_rank + 1) * n // pp)


def rank_params(cfg: Config, pp_rank: int, tp_rank: int) -> tuple[int, int]:
    """(parameters held, layers held) by the rank at (pp_rank, tp_rank)."""
    from models.gpt import GPT

    tp = TPInfo(cfg.parallel.tp, tp_rank, None, cfg.parallel.sequence_parallel)
    blocks = stage_blocks(cfg, pp_rank)
    with torch.device("meta"):
        model = GPT(cfg.model, blocks=blocks, seed=cfg.train.seed, tp=tp, init=False)
    return sum(p.numel() for p in model.parameters()), len(model.layers)


def describe(cfg: Config) -> str:
    p, d = cfg.parallel, cfg.derived
    lines = [
        f"mesh: pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp} (world size {d.world_size}; "
        "rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank)",
        f"schedule: {p.schedule}, microbatches={p.microbatches}, "
        f"micro_batch_size={d.micro_batch_size}, sequence_parallel={p.sequence_parallel}",
    ]
    acts = activation_bytes_per_layer(cfg)
    for pp_rank in range(p.pp):
        for tp_rank in range(p.tp):
            n, layers = rank_params(cfg, pp_rank, tp_rank)
            lines.append(
                f"pp={pp_rank} tp={tp_rank}: {n:,} parameters, {layers} layers; memory "
                f"weights+grads+AdamW {_size(n * BYTES_PER_PARAM)}, activations "
                f"~{_size(acts * layers)} per microbatch in flight"
            )
    if p.pp > 1:
        lines.append("(pp stages: uniform split of the blocks; parallel.balance not applied)")
    lines.append(f"training FLOPs per token: {flops_per_token(cfg):.3e}")
    return "\n".join(lines)


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.2f} MiB"
