"""The `data.sampler: epochs` sample index: Megatron-LM GPTDataset's document index -> sample
index -> shuffle index, built once beside the data and memory-mapped by every rank.

Per epoch e the split's documents (`<split>.docs.npy`: start offsets, docs/data.md) are shuffled
by a generator keyed by (seed, split, e) and concatenated; the epochs follow one another, so
position p of the concatenation is a token of epoch p // N (N tokens a split). Sample window k
covers positions [k·L, k·L + L + 1) (L = seq_len): consecutive windows share one boundary token,
as Megatron's (its add_extra_token), so one epoch's windows hold every token of the split. The
windows whose start lies in epoch e are shuffled among themselves (generator (seed, split, e)),
and the dataset's sample i is window shuffle[i]: a run of one epoch's samples sees each epoch-e
window once. Megatron shuffles documents and windows over all epochs at once; shuffling each
epoch on its own keeps epoch e's order the same whatever the number of epochs, so raising
train.steps (more epochs) leaves every earlier step's batch as it was.

What is materialised (int32 where the values fit): `doc_idx` (the documents in epoch order,
epochs·n_docs, and the first of the next epoch's, where the last window ends), `cum` (their
cumulative lengths, int64) and `shuffle` (the window permutation, every window that starts in
the epochs: so an index of more epochs begins with this one's samples). Megatron's `sample_idx`
(the document and offset where each window starts) is not stored: a window's pieces are found
by two searchsorted calls over `cum` when it is read (~2·log2(n_docs) page touches a row,
nothing next to reading seq_len tokens). That costs 12 bytes a document an epoch and saves a
pass over every window at build time and 8 bytes a window; the build is one shuffle and one
cumsum per epoch, all numpy (docs/benchmarks/2026-11-26-data-at-scale-cpu.md).

The cache: `<dataset>/index/<name>-<key>/` (key: sha256 of the seed, seq_len, split, epochs and
the data's identity: meta.json's bytes, the .bin's and docs.npy's size and mtime), built by one
process under an fcntl lock on `<dataset>/index/` (ranks on one machine wait for the builder),
written into a temporary dir and renamed into place (a dir that exists is complete; a second
builder on another machine renames onto it, fails, and uses the one already there).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from megapipe.data.errors import DataError
from megapipe.data.layout import META_FILE, docs_path

INDEX_DIR = "index"  # under the dataset dir
VERSION = 1  # of the index layout and its rules: part of every key
SPLITS = {"train": 0, "val": 1}  # the split's number is part of every generator key
DOCS, WINDOWS = 0, 1  # what a generator shuffles, also part of its key
INT32_MAX = np.iinfo(np.int32).max


def identity(root: Path, split: str) -> dict[str, Any]:
    """What must be unchanged for a cached index to hold: meta.json's bytes, and the size and
    modification time of the split's token and document files."""
    stamps = {}
    for path in (root / f"{split}.bin", docs_path(root, split)):
        stat = path.stat()
        stamps[path.name] = [stat.st_size, stat.st_mtime_ns]
    meta = hashlib.sha256((root / META_FILE).read_bytes()).hexdigest()
    return {"meta_sha256": meta, "files": stamps}


