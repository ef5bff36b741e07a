"""Validation: the mean loss over fixed batches, one code path for every engine."""

from __future__ import annotations

import torch

from megapipe.config import Config
from megapipe.pipeline.protocol import Engine
from megapipe.train.batches import BatchSlice


@torch.no_grad()
def evaluate(engine: Engine, slice_: BatchSlice, data, cfg: Config) -> float:
    """Mean validation loss over `train.eval_batches` fixed batches of `global_batch` rows:
    forward only; under pp each microbatch walks the stages in order and the last stage's
    summed cross entropy is summed over pp (others add 0), then over dp × cp."""
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # summed loss, tokens
    for chunk in engine.chunks:
        chunk.eval()
    for i in range(cfg.train.eval_batches):
        size = cfg.train.global_batch  # this dp rank reads only its rows
        batch = data.batch(i, size, split="val", rows=slice_.rows(size)).to(engine.device)
        micro = slice_.microbatches(batch, cfg.parallel.microbatches)
        for loss, m in zip(engine.forward_only(micro), micro):
            total[0] += loss
            total[1] += m.targets.numel()
    for chunk in engine.chunks:
        chunk.train()
    total = torch.stack([engine.stage_loss(total[0].clone()), total[1]])
    total = slice_.sum(total)
    return (total[0] / total[1]).item()


def evaluate_datasets(engine: Engine, slice_: BatchSlice, data, cfg: Config) -> dict[str, float]:
    """A blend's validation loss per dataset ({name: loss}), each over its own fixed val
    batches (`train.eval_batches` of them); {} for data that is not a blend."""
    datasets = getattr(data, "datasets", {})
    return {name: evaluate(engine, slice_, one, cfg) for name, one in datasets.items()}
