"""Validation: the mean loss over fixed batches, and per-token log-probs of given rows (what
train.eval_tasks scores), one code path for every engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megapipe.config import Config
from megapipe.pipeline.protocol import Engine
from megapipe.train.batches import BatchSlice


@contextmanager
def eval_mode(engine: Engine) -> Iterator[None]:
    """The engine's chunks in eval mode (no dropout) within, back in training mode after."""
    for chunk in engine.chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk in engine.chunks:
            chunk.train()


@torch.no_grad()
def evaluate(engine: Engine, slice_: BatchSlice, data, cfg: Config) -> float:
    """Mean validation loss over `train.eval_batches` fixed batches of `global_batch` rows:
    forward only; under pp each microbatch walks the stages in order and the last stage's
    summed cross entropy is summed over pp (others add 0), then over dp × cp."""
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # summed loss, tokens
    with eval_mode(engine):
        for i in range(cfg.train.eval_batches):
            size = cfg.train.global_batch  # this dp rank reads only its rows
            batch = data.batch(i, size, split="val", rows=slice_.rows(size)).to(engine.device)
            micro = slice_.microbatches(batch, cfg.parallel.microbatches)
            for loss, m in zip(engine.forward_only(micro), micro):
                total[0] += loss
                total[1] += m.targets.numel()
    total = torch.stack([engine.stage_loss(total[0].clone()), total[1]])
    total = slice_.sum(total)
    return (total[0] / total[1]).item()


def evaluate_datasets(engine: Engine, slice_: BatchSlice, data, cfg: Config) -> dict[str, float]:
    """A blend's validation loss per dataset ({name: loss}), each over its own fixed val
    batches (`train.eval_batches` of them); {} for data that is not a blend."""
    datasets = getattr(data, "datasets", {})
    return {name: evaluate(engine, slice_, one, cfg) for name, one in datasets.items()}


class EngineLogprobs:
    """`rows (B, W+1) -> (B, W)`: the log-prob of each row's tokens after the first, by the
    job's engine on any mesh (train/choices.py sums a continuation's span of them).

    Every call runs one engine pass over this dp rank's `global_batch / dp` rows (the B given,
    padded with rows of zeros) of `model.seq_len + 1` tokens (each row right-padded: a causal
    model's later tokens change no earlier log-prob), cut into `parallel.microbatches` and over
    cp as training cuts them, without document masking (lm-eval reads each request alone).
    Which ranks compute what: the engine's `token_logprobs` (the last stage from its logits
    gathered over tp, summed over pp to every pp rank); this rank's cp slice joined over cp
    here. Every rank of a dp replica gets the same rows' log-probs; each dp replica scores its
    own rows, so its ranks must make the same number of calls (train/tasks.score_task)."""

    def __init__(self, engine: Engine, slice_: BatchSlice, cfg: Config) -> None:
        self.engine, self.cfg = engine, cfg
        self.rows = cfg.train.global_batch // slice_.dp_size
        # this replica's own rows: no dp selection, no document ids
        self.slice = dataclasses.replace(
            slice_, dp_size=1, dp_rank=0, group=None, global_batch=0, eos_id=None
        )

    @torch.no_grad()
    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        n, width = rows.shape  # (B, W+1), B <= self.rows, W <= seq_len
        full = torch.zeros(self.rows, self.cfg.model.seq_len + 1, dtype=torch.long)
        full[:n, :width] = rows
        micro = self.slice.microbatches(full.to(self.engine.device), self.cfg.parallel.microbatches)
        with eval_mode(self.engine):
            parts = [self.slice.whole(t) for t in self.engine.token_logprobs(micro)]
        return torch.cat(parts)[:n, : width - 1]  # (B, W)
