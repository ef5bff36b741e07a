"""Dataset blends (`data.blend`): the rows of a global batch drawn from several prepared
datasets in proportion to their weights, as statelessly as the one-dataset sampler.

With `data.sampler: epochs`, Megatron-LM's BlendedDataset: global sample i goes to the dataset
d maximising weights[d]·max(i, 1) - count[d] (its samples so far; ties to the lower index; the
exact rule of Megatron's helpers.cpp `build_blending_indices`), and is that dataset's sample
count[d], taken from its own epochs index. Every prefix of samples holds each dataset's share to
within one sample, and the sequence of sample i depends on the weights and i alone: the same
whatever the mesh, the run length or a resume. The sequence is one greedy pass, each step
depending on the last (no closed form for more than two datasets: Beatty sequences cover two),
run in plain Python over int counts and float errors (the same IEEE operations as Megatron's
C++, so the same ties): about 0.5 µs a sample for three datasets, 5 s for 10^7 samples, paid
once: the result is cached beside the first dataset (sample_index.cached), memory-mapped.

With `data.sampler: random`, the step's generator (keyed by (seed, split, s), the same key
`loader.step_rng` gives one dataset) first picks a dataset for every row of the global batch,
independently with the normalised weights; then each picked dataset cuts its rows' windows
with a generator spawned from the step's key and the dataset's index. Each step is independent
of every other, so step s is a pure function of (seed, split, s); the shares hold over steps
(a binomial spread within one).

Built by `loader.build_data`, which checks the datasets share a tokenizer; this module imports
only sample_index of the project, so the loader can import it without a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megapipe.data.sample_index import cached

if TYPE_CHECKING:  # torch is imported when a batch is made: preparation never needs it
    import torch

StepRng = Callable[[str, int], np.random.Generator]  # (split, step) -> the step's generator
BLEND_VERSION = 1  # of the blend index's rule and layout: part of its cache key


def blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's blend of `size` samples: (dataset int16 [size], sample within it int64
    [size]); `weights` normalised. One greedy pass (module docstring)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.empty(size, dtype=np.int16)
    others = range(1, len(w))
    for i in range(size):
        t = i if i > 1 else 1  # Megatron's max(i, 1)
        best, top = 0, w[0] * t - counts[0]
        for d in others:
            error = w[d] * t - counts[d]
            if error > top:
                best, top = d, error
        which[i] = best
        counts[best] += 1
    within = np.empty(size, dtype=np.int64)
    for d in range(len(w)):  # the k-th sample of dataset d is its sample k
        mine = np.flatnonzero(which == d)
        within[mine] = np.arange(len(mine))
    return which, within


def _write_blend(weights: Sequence[float], size: int, out: Path) -> None:
    which, within = blend_indices(weights, size)
    np.save(out / "dataset.npy", which)
    np.save(out / "sample.npy", within)


class BlendData:
    """A TokenData (same attributes and `batch`; not a subclass, to import nothing of the
    loader) over named datasets (MemmapData, in data.blend's order) mixed by weight."""

    def __init__(
        self,
        datasets: dict[str, Any],
        weights: Sequence[float],
        step_rng: StepRng,
        seq_len: int,
        sampler: str = "random",
        samples: dict[str, int] | None = None,
    ):
        first = next(iter(datasets.values()))
        self.datasets = datasets
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.step_rng = step_rng
        self.seq_len, self.vocab_size, self.seed = seq_len, first.vocab_size, first.seed
        self.tokenizer_path = first.tokenizer_path
        self.sampler = sampler
        self.samples = dict(samples or {})  # split -> samples the run reads (index size hint)
        self._blends: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if sampler == "epochs" and samples:  # start-up: the train indices before step 0
            self.blend("train", samples["train"])

    @property
    def names(self) -> list[str]:
        return list(self.datasets)

    def blend(self, split: str, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """The epochs blend of at least `samples` samples (dataset, sample within it), cached
        beside the first dataset; each dataset's index is opened for its share."""
        held = self._blends.get(split)
        if held is None or len(held[0]) < samples:
            size = max(samples, self.samples.get(split, 0), 1)
            key = {"version": BLEND_VERSION, "weights": self.weights.tolist(), "size": size}
            root = next(iter(self.datasets.values())).root
            folder = cached(root, f"blend-n{size}", key, partial(_write_blend, self.weights, size))
            held = tuple(np.load(folder / f, mmap_mode="r") for f in ("dataset.npy", "sample.npy"))
            self._blends[split] = held
            shares = np.bincount(held[0], minlength=len(self.datasets))
            for data, share in zip(self.datasets.values(), shares):
                data.sample_index(split, int(share))
        return held

    def sources(self, step: int, size: int, split: str = "train") -> np.ndarray:
        """The dataset index of each row of step `step`'s global batch (int64 [size])."""
        if self.sampler == "epochs":
            which = self.blend(split, (step + 1) * size)[0]
            return np.asarray(which[step * size : (step + 1) * size], dtype=np.int64)
        return self.draw_sources(self.step_rng(split, step), size)

    def draw_sources(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.choice(len(self.weights), size=size, p=self.weights)

    def batch(
        self, step: int, size: int, split: str = "train", rows: slice | None = None
    ) -> torch.Tensor:
        """The global batch of `step`, or its rows `rows` (only their tokens read): LongTensor
        [len(rows), seq_len + 1], rows in draw order."""
        picked = range(size)[rows if rows is not None else slice(None)]
        if step < 0 or split not in ("train", "val"):
            raise ValueError(f"step must be >= 0 and split train or val, got {step}, {split!r}")
        if self.sampler == "epochs":
            out = self._epochs_rows(step * size + picked.start, step * size + picked.stop, split)
        else:
            out = self._random_rows(step, size, split, picked)
        import torch

        return torch.from_numpy(out)

    def _epochs_rows(self, first: int, stop: int, split: str) -> np.ndarray:
        which, within = self.blend(split, stop)
        which, within = np.asarray(which[first:stop]), np.asarray(within[first:stop])
        out = np.empty((stop - first, self.seq_len + 1), dtype=np.int64)
        for d, data in enumerate(self.datasets.values()):
            mine = which == d
            if mine.any():
                out[mine] = data.read(within[mine], split)
        return out

    def _random_rows(self, step: int, size: int, split: str, picked: range) -> np.ndarray:
        rng = self.step_rng(split, step)
        which = self.draw_sources(rng, size)
        # Children of the step's seed: a pure function of (seed, split, step, dataset index).
        children = rng.bit_generator.seed_seq.spawn(len(self.datasets))
        out = np.empty((len(picked), self.seq_len + 1), dtype=np.int64)
        for d, data in enumerate(self.datasets.values()):
            mine = np.flatnonzero(which == d)
            keep = (mine >= picked.start) & (mine < picked.stop)
            if keep.any():  # the dataset draws all its rows' windows, returns the kept ones
                child = np.random.default_rng(children[d])
                out[mine[keep] - picked.start] = data.draw(child, len(mine), split, keep)
        return out

    def rows_per_dataset(self, step: int, size: int) -> np.ndarray:
        """How many rows of train step `step` each dataset gives (int64 [n_datasets])."""
        return np.bincount(self.sources(step, size), minlength=len(self.datasets))

    def rows_before(self, step: int, size: int) -> np.ndarray:
        """How many rows of train steps 0..step-1 each dataset gave (int64 [n_datasets])."""
        if self.sampler == "epochs":
            which = self.blend("train", step * size)[0][: step * size]
            return np.bincount(which, minlength=len(self.datasets)).astype(np.int64)
        total = np.zeros(len(self.datasets), dtype=np.int64)
        for s in range(step):
            total += self.rows_per_dataset(s, size)
        return total


class BlendTokens:
    """`tokens/<name>`: the tokens each dataset gave to steps 0..s. At a resume the earlier
    steps' draws are recomputed (a few microseconds a step), so a resumed run logs the same
    counts as an uninterrupted one and no counter needs to live in the checkpoint."""

    def __init__(self, data: BlendData, start: int, size: int):
        self.data, self.size = data, size
        self.rows = data.rows_before(start, size)

    def after(self, step: int) -> dict[str, int]:
        """Add train step `step` (0-based) and return the running counts."""
        self.rows += self.data.rows_per_dataset(step, self.size)
        tokens = self.rows * self.data.seq_len  # as consumed_tokens: seq_len targets a row
        return {f"tokens/{name}": int(n) for name, n in zip(self.data.names, tokens)}
