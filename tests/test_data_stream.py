"""Streaming preparation: bounded memory, chunk- and worker-independent output, every input
kind, and the one-line errors of megapipe/data/inputs.py and prepare.py."""

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from megapipe.data.errors import DataError
from megapipe.data.loader import build_data
from megapipe.data.prepare import prepare
from tests.test_data import cfgs, decode_docs, make_docs, read_split, write_txt

ROOT = Path(__file__).resolve().parents[1]
# Peak RSS of one preparation process, measured: 47 MB for 5, 10 and 20 MB corpora in 0.25 MB
# chunks (preparation imports neither torch nor datasets for these inputs); the same corpora in
# one chunk peak at 89, 135 and 229 MB. The bound leaves 60% margin over the streaming runs
# and is still under the smallest one-chunk peak.
RSS_BOUND_MB = 75
RSS_GROWTH = 1.15  # a corpus twice as large may cost at most 15% more peak memory


def write_jsonl(path: Path, n_mb: float) -> Path:
    """About n_mb MB of distinct pseudo-verse documents, written fast: 64 bases cycled."""
    bases = make_docs(64, seed=9)
    size, i = 0, 0
    with path.open("w", encoding="utf-8") as f:
        while size < n_mb * 1e6:
            doc = f"{i}\n{bases[i % 64]}"
            f.write(json.dumps({"text": doc}) + "\n")
            size, i = size + len(doc), i + 1
    return path


def peak_rss_mb(corpus: Path, out: Path, chunk_mb: float) -> int:
    """Peak RSS of a child that prepares `corpus`, read by a tiny parent from RUSAGE_CHILDREN
    (this test process has other children whose peak would hide it)."""
    job = (
        "from megapipe.data.prepare import prepare; "
        f"prepare({str(out)!r}, inputs=[{str(corpus)!r}], vocab_size=300, "
        f"chunk_mb={chunk_mb}, tokenizer_sample_mb=0.5)"
    )
    parent = (
        "import resource, subprocess, sys; "
        f"subprocess.run([sys.executable, '-c', {job!r}], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return int(done.stdout.split()[-1]) // 1024  # Linux reports KiB


def same_dataset(a: Path, b: Path) -> bool:
    files = ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy", "meta.json",
             "tokenizer.model")  # fmt: skip
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.mark.spawn
def test_memory_is_bounded_and_output_independent_of_chunk_size(tmp_path):
    small = write_jsonl(tmp_path / "small.jsonl", 5)
    large = write_jsonl(tmp_path / "large.jsonl", 10)
    rss_small = peak_rss_mb(small, tmp_path / "small", chunk_mb=0.25)  # 20+ chunks
    rss_large = peak_rss_mb(large, tmp_path / "large", chunk_mb=0.25)  # 40+ chunks
    assert rss_small < RSS_BOUND_MB and rss_large < RSS_BOUND_MB, (rss_small, rss_large)
    assert rss_large <= rss_small * RSS_GROWTH, (rss_small, rss_large)
    one_chunk = tmp_path / "one_chunk"
    prepare(one_chunk, inputs=[small], vocab_size=300, chunk_mb=64, tokenizer_sample_mb=0.5)
    assert same_dataset(tmp_path / "small", one_chunk)


@pytest.mark.spawn
def test_one_and_two_workers_give_identical_bytes(tmp_path):
    inputs = [write_jsonl(tmp_path / "c.jsonl", 0.3)]
    for workers in (1, 2):
        prepare(tmp_path / f"w{workers}", inputs=inputs, vocab_size=300, chunk_mb=0.02,
                workers=workers)  # fmt: skip
    assert same_dataset(tmp_path / "w1", tmp_path / "w2")


# ---------------------------------------------------------------- input kinds


def all_docs(out: Path) -> list[str]:
    splits = [s for s in ("train", "val") if read_split(out, s).size]
    return sorted(doc for split in splits for doc in decode_docs(out, split))


