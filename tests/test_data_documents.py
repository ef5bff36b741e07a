"""Documents recorded at preparation (format 2): `<split>.docs.npy` offsets, meta.json's counts
and largest ids, the one-document tail split, and a start-up that reads no token."""

import json
from pathlib import Path

import numpy as np
import pytest

from megapipe.data.documents import SplitWriter, docs_path, move_tail_to_val
from megapipe.data.errors import DataError
from megapipe.data.loader import build_data
from megapipe.data.prepare import prepare
from megapipe.data.tokenizers import load_tokenizer
from megapipe.data.workers import Encoded
from tests.test_data import cfgs, copy_dataset, edit_meta, make_docs, read_split, write_txt

DOCS = make_docs(9, seed=11)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("docs")
    prepare(tmp / "ds", inputs=write_txt(tmp, DOCS), vocab_size=300, val_fraction=0.3)
    return tmp / "ds"


def meta_of(out: Path) -> dict:
    return json.loads((out / "meta.json").read_text())


def test_offsets_are_the_documents_between_eos_tokens(prepared):
    meta = meta_of(prepared)
    tokenizer = load_tokenizer(prepared / meta["tokenizer"])
    texts = []
    for split in ("train", "val"):
        tokens, docs = read_split(prepared, split), np.load(docs_path(prepared, split))
        assert docs.dtype == np.int64 and docs[0] == 0 and docs[-1] == len(tokens)
        eos = np.flatnonzero(tokens == meta["eos_id"])
        assert docs[1:].tolist() == (eos + 1).tolist()  # each document ends at its EOS
        texts += [tokenizer.decode(tokens[a : b - 1].tolist()) for a, b in zip(docs, docs[1:])]
    assert sorted(texts) == sorted(DOCS)


def test_meta_records_documents_and_largest_ids(prepared):
    meta = meta_of(prepared)
    assert meta["format"] == 2
    assert (meta["n_train_documents"], meta["n_val_documents"]) == (6, 3)  # round(9 * 0.3)
    for split in ("train", "val"):
        tokens = read_split(prepared, split)
        assert meta[f"max_{split}_id"] == int(tokens.max())
        assert meta[f"n_{split}_documents"] == len(np.load(docs_path(prepared, split))) - 1


def test_empty_val_split(tmp_path):
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, DOCS[:3]), vocab_size=300, val_fraction=0)
    assert (meta["n_val_documents"], meta["max_val_id"], meta["n_val_tokens"]) == (0, -1, 0)
    assert np.load(docs_path(out, "val")).tolist() == [0]
    assert meta["n_train_documents"] == 3


def test_offsets_do_not_depend_on_chunk_size(tmp_path, prepared):
    inputs = write_txt(tmp_path, DOCS)
    # 300 characters per chunk: one document each, so the offsets run on across 9 chunks
    small = tmp_path / "small"
    prepare(small, inputs=inputs, vocab_size=300, val_fraction=0.3, chunk_mb=3e-4)
    for name in ("train.docs.npy", "val.docs.npy", "train.bin", "val.bin"):
        assert (small / name).read_bytes() == (prepared / name).read_bytes(), name
    assert {**meta_of(small), "source": ""} == {**meta_of(prepared), "source": ""}


def test_one_document_is_cut_into_train_and_val(tmp_path):
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, DOCS[:1]), vocab_size=300, val_fraction=0.1)
    n_train, n_val = meta["n_train_tokens"], meta["n_val_tokens"]
    assert n_val == round((n_train + n_val) * 0.1) > 0
    assert np.load(docs_path(out, "train")).tolist() == [0, n_train]
    assert np.load(docs_path(out, "val")).tolist() == [0, n_val]  # starts at 0 at the cut
    assert (meta["n_train_documents"], meta["n_val_documents"]) == (1, 1)
    for split in ("train", "val"):
        assert meta[f"max_{split}_id"] == int(read_split(out, split).max())
    build_data(*cfgs(out, seq_len=8), seed=0).batch(0, 2, "val")  # the tail split is usable


def test_tail_cut_between_and_inside_documents(tmp_path):
    """move_tail_to_val on several documents: offsets past the cut move to val, shifted."""
    lengths = np.array([3, 4, 5], dtype=np.int64)
    tokens = np.arange(12, dtype=np.uint16)[::-1].copy()  # largest id first: 11
    for cut, train_docs, val_docs in ((5, [0, 3, 5], [0, 2, 7]), (7, [0, 3, 7], [0, 5])):
        root = tmp_path / str(cut)
        root.mkdir()
        writers = [SplitWriter(root, "train", 3), SplitWriter(root, "val", 0)]
        writers[0].append(Encoded(tokens, lengths, 11))
        assert all(writer.close() for writer in writers)
        stats = move_tail_to_val(root, 12 - cut, "uint16")
        assert np.load(docs_path(root, "train")).tolist() == train_docs
        assert np.load(docs_path(root, "val")).tolist() == val_docs
        assert read_split_raw(root, "val").tolist() == tokens[cut:].tolist()
        assert stats == {"n_train_tokens": cut, "n_val_tokens": 12 - cut,
                         "n_train_documents": len(train_docs) - 1, "max_train_id": 11,
                         "n_val_documents": len(val_docs) - 1, "max_val_id": 11 - cut}  # fmt: skip


def read_split_raw(root: Path, split: str) -> np.ndarray:
    return np.fromfile(root / f"{split}.bin", dtype=np.uint16)


# ---------------------------------------------------------------- start-up reads no token


def test_start_up_trusts_meta_and_reads_no_token(prepared, tmp_path):
    """Every id of train.bin overwritten with 65535: a format-2 dataset still opens (its
    largest id comes from meta.json), the same files as format 1 are scanned and refused."""
    copy = copy_dataset(prepared, tmp_path / "ds")
    train = read_split(copy, "train")
    np.full_like(train, 65535).tofile(copy / "train.bin")
    build_data(*cfgs(copy), seed=0)  # no scan: the planted ids go unseen
    format_1 = {k: v for k, v in meta_of(copy).items() if k != "max_train_id"}
    (copy / "meta.json").write_text(json.dumps(format_1))
    with pytest.raises(DataError, match=r"train.bin holds token id 65535 >= model.vocab_size"):
        build_data(*cfgs(copy), seed=0)


def test_recorded_largest_id_beyond_model_vocab(prepared, tmp_path):
    copy = copy_dataset(prepared, tmp_path / "ds")
    edit_meta(copy, vocab_size=100, max_train_id=250)
    with pytest.raises(DataError, match=r"train.bin holds token id 250 >= model.vocab_size 200; "
                       r"set model.vocab_size >= 251$"):  # fmt: skip
        build_data(*cfgs(copy, vocab_size=200), seed=0)


def test_missing_or_stale_offsets_are_refused(prepared, tmp_path):
    copy = copy_dataset(prepared, tmp_path / "ds")
    docs = np.load(docs_path(copy, "train"))
    np.save(docs_path(copy, "train"), docs[:-1])  # one document short
    with pytest.raises(DataError, match=r"train.docs.npy does not match meta.json \(\d+ documents"):
        build_data(*cfgs(copy, sampler="epochs"), seed=0)
    docs_path(copy, "train").write_bytes(b"not an array")
    with pytest.raises(DataError, match=r"train.docs.npy is corrupt .*rerun python tools/prep"):
        build_data(*cfgs(copy, sampler="epochs"), seed=0)
    docs_path(copy, "train").unlink()
    with pytest.raises(DataError, match=r"train.docs.npy not found .*rerun python tools/prep"):
        build_data(*cfgs(copy, sampler="epochs"), seed=0)
