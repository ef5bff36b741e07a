"""The epochs sampler (data/sample_index.py): epoch coverage and shuffling, the windows read
against a plain concatenation, the cache (reuse, invalidation, concurrent builders), per-rank
rows under dp 1/2/4 with and without a blend, and Megatron's exact blend weighting."""

import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megapipe.data.blend import blend_indices
from megapipe.data.errors import DataError
from megapipe.data.layout import read_docs, read_meta
from megapipe.data.loader import build_data
from megapipe.data.sample_index import INDEX_DIR, SampleIndex, n_windows
from tests.dataset_files import random_documents, write_dataset

VOCAB, SEQ = 96, 16


@pytest.fixture
def dataset(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    docs = {"train": random_documents(rng, 60, 3, VOCAB), "val": random_documents(rng, 9, 3, 96)}
    return write_dataset(tmp_path / "ds", docs, VOCAB)


def cfgs(path="", sampler="epochs", blend="", source="memmap"):
    data = SimpleNamespace(source=source, path=str(path), tokenizer="", blend=blend,
                           sampler=sampler)  # fmt: skip
    return data, SimpleNamespace(vocab_size=VOCAB, seq_len=SEQ)


def tokens_of(root: Path, split: str = "train") -> np.ndarray:
    return np.fromfile(root / f"{split}.bin", dtype=np.uint16).astype(np.int64)


def open_index(root: Path, samples: int, seed: int = 0, seq_len: int = SEQ) -> SampleIndex:
    docs = read_docs(root, "train", read_meta(root))
    return SampleIndex.open(root, "train", docs, seq_len, seed, samples)


def test_one_epoch_of_windows_holds_every_token_and_reads_the_concatenation(dataset):
    tokens, docs = tokens_of(dataset), np.load(dataset / "train.docs.npy")
    n, n_docs = len(tokens), len(docs) - 1
    index = open_index(dataset, 3 * n // SEQ)  # several epochs
    epochs = len(index.doc_idx) // n_docs
    assert epochs >= 3 and index.n_samples == n_windows(n, SEQ, epochs)
    # each epoch's document order is a permutation of its own, and they differ
    orders = np.asarray(index.doc_idx[: epochs * n_docs]).reshape(epochs, n_docs)
    assert all(sorted(o) == list(range(n_docs)) for o in orders)
    assert not (orders[0] == np.arange(n_docs)).all() and not (orders[0] == orders[1]).all()
    # a plain concatenation of the epochs' documents, windows cut at k·L
    concat = np.concatenate([tokens[docs[d] : docs[d + 1]] for d in index.doc_idx])
    samples = np.arange(index.n_samples)
    row, doc, begin, end = index.pieces(samples)
    assert ((begin >= docs[doc]) & (end <= docs[doc + 1]) & (end > begin)).all()
    lengths = np.bincount(row, weights=end - begin, minlength=len(samples))
    assert (lengths == SEQ + 1).all()
    windows = np.asarray(index.shuffle)
    for i in samples:
        k = windows[i]
        got = np.concatenate([tokens[b:e] for b, e in zip(begin[row == i], end[row == i])])
        assert (got == concat[k * SEQ : k * SEQ + SEQ + 1]).all(), i
    # the first epoch's samples are its windows, shuffled: every token of the split is in one
    first = -(-n // SEQ)
    assert (
        sorted(windows[:first]) == list(range(first))
        and not (windows[:first] == np.arange(first)).all()
    )
    covered = np.zeros(n, bool)
    for b, e in zip(begin[row < first], end[row < first]):
        covered[b:e] = True
    assert covered.all()


def test_more_epochs_keep_the_earlier_order(dataset):
    """A longer run (more epochs) sees the same samples first: each epoch is shuffled alone."""
    short, long = open_index(dataset, 10), open_index(dataset, 500)
    assert long.folder != short.folder and long.n_samples > short.n_samples
    assert (np.asarray(long.shuffle[: short.n_samples]) == short.shuffle).all()
    assert (np.asarray(long.doc_idx[: len(short.doc_idx)]) == short.doc_idx).all()
    data = build_data(*cfgs(dataset), seed=0, samples={"train": 40, "val": 8})
    more = build_data(*cfgs(dataset), seed=0, samples={"train": 4000, "val": 8})
    assert (data.batch(3, 8) == more.batch(3, 8)).all()


def test_cache_is_reused_and_keyed_by_seed_seq_len_and_data(dataset):
    first = open_index(dataset, 100)
    stamps = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in first.folder.iterdir()}
    again = open_index(dataset, 100)
    assert again.folder == first.folder
    assert {
        f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in again.folder.iterdir()
    } == stamps
    assert open_index(dataset, 100, seed=1).folder != first.folder
    assert open_index(dataset, 100, seq_len=8).folder != first.folder
    meta = (dataset / "meta.json").read_text()
    (dataset / "meta.json").write_text(meta.replace('"format": 2', '"format": 2 '))
    assert open_index(dataset, 100).folder != first.folder  # other data, another index
    names = [p.name for p in (dataset / INDEX_DIR).iterdir() if not p.name.startswith(".")]
    assert len(names) == 4 and all(n.startswith("train-") for n in names)


def _build_in_child(root: str, barrier) -> str:
    barrier.wait()
    return str(open_index(Path(root), 5000).folder)


def test_concurrent_builders_make_one_index(dataset):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(2)
        with ctx.Pool(2) as pool:
            folders = pool.starmap(_build_in_child, [(str(dataset), barrier)] * 2)
    assert folders[0] == folders[1]
    entries = os.listdir(dataset / INDEX_DIR)
    assert [e for e in entries if not e.endswith(".lock")] == [Path(folders[0]).name]
    index, fresh = SampleIndex(Path(folders[0]), None, SEQ), open_index(dataset, 5000)
    assert fresh.folder == index.folder
    expected = dataset.parent / "alone"
    expected.mkdir()
    for name in ("train.bin", "train.docs.npy", "val.bin", "val.docs.npy", "meta.json"):
        (expected / name).write_bytes((dataset / name).read_bytes())
    alone = open_index(expected, 5000)  # the same index, built by one process alone
    for name in ("doc_idx", "cum", "shuffle"):
        assert (np.asarray(getattr(alone, name)) == getattr(index, name)).all(), name


def test_format_1_data_is_refused_with_the_fix(dataset):
    (dataset / "train.docs.npy").unlink()
    fix = (
        r"train.docs.npy not found .*rerun python tools/prepare_data.py or set data.sampler: random"
    )
    with pytest.raises(DataError, match=fix) as err:
        build_data(*cfgs(dataset), seed=0)
    assert "\n" not in str(err.value)
    assert build_data(*cfgs(dataset, sampler="random"), seed=0).batch(0, 4).shape == (4, SEQ + 1)


def test_batches_are_index_windows_and_the_same_on_every_mesh(dataset):
    data = build_data(*cfgs(dataset), seed=3, samples={"train": 64, "val": 8})
    index, tokens = data.sample_index("train"), tokens_of(dataset)
    batch = data.batch(2, 8).numpy()
    row, _, begin, end = index.pieces(np.arange(16, 24))
    for i in range(8):
        assert (
            batch[i]
            == np.concatenate([tokens[b:e] for b, e in zip(begin[row == i], end[row == i])])
        ).all()
    for dp in (1, 2, 4):
        for step in range(3):
            parts = [
                data.batch(step, 8, rows=slice(r * 8 // dp, (r + 1) * 8 // dp)) for r in range(dp)
            ]
            assert (np.concatenate(parts) == data.batch(step, 8).numpy()).all(), (dp, step)
    fresh = build_data(*cfgs(dataset), seed=3)  # another process, no hint: the same batch
    assert (fresh.batch(2, 8) == batch).all()
    assert not (build_data(*cfgs(dataset), seed=4).batch(2, 8) == batch).all()


def test_per_rank_reads_read_only_their_rows(dataset):
    data = build_data(*cfgs(dataset), seed=0, samples={"train": 64, "val": 8})
    data.bytes_read = 0
    data.batch(1, 8, rows=slice(2, 4))
    assert data.bytes_read == 2 * (SEQ + 1) * 2  # two rows of uint16


def reference_blend(weights: list[float], size: int) -> list[int]:
    """Megatron's build_blending_indices, written out plainly."""
    counts, out = [0] * len(weights), []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        best = max(range(len(weights)), key=lambda d: (errors[d], -d))
        out.append(best)
        counts[best] += 1
    return out


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [1, 1], [1, 2, 3, 4, 5], [0.5, 0.25, 0.25]])
def test_blend_indices_are_megatrons(weights):
    w = (np.asarray(weights, float) / np.sum(weights)).tolist()
    which, within = blend_indices(w, 3000)
    assert which.tolist() == reference_blend(w, 3000)
    for d in range(len(w)):
        assert (within[which == d] == np.arange((which == d).sum())).all()
        counts = np.cumsum(which == d)
        assert np.abs(counts - np.asarray(w[d]) * np.arange(1, 3001)).max() <= 1.0


@pytest.fixture
def blend(tmp_path) -> str:
    rng = np.random.default_rng(1)
    parts = []
    for name, (low, high), weight in (
        ("web", (3, 40), 0.6),
        ("code", (40, 70), 0.3),
        ("books", (70, 96), 0.1),
    ):
        docs = {s: random_documents(rng, n, low, high) for s, n in (("train", 40), ("val", 10))}
        parts.append(f"{write_dataset(tmp_path / name, docs, VOCAB)}:{weight}")
    return ",".join(parts)


def test_blend_rows_follow_the_blend_index_and_every_mesh(blend):
    data = build_data(*cfgs(blend=blend), seed=2, samples={"train": 96, "val": 16})
    which, within = data.blend("train", 96)
    assert (np.abs(np.bincount(which[:96]) - data.weights * 96) <= 1).all()
    for step in range(3):
        batch = data.batch(step, 8).numpy()
        for i, row in enumerate(batch):
            d, s = which[step * 8 + i], within[step * 8 + i]
            one = list(data.datasets.values())[d]
            assert (row == one.read(np.array([s]), "train")[0]).all()
        for dp in (2, 4):
            parts = [
                data.batch(step, 8, rows=slice(r * 8 // dp, (r + 1) * 8 // dp)) for r in range(dp)
            ]
            assert (np.concatenate(parts) == batch).all(), (dp, step)
    assert data.rows_before(3, 8).tolist() == np.bincount(which[:24], minlength=3).tolist()


def test_random_sampler_rows_are_slices_of_its_global_batch(blend, tmp_path):
    data = build_data(*cfgs(blend=blend, sampler="random"), seed=2)
    whole = data.batch(5, 8)
    for dp in (2, 4):
        parts = [data.batch(5, 8, rows=slice(r * 8 // dp, (r + 1) * 8 // dp)) for r in range(dp)]
        assert (np.concatenate(parts) == whole.numpy()).all()


def test_synthetic_rows_are_slices_of_its_batch():
    data = build_data(*cfgs(source="synthetic"), seed=0)
    whole = data.batch(4, 8)
    assert (data.batch(4, 8, rows=slice(4, 8)) == whole[4:]).all()


def test_config_checks_the_sampler(tiny_cfg):
    from megapipe.config import ConfigError

    assert tiny_cfg().data.sampler == "epochs"
    with pytest.raises(ConfigError, match=r"data.sampler='shuffle' is not one of epochs, random"):
        tiny_cfg("data.sampler=shuffle")


def test_an_index_dir_that_cannot_be_made_is_one_line(dataset):
    (dataset / INDEX_DIR).write_text("not a directory")  # as a read-only dir would, for root too
    with pytest.raises(
        DataError, match=r"cannot write the sample index under .*data.sampler"
    ) as err:
        open_index(dataset, 10)
    assert "\n" not in str(err.value)


def test_microbatches_take_the_global_batch_or_exactly_this_ranks_rows():
    import torch

    from megapipe.train.batches import BatchSlice

    batch = torch.arange(8 * 5).reshape(8, 5)
    mine = BatchSlice(2, 1, global_batch=8)
    assert mine.rows(8) == slice(4, 8)
    whole = mine.microbatches(batch, 2)
    own = mine.microbatches(batch[mine.rows(8)], 2)
    assert all(
        (a.inputs == b.inputs).all() and (a.targets == b.targets).all() for a, b in zip(whole, own)
    )
    assert (torch.cat([m.inputs for m in own]) == batch[4:, :-1]).all()
    with pytest.raises(ValueError, match=r"batch of 3 rows is neither the global batch \(8\)"):
        mine.microbatches(batch[:3], 1)
