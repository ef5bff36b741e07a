"""Muon's optimizer step in the performance model (train.optimizer=muon): the Newton-Schulz GEMMs
of the matrices the busiest rank orthogonalises (config/muon_terms.ns_matmuls: under tp every
rank runs each whole logical matrix, under ZeRO its owner does), in bf16 as torch's
`_zeropower_via_newtonschulz` runs them, priced by the device's GEMM model (perf/cost_terms.py).

Under ZeRO the owners' two exchanges (train/muon_zero.py) are priced too: each rank holds 1/n of
every Muon matrix's flat range (n: its shard group) and sends the (n - 1)/n of it that other
ranks own, as float32 grads, then receives as many float32 updates back; a pairwise all-to-all
of n - 1 rounds on the shard group's link, twice a step.
"""

from __future__ import annotations

from dataclasses import replace

from megapipe.config import Config
from megapipe.config.muon_terms import is_muon, ns_matmuls, owner_ranks
from megapipe.config.states import FLOAT32
from megapipe.perf.memory_cache import muon_matrices

BF16 = 2  # bytes of the Newton-Schulz operands (torch casts the update to bf16)
EXCHANGES = 2  # the grads to the owners, the updates back (train/muon_zero.py)


def newton_schulz_seconds(cfg: Config, dev, blocks: list[range]) -> float:
    """Seconds of one step's Newton-Schulz on the rank holding the chunks `blocks` (tp rank 0)."""
    matrices = [m for b in blocks for m in muon_matrices(cfg, b, 0)]
    return sum(dev.gemm(m, n, k, count, BF16) for m, n, k, count in ns_matmuls(matrices, cfg))


def exchange_seconds(cfg: Config, link, blocks: list[range]) -> float:
    """Seconds of the owners' two all-to-alls on the rank holding `blocks` (module docstring);
    0 without ZeRO's owners."""
    n = owner_ranks(cfg)
    if n == 1:
        return 0.0
    elements = sum(size for b in blocks for size, _ in muon_matrices(cfg, b, 0))
    sent = elements / n * (n - 1) / n * FLOAT32
    return EXCHANGES * ((n - 1) * link.latency + sent / link.bandwidth)


def with_muon(opt, cfg: Config, dev, held_blocks: list[list[range]], link):
    """`opt` (perf/data_parallel.OptPlan) with each pp rank's Newton-Schulz and owner-exchange
    seconds added (its chunks' blocks: `held_blocks`; `link`: the shard group's); `opt` itself
    under AdamW."""
    if not is_muon(cfg):
        return opt
    extra = [
        newton_schulz_seconds(cfg, dev, blocks) + exchange_seconds(cfg, link, blocks)
        for blocks in held_blocks
    ]
    per_rank = [t + e for t, e in zip(opt.per_rank, extra)]
    return replace(opt, per_rank=per_rank, step=opt.step - max(opt.per_rank) + max(per_rank))
