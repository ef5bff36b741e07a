"""`train.py --dry-run`: the mesh, parameter counts and a memory estimate, without training."""

from __future__ import annotations

import torch

from megapipe.config import Config
from megapipe.metrics import flops_per_token

BYTES_PER_PARAM = 16  # fp32 weight 4 + grad 4 + AdamW exp_avg 4 + exp_avg_sq 4


def activation_bytes_per_layer(cfg: Config) -> float:
    """Activations kept for backward by one layer for one microbatch.

    Korthikanti et al. 2022, eq. 1: s·b·h·(34 + 5·a·s/h) bytes at 16-bit; doubled for float32.
    Full recompute keeps only the layer input (2·s·b·h at 16-bit); selective drops the 5·a·s/h.
    """
    m, d = cfg.model, cfg.derived
    sbh = m.seq_len * d.micro_batch_size * m.d_model
    per_elem = {"none": 34 + 5 * m.n_heads * m.seq_len / m.d_model, "selective": 34, "full": 2}
    scale = 2 if cfg.train.dtype == "float32" else 1
    return sbh * per_elem[cfg.recompute.mode] * scale


def describe(cfg: Config) -> str:
    from models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg.model, seed=cfg.train.seed, init=False)
    n_params = sum(p.numel() for p in model.parameters())
    p = cfg.parallel
    state = n_params * BYTES_PER_PARAM
    acts = activation_bytes_per_layer(cfg) * cfg.model.n_layers
    lines = [
        f"mesh: pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp} (world size {cfg.derived.world_size})",
        f"schedule: {p.schedule}, microbatches={p.microbatches}, "
        f"micro_batch_size={cfg.derived.micro_batch_size}",
        f"rank 0: {n_params:,} parameters",
        f"memory per rank: weights+grads+AdamW {state / 2**30:.2f} GiB, "
        f"activations ~{acts / 2**30:.2f} GiB per microbatch in flight",
        f"training FLOPs per token: {flops_per_token(cfg):.3e}",
    ]
    return "\n".join(lines)
