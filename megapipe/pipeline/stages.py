"""Stages: the real partition (config/stages.py) turned into this rank's GPT chunks.

A chunk is `GPT(cfg.model, blocks=range)` sharded over the mesh's tp axis and running ring
attention over its cp axis; the whole model is the one-chunk case. Per-block costs for the `cost`
balance can be measured here (PipeDream §3.1 profiles each layer over a short run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from megapipe.config import Config
from megapipe.config.stages import rank_blocks
from megapipe.parallel.context.zigzag import cp_info
from megapipe.parallel.tensor.random import tp_info
from megapipe.plan.actions import Placement
from models.gpt import GPT


def build_model(
    cfg: Config, mesh=None, device: torch.device | str = "cpu", blocks: range | None = None
) -> GPT:
    """The GPT of `cfg` (or its `blocks`: a pipeline chunk), sharded over the mesh's tp axis
    and running ring attention over its cp axis (mesh None: one process)."""
    tp = tp_info(mesh, cfg.parallel.sequence_parallel, cfg.train.seed)
    model = GPT(
        cfg.model, blocks, seed=cfg.train.seed, tp=tp, recompute=cfg.recompute, cp=cp_info(mesh)
    )
    return model.to(device)


def build_chunks(cfg: Config, mesh, device, placement: Placement) -> list[GPT]:
    """This pp rank's chunks, in local chunk order, from the partition training uses."""
    ranges = rank_blocks(cfg, mesh.coord("pp"), placement)
    return [build_model(cfg, mesh, device, blocks) for blocks in ranges]


def profile_block_costs(cfg: Config, n_iters: int = 3, batch: int = 1) -> list[float]:
    """Seconds of forward + backward per block for `batch` sequences on this host.

    PipeDream (§3.1) profiles T_l per layer over a short run. All transformer layers share one
    shape, so one is timed and its cost used for each: cheaper, and timing noise cannot make
    identical layers look unequal. Timings vary between runs: measure on one rank and pass the
    list to `partition(..., costs=)` on every rank.
    """
    m = cfg.model
    ids = torch.randint(m.vocab_size, (batch, m.seq_len))
    hidden = torch.randn(batch, m.seq_len, m.d_model, requires_grad=True)  # (B, T, d)

    def timed(block: int, forward: Callable[[torch.nn.Module], torch.Tensor]) -> float:
        module = GPT(m, blocks=range(block, block + 1), seed=cfg.train.seed)
        return _time_forward_backward(module, forward, n_iters)

    embed = timed(0, lambda mod: mod(ids))
    layer = timed(1, lambda mod: mod(hidden))
    head = timed(m.n_layers + 1, lambda mod: mod(hidden, targets=ids))
    return [embed] + [layer] * m.n_layers + [head]


def _time_forward_backward(module: torch.nn.Module, forward, n_iters: int) -> float:
    times = []
    for it in range(n_iters + 1):  # the first run warms up the allocator and kernels
        start = time.perf_counter()
        out = forward(module)
        out.backward(torch.ones_like(out))
        if it:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