def test_txt_document_modes(tmp_path):
    extra = make_docs(2)
    text = "thou art the king\nof night\n\n\nmy lord speak\n  \nfair ghost sword\n\n"
    text += extra[0] + "\n" + extra[1]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text)
    expected = {
        "file": [text],
        "paragraph": ["thou art the king\nof night", "my lord speak", "fair ghost sword",
                      extra[0].rstrip("\n"), extra[1].rstrip("\n")],
        "line": [line for line in text.split("\n") if line.strip()],
    }  # fmt: skip
    for mode, docs in expected.items():
        out = tmp_path / mode
        meta = prepare(out, inputs=[tmp_path / "in"], vocab_size=300, txt_doc=mode, val_fraction=0)
        assert meta["n_documents"] == len(docs) and all_docs(out) == sorted(docs), mode


def test_jsonl_gz_parquet_row_groups_json_array_and_glob(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(11, seed=4)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:3])
    pq.write_table(pa.table({"text": docs[3:9]}), tmp_path / "b.parquet", row_group_size=2)
    assert pq.ParquetFile(tmp_path / "b.parquet").num_row_groups == 3
    (tmp_path / "c.json").write_text(json.dumps([{"text": d} for d in docs[9:]]))  # one array
    out = tmp_path / "ds"
    inputs = [tmp_path / "*.jsonl.gz", tmp_path / "b.parquet", tmp_path / "c.json"]
    meta = prepare(out, inputs=inputs, vocab_size=300)
    assert meta["n_documents"] == 11 and all_docs(out) == sorted(docs)


def test_hf_dataset_saved_to_disk(tmp_path):
    from datasets import Dataset

    docs = make_docs(5, seed=6)
    Dataset.from_dict({"body": docs, "n": list(range(5))}).save_to_disk(str(tmp_path / "hf"))
    out = tmp_path / "ds"
    meta = prepare(out, inputs=[tmp_path / "hf"], text_field="body", vocab_size=300)
    assert meta["n_documents"] == 5 and all_docs(out) == sorted(docs)


def cache_hf_dataset(cache: Path, config: str, split: str, rows: dict) -> None:
    """Put `rows` in the HF datasets cache `cache` as megapipe-test/tiny_corpus, laid out as
    load_dataset leaves a Hub dataset it downloaded (same builder kwargs: repo_id and
    dataset_name), so that load_dataset finds it offline by name."""
    from datasets.packaged_modules.generator.generator import Generator

    def generate(rows):
        for i in range(len(rows["body"])):
            yield {key: column[i] for key, column in rows.items()}

    Generator(
        cache_dir=str(cache), dataset_name="tiny_corpus", repo_id="megapipe-test/tiny_corpus",
        config_name=config, config_id=config, hash="0123456789abcdef",
        generator=generate, gen_kwargs={"rows": rows}, split=split,
    ).download_and_prepare()  # fmt: skip


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """(cache dir, docs): configs 'default' (split train: docs 0-3) and 'small' (split
    validation: docs 4-6), the cache being this process's HF_DATASETS_CACHE."""
    import datasets

    docs = make_docs(7, seed=8)
    cache = tmp_path / "hf_home" / "datasets"
    cache_hf_dataset(cache, "default", "train", {"body": docs[:4], "n": list(range(4))})
    cache_hf_dataset(cache, "small", "validation", {"body": docs[4:], "n": list(range(3))})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache, docs


def test_hf_dataset_in_the_local_cache(hf_cache):
    cache, docs = hf_cache
    out = cache.parents[1] / "ds"
    inputs = [
        "hf:megapipe-test/tiny_corpus:default",
        "hf:megapipe-test/tiny_corpus:small:validation",
    ]
    meta = prepare(out, inputs=inputs, text_field="body", vocab_size=300)
    assert meta["n_documents"] == 7 and all_docs(out) == sorted(docs)


