"""Muon's optimizer step in the performance model (train.optimizer=muon): the Newton-Schulz GEMMs
of the matrices the busiest rank orthogonalises (config/muon_terms.ns_matmuls: under tp every
rank runs each whole logical matrix, under ZeRO its owner does), in bf16 as torch's
`_zeropower_via_newtonschulz` runs them, priced by the device's GEMM model (perf/cost_terms.py).
The owners' two exchanges of the grads and updates over dp × cp are left out (a second all-to-all
of the Muon matrices' bytes, beside the step's reduce-scatter and gather).
"""

from __future__ import annotations

from dataclasses import replace

from megapipe.config import Config
from megapipe.config.muon_terms import is_muon, ns_matmuls
from megapipe.perf.memory_cache import muon_matrices

BF16 = 2  # bytes of the Newton-Schulz operands (torch casts the update to bf16)


def newton_schulz_seconds(cfg: Config, dev, blocks: list[range]) -> float:
    """Seconds of one step's Newton-Schulz on the rank holding the chunks `blocks` (tp rank 0)."""
    matrices = [m for b in blocks for m in muon_matrices(cfg, b, 0)]
    return sum(dev.gemm(m, n, k, count, BF16) for m, n, k, count in ns_matmuls(matrices, cfg))


def with_muon(opt, cfg: Config, dev, held_blocks: list[list[range]]):
    """`opt` (perf/data_parallel.OptPlan) with each pp rank's Newton-Schulz seconds added (its
    chunks' blocks: `held_blocks`); `opt` itself under AdamW."""
    if not is_muon(cfg):
        return opt
    extra = [newton_schulz_seconds(cfg, dev, blocks) for blocks in held_blocks]
    per_rank = [t + e for t, e in zip(opt.per_rank, extra)]
    return replace(opt, per_rank=per_rank, step=opt.step - max(opt.per_rank) + max(per_rank))
