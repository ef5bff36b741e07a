"""Corpus to dataset: read documents, train or load a tokenizer, write the packed token memmap.

The default corpus is the 38 Shakespeare plays of shakespeare.py. Other corpora come from local
.txt (one document per file), .jsonl or .parquet (one document per row) files. The dataset
is written to a temporary directory beside `out` and renamed into place at the end, so a failed
run leaves no half-written dataset behind.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from megapipe.data.loader import META_FILE, DataError, load_tokenizer
from megapipe.data.shakespeare import shakespeare_documents

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SPM_FILE = "tokenizer.model"
HF_DIR = "tokenizer"

# ---------------------------------------------------------------- local input files


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """Raise DataError naming the byte offset of the first invalid UTF-8 sequence."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while True:
            block = f.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                # The decoder may hold back a few bytes of an unfinished sequence from before.
                pending = len(decoder.getstate()[0])
                raise DataError(
                    f"{path} is not UTF-8: invalid byte at offset {offset - pending + err.start}"
                ) from None
            if not block:
                return
            offset += len(block)


def check_input(path: Path) -> str:
    """The `datasets` builder for an input file, after checking it exists and decodes."""
    if not path.is_file():
        raise DataError(f"input file {path} not found")
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"input file {path}: unknown extension; use one of {sorted(BUILDERS)}")
    if builder != "parquet":  # parquet strings are checked by arrow itself
        check_utf8(path)
    return builder


def load_input_documents(paths: list[Path], text_field: str, cache_dir: Path) -> list[str]:
    """Documents of every input file in order, read through HF `datasets` from local files."""
    builders = [check_input(path) for path in paths]  # fail on any bad file before reading
    docs: list[str] = []
    for path, builder in zip(paths, builders):
        ds = _load_file(path, builder, cache_dir)
        field = "text" if builder == "text" else text_field
        if field not in ds.column_names:
            raise DataError(f"input file {path} has no field '{field}'; set --text-field")
        texts = [t for t in ds[field] if t is not None]
        if not all(isinstance(t, str) for t in texts):
            raise DataError(f"input file {path}: field '{field}' holds non-string values")
        if not any(t.strip() for t in texts):
            raise DataError(f"input file {path} is empty: no text in field '{field}'")
        docs.extend(t for t in texts if t)
    return docs


def _load_file(path: Path, builder: str, cache_dir: Path):
    """One local file as a `datasets.Dataset`; a parse failure becomes a one-line DataError."""
    import pyarrow as pa
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    if path.stat().st_size == 0:  # the json builder cannot even infer a schema from nothing
        raise DataError(f"input file {path} is empty")
    # A .txt file is one document (a play, a book), not one document per line.
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        return load_dataset(
            builder, data_files=str(path), split="train", cache_dir=str(cache_dir),
            keep_in_memory=True, **kwargs,
        )  # fmt: skip
    except (DatasetGenerationError, pa.ArrowException, ValueError, OSError) as err:
        # datasets wraps the parser's error; report the innermost one
        while err.__cause__ is not None:
            err = err.__cause__
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"input file {path} is not valid {builder}: {reason}") from None


# ---------------------------------------------------------------- tokenizer and tokens


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Document indices for (train, val): a seeded, sorted draw, at least one val doc if >= 2."""
    if n_docs < 2 or val_fraction <= 0:
        return list(range(n_docs)), []
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    val = set(np.random.default_rng(seed).permutation(n_docs)[:n_val].tolist())
    return [i for i in range(n_docs) if i not in val], sorted(val)


def train_sentencepiece(docs: list[str], model_file: Path, vocab_size: int, seed: int) -> None:
    """BPE with identity normalisation and byte fallback, so any text round-trips exactly."""
    import sentencepiece as spm

    # sentencepiece learns from lines; newlines themselves become the <0x0A> byte piece.
    lines = (line for doc in docs for line in doc.split("\n") if line.strip())
    spm.set_random_generator_seed(seed)
    # A model_writer rather than model_prefix keeps the (temporary) output path out of the file.
    try:
        with model_file.open("wb") as writer:
            spm.SentencePieceTrainer.train(
                sentence_iterator=lines, model_writer=writer,
                model_type="bpe", vocab_size=vocab_size, normalization_rule_name="identity",
                remove_extra_whitespaces=False, byte_fallback=True, character_coverage=1.0,
                input_sentence_size=0, shuffle_input_sentence=False,
                num_threads=1,  # more threads give the same pieces but a different .model file
                minloglevel=2,
            )  # fmt: skip
    except RuntimeError as err:  # e.g. "Vocabulary size too high" for a tiny corpus
        reason = str(err).split("] ")[-1]  # drop the C++ source location
        raise DataError(f"sentencepiece training failed: {reason}") from None


def tokenize(docs: list[str], tokenizer, dtype: np.dtype) -> np.ndarray:
    """All documents as one flat array, each followed by EOS (the document separator)."""
    from datasets import Dataset

    if not docs:  # an empty Dataset.map yields no "ids" column at all
        return np.zeros(0, dtype)

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(batch["text"])]}

    ds = Dataset.from_dict({"text": docs})
    ds = ds.map(encode, batched=True, remove_columns=["text"], keep_in_memory=True)
    return np.concatenate([np.asarray(row, dtype=dtype) for row in ds["ids"]])


def tokenize_splits(train_docs: list[str], val_docs: list[str], tokenizer, val_fraction: float):
    """(train, val) token arrays; with no val document, val is the tail of the train tokens."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32)
    train = tokenize(train_docs, tokenizer, dtype)
    val = tokenize(val_docs, tokenizer, dtype)
    if not val_docs and val_fraction > 0 and len(train) > 1:
        cut = len(train) - max(1, round(len(train) * val_fraction))
        train, val = train[:cut], train[cut:]
    return train, val