@pytest.mark.spawn
def test_prepare_data_cli_reads_the_hf_cache_when_the_user_is_offline(hf_cache):
    """The CLI finds the cache from HF_HOME; HF_DATASETS_OFFLINE alone, as the user set it,
    keeps datasets off the network."""
    cache, docs = hf_cache
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "OFFLINE" not in k}
    env["HF_HOME"], env["HF_DATASETS_OFFLINE"] = str(cache.parent), "1"
    out = cache.parents[1] / "ds"
    cmd = [sys.executable, "tools/prepare_data.py", "--input", "hf:megapipe-test/tiny_corpus:small",
           "--text-field", "body", "--vocab-size", "300", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all_docs(out) == sorted(docs[4:])


def test_hf_cache_input_errors(hf_cache):
    cache, _ = hf_cache
    out = cache.parents[1] / "ds"
    cases = {
        "hf:megapipe-test/absent": r"input hf:megapipe-test/absent is not in the local HF datasets "
        r"cache .*datasets \(offline mode is set\): unset HF_DATASETS_OFFLINE and HF_HUB_OFFLINE "
        r"to stream it from the Hub, or on a machine with network run datasets.load_dataset\("
        r"'megapipe-test/absent'\) with the same HF_HOME .*or save it with save_to_disk",
        "hf:megapipe-test/tiny_corpus": r"has several configs in the cache \(default, small\); "
        "write hf:NAME:CONFIG$",
        "hf:megapipe-test/tiny_corpus:big": r"has no config 'big' in the cache \(cached configs: "
        r"\['default', 'small'\]\)$",
        "hf:megapipe-test/tiny_corpus:small:train": r"has no split 'train' in the cache \(Should "
        r"be one of \['validation'\]\.\)$",
        "hf:": r"input hf:: write hf:NAME\[:CONFIG\[:SPLIT\]\]\[@REVISION\], e.g. hf:org/name or "
        r"hf:org/name@refs/convert/parquet$",
    }
    for given, message in cases.items():
        with pytest.raises(DataError, match=message) as err:
            prepare(out, inputs=[given], text_field="body", vocab_size=300)
        assert "\n" not in str(err.value), given


def test_uint32_tokens_for_a_large_vocabulary(tmp_path):
    """A 70000-word vocabulary: ids above 65535 are stored as uint32 and sampled intact."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for d in make_docs(3) for w in d.split()})
    vocab = {f"<pad{i}>": i for i in range(70000 - len(words) - 2)}
    vocab.update({"<unk>": len(vocab), "<eos>": len(vocab) + 1})
    for word in words:  # the corpus words get the highest ids
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(tmp_path / "hf_tok"))
    out = tmp_path / "ds"
    meta = prepare(out, inputs=write_txt(tmp_path, make_docs(3)), tokenizer_dir=tmp_path / "hf_tok",
                   val_fraction=0)  # fmt: skip
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70000
    tokens = read_split(out, "train")
    assert tokens.dtype == np.uint32 and tokens.max() > 65535
    batch = build_data(*cfgs(out, vocab_size=70000, seq_len=8), seed=0).batch(0, 4).numpy()
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 9)
    assert batch.max() > 65535 and all((windows == row).all(axis=1).any() for row in batch)


def test_sentencepiece_model_file_as_tokenizer(tmp_path):
    """--tokenizer FILE.model: the given model, copied in, gives the dataset that trained it."""
    inputs = [write_jsonl(tmp_path / "c.jsonl", 0.1)]
    prepare(tmp_path / "trained", inputs=inputs, vocab_size=300)
    model = tmp_path / "given.model"
    model.write_bytes((tmp_path / "trained" / "tokenizer.model").read_bytes())
    meta = prepare(tmp_path / "given", inputs=inputs, tokenizer_dir=model)
    assert meta["tokenizer"] == "tokenizer.model" and meta["vocab_size"] == 300
    assert same_dataset(tmp_path / "trained", tmp_path / "given")
    (tmp_path / "bad.model").write_text("not a model")
    message = r"--tokenizer .*bad.model is not a sentencepiece .model file \(.*\); give a .model"
    with pytest.raises(DataError, match=message + " file or a local HF tokenizer dir$"):
        prepare(tmp_path / "bad", inputs=inputs, tokenizer_dir=tmp_path / "bad.model")


def test_interrupted_run_leaves_temp_dir_that_next_run_removes(tmp_path):
    stale = tmp_path / ".ds.tmp"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"half written")
    prepare(tmp_path / "ds", inputs=write_txt(tmp_path, make_docs(2)), vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ds"]


# ---------------------------------------------------------------- errors


def test_vocabulary_too_large_names_the_largest_that_works(tmp_path):
    inputs = write_txt(tmp_path, make_docs(3))
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "ds", inputs=inputs, vocab_size=60000)
    message = str(err.value)
    assert "\n" not in message and "set --vocab-size <= " in message
    largest = int(message.rsplit("<= ", 1)[1])
    assert prepare(tmp_path / "ds", inputs=inputs, vocab_size=largest)["vocab_size"] == largest


def test_input_that_matches_nothing(tmp_path):
    with pytest.raises(DataError, match=r"input glob .*nothing\*.jsonl matches nothing"):
        prepare(tmp_path / "ds", inputs=[tmp_path / "nothing*.jsonl"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"input dir .*empty_dir holds no .*\.txt"):
        prepare(tmp_path / "ds", inputs=[tmp_path / "empty_dir"])


def test_corrupt_jsonl_and_gzip_name_file_and_line(tmp_path):
    good = write_txt(tmp_path, make_docs(2))
    lines = [json.dumps({"text": d}) for d in make_docs(3)]
    (tmp_path / "bad.jsonl").write_text("\n".join([*lines[:2], '{"text": "thou', lines[2]]))
    with pytest.raises(DataError, match=r"bad.jsonl is not valid json: .* at line 3 column"):
        prepare(tmp_path / "ds", inputs=[*good, tmp_path / "bad.jsonl"], vocab_size=300)
    payload = gzip.compress("\n".join(lines * 200).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(payload[: len(payload) // 2])
    with pytest.raises(DataError, match=r"cut.jsonl.gz is corrupt at line \d+: "):
        prepare(tmp_path / "ds", inputs=[*good, tmp_path / "cut.jsonl.gz"], vocab_size=300)
    assert not (tmp_path / "ds").exists() and not (tmp_path / ".ds.tmp").exists()


def zst_frames(text: bytes, n_frames: int) -> bytes:
    """`text` as n_frames concatenated zstd frames (as pzstd and `cat a.zst b.zst` write)."""
    import zstandard

    step = -(-len(text) // n_frames)
    parts = [text[i : i + step] for i in range(0, len(text), step)]
    return b"".join(zstandard.ZstdCompressor(level=3).compress(part) for part in parts)


def test_jsonl_zst_gives_the_tokens_of_the_plain_jsonl(tmp_path):
    plain = write_jsonl(tmp_path / "c.jsonl", 0.2)
    (tmp_path / "c.jsonl.zst").write_bytes(zst_frames(plain.read_bytes(), 3))
    metas = {}
    for name in ("c.jsonl", "c.jsonl.zst"):
        metas[name] = prepare(tmp_path / name.replace(".", "_"), inputs=[tmp_path / name],
                              vocab_size=300, chunk_mb=0.05)  # fmt: skip
    assert metas["c.jsonl"]["n_documents"] == metas["c.jsonl.zst"]["n_documents"] > 100
    plain, zst = tmp_path / "c_jsonl", tmp_path / "c_jsonl_zst"
    for f in ("train.bin", "val.bin", "tokenizer.model"):
        assert (plain / f).read_bytes() == (zst / f).read_bytes(), f


def test_corrupt_or_truncated_zst_names_file_and_line(tmp_path):
    good = write_txt(tmp_path, make_docs(2))
    lines = "\n".join(json.dumps({"text": d}) for d in make_docs(3) * 300).encode()
    payload = zst_frames(lines, 2)
    (tmp_path / "cut.jsonl.zst").write_bytes(payload[: len(payload) // 4])  # inside frame 1
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "ds", inputs=[*good, tmp_path / "cut.jsonl.zst"], vocab_size=300)
    assert "\n" not in str(err.value)
    assert re.search(r"cut.jsonl.zst is corrupt at line \d+: zstd frame truncated at byte "
                     r"offset \d+$", str(err.value)), err.value  # fmt: skip
    (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"not zstd" * 64)
    with pytest.raises(DataError, match=r"bad.jsonl.zst is corrupt at line 1: "):
        prepare(tmp_path / "ds", inputs=[*good, tmp_path / "bad.jsonl.zst"], vocab_size=300)
    assert not (tmp_path / "ds").exists() and not (tmp_path / ".ds.tmp").exists()


def test_zst_without_zstandard_says_how_to_install(tmp_path, monkeypatch):
    from megapipe.data import inputs

    monkeypatch.setattr(inputs, "_zstandard", lambda: None)
    (tmp_path / "a.jsonl.zst").write_bytes(zst_frames(b'{"text": "x"}\n', 1))
    with pytest.raises(DataError, match=r"a.jsonl.zst: .*pip install zstandard$"):
        prepare(tmp_path / "ds", inputs=[tmp_path / "a.jsonl.zst"])
