"""Dataset blends (`data.blend`): the rows of a global batch drawn from several prepared
datasets in proportion to their weights, as statelessly as the one-dataset sampler.

The draw rule, for step s of a split: the step's generator (keyed by (seed, split, s), the
same key `loader._rng` gives one dataset) first picks a dataset for every row of the global
batch, independently with the normalised weights; then each picked dataset cuts its rows'
windows with a generator spawned from the step's key and the dataset's index. Per-row draws,
as Megatron's blend samples per sample: each step is independent of every other, so step s
is a pure function of (seed, split, s) and a resume or another mesh sees the same batch (dp
ranks slice it afterwards). The price is that one step's mix varies around the weights (a
binomial spread); the shares converge over steps. An exact per-step allocation (largest
remainder) would bias small weights at small batches unless it carried remainders from step
to step, which is state a resume would have to restore.

Built by `loader.build_data`, which checks the datasets share a tokenizer; this module imports
nothing of the project so the loader can import it without a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported when a batch is made: preparation never needs it
    import torch

StepRng = Callable[[str, int], np.random.Generator]  # (split, step) -> the step's generator


class BlendData:
    """A TokenData (same attributes and `batch`; not a subclass, to import nothing of the
    loader) over named datasets (MemmapData, in data.blend's order) mixed by weight."""

    def __init__(
        self, datasets: dict[str, Any], weights: Sequence[float], step_rng: StepRng, seq_len: int
    ):
        first = next(iter(datasets.values()))
        self.datasets = datasets
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.step_rng = step_rng
        self.seq_len, self.vocab_size, self.seed = seq_len, first.vocab_size, first.seed
        self.tokenizer_path = first.tokenizer_path

    @property
    def names(self) -> list[str]:
        return list(self.datasets)

    def sources(self, step: int, size: int, split: str = "train") -> np.ndarray:
        """The dataset index of each row of step `step`'s global batch (int64 [size])."""
        return self._sources(self.step_rng(split, step), size)

    def _sources(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.choice(len(self.weights), size=size, p=self.weights)

    def batch(self, step: int, size: int, split: str = "train") -> torch.Tensor:
        """The global batch of `step`: LongTensor [size, seq_len + 1], rows in draw order."""
        rng = self.step_rng(split, step)
        which = self._sources(rng, size)
        # Children of the step's seed: a pure function of (seed, split, step, dataset index).
        children = rng.bit_generator.seed_seq.spawn(len(self.datasets))
        rows = np.empty((size, self.seq_len + 1), dtype=np.int64)
        for d, data in enumerate(self.datasets.values()):
            picked = np.flatnonzero(which == d)
            if len(picked):
                # the dataset's own window draw (MemmapData.draw), fed the child generator
                rows[picked] = data.draw(np.random.default_rng(children[d]), len(picked), split)
        import torch

        return torch.from_numpy(rows)

    def rows_per_dataset(self, step: int, size: int) -> np.ndarray:
        """How many rows of train step `step` each dataset gives (int64 [n_datasets])."""
        return np.bincount(self.sources(step, size), minlength=len(self.datasets))


class BlendTokens:
    """`tokens/<name>`: the tokens each dataset gave to steps 0..s. At a resume the earlier
    steps' draws are recomputed (a few microseconds a step), so a resumed run logs the same
    counts as an uninterrupted one and no counter needs to live in the checkpoint."""

    def __init__(self, data: BlendData, start: int, size: int):
        self.data, self.size = data, size
        self.rows = np.zeros(len(data.datasets), dtype=np.int64)
        for step in range(start):
            self.rows += data.rows_per_dataset(step, size)

    def after(self, step: int) -> dict[str, int]:
        """Add train step `step` (0-based) and return the running counts."""
        self.rows += self.data.rows_per_dataset(step, self.size)
        tokens = self.rows * self.data.seq_len  # as consumed_tokens: seq_len targets a row
        return {f"tokens/{name}": int(n) for name, n in zip(self.data.names, tokens)}