# ---------------------------------------------------------------- the whole preparation


def prepare(
    out: Path,
    inputs: list[Path] | None = None,
    tokenizer_dir: Path | None = None,
    vocab_size: int = 2048,
    val_fraction: float = 0.05,
    text_field: str = "text",
    cache_dir: Path = Path("data/cache"),
    seed: int = 0,
) -> dict:
    """Write the dataset to `out` (train.bin, val.bin, meta.json, tokenizer) and return its meta."""
    out, cache_dir = Path(out), Path(cache_dir)
    inputs = None if inputs is None else [Path(p) for p in inputs]
    tokenizer_dir = None if tokenizer_dir is None else Path(tokenizer_dir)
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise DataError(f"tokenizer dir {tokenizer_dir} not found; give a local HF tokenizer dir")
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the dataset is an ordinary directory
    try:
        docs, source = _read_corpus(inputs, text_field, cache_dir, tmp / "hf_cache")
        train_idx, val_idx = split_documents(len(docs), val_fraction, seed)
        train_docs, val_docs = [docs[i] for i in train_idx], [docs[i] for i in val_idx]
        # The tokenizer learns from train documents only, so val stays unseen.
        tokenizer, tokenizer_name = _make_tokenizer(
            train_docs, tmp, tokenizer_dir, vocab_size, seed
        )
        train, val = tokenize_splits(train_docs, val_docs, tokenizer, val_fraction)
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        meta = {
            "vocab_size": tokenizer.vocab_size, "dtype": train.dtype.name,
            "tokenizer": tokenizer_name, "n_train_tokens": len(train), "n_val_tokens": len(val),
            "eos_id": tokenizer.eos_id, "n_documents": len(docs),
            "n_characters": sum(len(d) for d in docs), "source": source,
        }  # fmt: skip
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _read_corpus(inputs, text_field: str, cache_dir: Path, hf_cache: Path):
    """(documents, source description): the local inputs if given, else Shakespeare."""
    if not inputs:
        return shakespeare_documents(cache_dir)
    docs = load_input_documents(inputs, text_field, hf_cache)
    shutil.rmtree(hf_cache, ignore_errors=True)  # documents are in memory now
    return docs, "local files: " + ", ".join(str(p) for p in inputs)


def _make_tokenizer(docs, tmp: Path, tokenizer_dir: Path | None, vocab_size: int, seed: int):
    """Train sentencepiece, or copy the given HF tokenizer in, so the dataset is self-contained."""
    if tokenizer_dir is None:
        train_sentencepiece(docs, tmp / SPM_FILE, vocab_size, seed)
        return load_tokenizer(tmp / SPM_FILE), SPM_FILE
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.hf.save_pretrained(str(tmp / HF_DIR))
    return tokenizer, HF_DIR


def _check_out(out: Path) -> None:
    """Refuse to replace a directory that is not a dataset this tool wrote."""
    replaceable = out.is_dir() and (not any(out.iterdir()) or (out / META_FILE).is_file())
    if out.exists() and not replaceable:
        raise DataError(f"--out {out} exists and is not a dataset; remove it or pick another --out")


def _replace_dir(new: Path, out: Path) -> None:
    """Move `new` to `out`; an older dataset there is removed only once `new` is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old)
