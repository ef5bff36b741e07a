"""tools/inspect_data.py (megapipe/cli/inspect_data.py): each step's rows as document pieces
that add up to seq_len + 1 tokens and are the tokens training reads, dp ranks' rows as slices of
the batch, blends naming their datasets, --decode, --verify and one-line errors."""

import json

import numpy as np
import pytest

from megapipe.cli.inspect_data import main
from megapipe.config import load_config
from megapipe.data.loader import build_data
from megapipe.data.prepare import prepare
from megapipe.data.tokenizers import load_tokenizer
from tests.conftest import TINY
from tests.dataset_files import random_documents, write_dataset
from tests.test_data import make_docs, write_txt

SEQ, BATCH = 16, 8  # configs/tiny.yaml


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    prepare(tmp / "ds", inputs=write_txt(tmp, make_docs(6)), vocab_size=300, val_fraction=0.34)
    return tmp / "ds"


def overrides(path, *extra):
    return ["--data.source=memmap", f"--data.path={path}", "--model.vocab_size=320", *extra]


def run(capsys, *argv) -> list[dict]:
    assert main(["--config", TINY, *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def tokens_of(root, split="train"):
    meta = json.loads((root / "meta.json").read_text())
    return np.fromfile(root / f"{split}.bin", dtype=meta["dtype"])


def row_tokens(row, files) -> np.ndarray:
    return np.concatenate([files[p[3] if len(p) > 3 else None][p[1] : p[2]] for p in row])


@pytest.mark.parametrize("sampler", ["epochs", "random"])
def test_rows_are_the_tokens_training_reads(dataset, capsys, sampler):
    args = overrides(dataset, f"--data.sampler={sampler}")
    lines = run(capsys, *args, "--steps", "2:5")
    assert [line["step"] for line in lines] == [2, 3, 4] and lines[0]["dp_rank"] is None
    cfg = load_config(TINY, [a[2:] for a in args])
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    tokens, docs = tokens_of(dataset), np.load(dataset / "train.docs.npy")
    for line in lines:
        batch = data.batch(line["step"], BATCH).numpy()
        assert len(line["rows"]) == BATCH
        for row, expected in zip(line["rows"], batch):
            assert sum(end - begin for _, begin, end in row) == SEQ + 1
            assert all(docs[d] <= b < e <= docs[d + 1] for d, b, e in row)
            assert (row_tokens(row, {None: tokens}) == expected).all()


def test_dp_rank_rows_are_its_slice(dataset, capsys):
    whole = run(capsys, *overrides(dataset), "--steps", "0:2")
    for rank in range(4):
        mine = run(
            capsys, *overrides(dataset, "--parallel.dp=4"), "--steps", "0:2", "--dp-rank", str(rank)
        )
        for a, b in zip(mine, whole):
            assert a["dp_rank"] == rank and a["rows"] == b["rows"][rank * 2 : rank * 2 + 2]


def test_blend_pieces_name_their_dataset(tmp_path, capsys):
    rng = np.random.default_rng(0)
    paths = []
    for name, (low, high) in {"web": (3, 50), "code": (50, 96)}.items():
        docs = {s: random_documents(rng, 30, low, high) for s in ("train", "val")}
        paths.append(write_dataset(tmp_path / name, docs, 96))
    blend = f"--data.blend={paths[0]}:0.7,{paths[1]}:0.3"
    args = ["--data.source=memmap", blend]
    lines = run(capsys, *args, "--steps", "0:3")
    cfg = load_config(TINY, [a[2:] for a in args])
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    files = {p.name: tokens_of(p) for p in paths}
    names = [p[3] for line in lines for row in line["rows"] for p in row]
    assert set(names) == {"web", "code"}
    for line in lines:
        for row, expected in zip(line["rows"], data.batch(line["step"], BATCH).numpy()):
            assert (row_tokens(row, files) == expected).all()


def test_decode_gives_each_rows_text(dataset, capsys):
    (line,) = run(capsys, *overrides(dataset), "--steps", "1", "--decode", "--dp-rank", "0")
    tokenizer = load_tokenizer(dataset / "tokenizer.model")
    tokens = tokens_of(dataset)
    assert len(line["text"]) == BATCH
    for row, text in zip(line["rows"], line["text"]):
        assert text == tokenizer.decode(row_tokens(row, {None: tokens}).tolist())


def test_verify_rescans_against_meta_and_docs(dataset, tmp_path, capsys):
    assert main(["--config", TINY, *overrides(dataset), "--verify"]) == 0
    assert ": ok" in capsys.readouterr().err
    copy = tmp_path / "ds"
    copy.mkdir()
    for file in dataset.iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    docs = np.load(copy / "train.docs.npy")
    docs[1] += 1  # a document end that is not an EOS
    np.save(copy / "train.docs.npy", docs)
    assert main(["--config", TINY, *overrides(copy), "--verify", "--steps", "0"]) == 1
    assert "MISMATCH" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "3:1"], r"--steps '3:1' is empty"),
        (["--steps", "x"], r"--steps 'x' is not A:B"),
        (["--steps", "0:1", "--dp-rank", "2"], r"--dp-rank 2 is not in \[0, parallel.dp=1\)"),
        ([], r"give --steps A:B"),
    ],
)
def test_errors_are_one_line(dataset, capsys, argv, message):
    import re

    assert main(["--config", TINY, *overrides(dataset), *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1