def epochs_for(n_tokens: int, seq_len: int, samples: int) -> int:
    """The fewest epochs whose windows number at least `samples`."""
    return max(1, (max(samples, 1) - 1) * seq_len // n_tokens + 1)  # ceil(E·N / L) >= samples


def n_windows(n_tokens: int, seq_len: int, epochs: int) -> int:
    """The windows that start in the first `epochs` epochs (the last may end in the next)."""
    return -(-epochs * n_tokens // seq_len)


def generator(seed: int, split: str, epoch: int, what: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS[split], epoch, what])


def _fit(limit: int) -> type:
    return np.int32 if limit <= INT32_MAX else np.int64


def _order(n_docs: int, dtype: type, seed: int, split: str, epoch: int) -> np.ndarray:
    order = np.arange(n_docs, dtype=dtype)
    generator(seed, split, epoch, DOCS).shuffle(order)
    return order


def build_index(docs: np.ndarray, seq_len: int, seed: int, split: str, epochs: int, out: Path):
    """Write doc_idx.npy, cum.npy and shuffle.npy into `out`: the documents of `epochs` epochs
    and the first few of the next (enough for the last window to end there), the windows that
    start in those epochs. Memory: one epoch at a time; arrays written through memory maps."""
    n_docs, n_tokens = len(docs) - 1, int(docs[-1])
    lengths = np.diff(docs).astype(_fit(n_tokens))
    dtype = _fit(n_docs)
    # the next epoch's first documents, where the last window ends (seq_len + 1 documents hold
    # seq_len + 1 tokens: each holds at least its EOS)
    spill = _order(n_docs, dtype, seed, split, epochs)[: seq_len + 1]
    spill = spill[: int(np.searchsorted(np.cumsum(lengths[spill]), seq_len + 1)) + 1]
    total = epochs * n_docs + len(spill)
    doc_idx = open_memmap(out / "doc_idx.npy", "w+", dtype, (total,))
    cum = open_memmap(out / "cum.npy", "w+", np.int64, (total + 1,))
    cum[0] = 0
    for epoch in range(epochs + 1):  # a loop over epochs only: one shuffle, one cumsum each
        low, high = epoch * n_docs, min((epoch + 1) * n_docs, total)
        order = _order(n_docs, dtype, seed, split, epoch) if epoch < epochs else spill
        doc_idx[low:high] = order
        sums = cum[low + 1 : high + 1]
        np.cumsum(lengths[order], out=sums, dtype=np.int64)
        sums += epoch * n_tokens
    windows = n_windows(n_tokens, seq_len, epochs)
    shuffle = open_memmap(out / "shuffle.npy", "w+", _fit(windows), (windows,))
    for epoch in range(epochs):  # the windows starting in this epoch, shuffled among themselves
        low, high = -(-epoch * n_tokens // seq_len), -(-(epoch + 1) * n_tokens // seq_len)
        part = np.arange(low, high, dtype=shuffle.dtype)  # a plain array: shuffling through a
        generator(seed, split, epoch, WINDOWS).shuffle(part)  # memmap goes element by element
        shuffle[low:high] = part
    for array in (doc_idx, cum, shuffle):
        array.flush()


def cached(root: Path, name: str, key: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """`root/index/<name>-<digest of key>`, built by `build(tmp_dir)` if absent: one builder
    under an fcntl lock, the others wait and then use its result."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    base = root / INDEX_DIR
    folder = base / f"{name}-{digest}"
    if folder.is_dir():
        return folder
    try:
        base.mkdir(exist_ok=True)
        lock = (base / f".{folder.name}.lock").open("w")
    except OSError as err:
        raise _unwritable(base, err) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not folder.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=base))
            try:
                build(tmp)
                (tmp / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True))
                os.rename(tmp, folder)
            except OSError as err:
                if not folder.is_dir():  # else another machine's builder came first: use it
                    raise _unwritable(base, err) from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _unwritable(base: Path, err: OSError) -> DataError:
    return DataError(
        f"cannot write the sample index under {base} ({err.strerror}); make it writable (and "
        "give it room) or set data.sampler: random"
    )


class SampleIndex:
    """One split's index, memory-mapped: sample i -> the pieces of its window."""

    def __init__(self, folder: Path, docs: np.ndarray, seq_len: int):
        self.folder, self.docs, self.seq_len = folder, docs, seq_len
        self.doc_idx = np.load(folder / "doc_idx.npy", mmap_mode="r")
        self.cum = np.load(folder / "cum.npy", mmap_mode="r")
        self.shuffle = np.load(folder / "shuffle.npy", mmap_mode="r")
        self.n_samples = len(self.shuffle)

    @staticmethod
    def open(root: Path, split: str, docs: np.ndarray, seq_len: int, seed: int, samples: int):
        """The index of `split` with at least `samples` samples, built if not cached."""
        n_tokens = int(docs[-1])
        epochs = epochs_for(n_tokens, seq_len, samples)
        key = {"version": VERSION, "seed": seed, "seq_len": seq_len, "split": split,
               "epochs": epochs, "data": identity(root, split)}  # fmt: skip
        build = partial(build_index, docs, seq_len, seed, split, epochs)
        folder = cached(root, f"{split}-L{seq_len}-E{epochs}", key, build)
        return SampleIndex(folder, docs, seq_len)

    def pieces(self, samples: np.ndarray) -> tuple[np.ndarray, ...]:
        """(row, document, begin, end) of every piece of the samples' windows, rows in the
        order given and pieces in window order; begin/end are offsets in the split's .bin."""
        starts = np.asarray(self.shuffle[samples], dtype=np.int64) * self.seq_len
        row, j, low, high = cut(starts, self.seq_len + 1, self.cum)
        doc = np.asarray(self.doc_idx[j], dtype=np.int64)
        begin = np.asarray(self.docs[doc], dtype=np.int64) + low - self.cum[j]
        return row, doc, begin, begin + (high - low)


def cut(starts: np.ndarray, length: int, cum: np.ndarray) -> tuple[np.ndarray, ...]:
    """The pieces of windows [s, s + length) over the spans [cum[j], cum[j+1]): (row, j, low,
    high), positions in cum's coordinates; empty spans (no tokens) left out. Vectorised: the
    first and last span of each window by searchsorted, the ones between by a repeat."""
    first = np.searchsorted(cum, starts, side="right") - 1
    last = np.searchsorted(cum, starts + length - 1, side="right") - 1
    counts = last - first + 1
    row = np.repeat(np.arange(len(starts)), counts)
    step = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    j = first[row] + step
    low = np.maximum(np.asarray(cum[j]), starts[row])
    high = np.minimum(np.asarray(cum[j + 1]), starts[row] + length)
    keep = high > low
    return row[keep], j[keep], low[keep], high[keep]


def gather(tokens: np.ndarray, begin: np.ndarray, end: np.ndarray, width: int) -> np.ndarray:
    """The tokens of pieces laid end to end, as rows of `width`: one fancy index into the
    memmap, which reads only the pages the pieces lie on."""
    lengths = end - begin
    placed = np.cumsum(lengths) - lengths  # where each piece starts in the output
    flat = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(begin - placed, lengths)
    return np.asarray(tokens[flat]).reshape(-1, width)
