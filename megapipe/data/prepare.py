"""Corpus to dataset: stream documents, train or load a tokenizer, write the packed token memmap.

The default corpus is the 38 Shakespeare plays of shakespeare.py; other corpora are the inputs
of inputs.py. Documents are read as streams three times: once to count and check them (so a bad
input fails before any long work), once for the tokenizer's training sample (the first
`tokenizer_sample_mb` of train documents; skipped when a tokenizer is given) and once to encode
them, in chunks of `chunk_mb` over `workers` processes (workers.py), appended to train.bin /
val.bin with each split's document offsets (documents.py). meta.json (format 2) records the
token and document counts and each split's largest id, so training reads no token to start.
Nothing here imports torch, so a worker starts in well under a second and the
preparation's own footprint is small (about 50 MB resident). Peak memory is therefore
bounded by chunk size × workers and the sample, plus one byte per document for the split mask,
whatever the corpus size; the output is the same for every chunk size and worker count.

The dataset is written to `.<out>.tmp` beside `out` and renamed into place at the end, so a
failed run leaves no half-written dataset behind. An interrupted run (killed, power lost) may
leave that temp dir: the next preparation of the same `out` removes it first and starts over,
so only one preparation per `out` may run at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import numpy as np

from megapipe.data.documents import SplitWriter, move_tail_to_val
from megapipe.data.errors import DataError
from megapipe.data.inputs import TXT_DOCS, check_utf8, expand_inputs, iter_documents
from megapipe.data.layout import META_FILE
from megapipe.data.shakespeare import shakespeare_documents
from megapipe.data.tokenizers import HFTokenizer, hub_tokenizer, is_hub_id, load_tokenizer
from megapipe.data.workers import encode_chunks

__all__ = ["check_utf8", "prepare", "split_documents", "train_sentencepiece", "val_mask"]

SPM_FILE = "tokenizer.model"
HF_DIR = "tokenizer"
MB = 1_000_000  # chunk and sample sizes count characters of text, in millions
FORMAT = 2  # meta.json's "format": 2 adds the document offsets (documents.py) and largest ids

# ---------------------------------------------------------------- split and tokenizer


def val_mask(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which documents are val: a seeded draw of round(n_docs * val_fraction) of them, at least
    one if n_docs >= 2 and val_fraction > 0, never all. One byte per document."""
    mask = np.zeros(n_docs, dtype=bool)
    if n_docs < 2 or val_fraction <= 0:
        return mask
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    mask[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return mask


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Document indices for (train, val) by the rule of val_mask."""
    mask = val_mask(n_docs, val_fraction, seed)
    return np.flatnonzero(~mask).tolist(), np.flatnonzero(mask).tolist()


def train_sentencepiece(docs: Iterable[str], model_file: Path, vocab_size: int, seed: int) -> None:
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
        largest = re.search(r"value <= (\d+)", reason)
        if largest:  # sentencepiece names the number of pieces this corpus can give
            reason = (
                f"Vocabulary size too high ({vocab_size}) for this corpus (or its sample); "
                f"set --vocab-size <= {largest.group(1)}"
            )
        raise DataError(f"sentencepiece training failed: {reason}") from None


def _sample(documents: Iterator[str], is_val: np.ndarray, limit: int) -> Iterator[str]:
    """The first train documents up to `limit` characters (the one crossing it included)."""
    used = 0
    for doc, val in zip(documents, is_val):
        if used >= limit:
            return
        if not val:  # the tokenizer learns from train documents only, so val stays unseen
            used += len(doc)
            yield doc


def _make_tokenizer(documents, is_val, tmp: Path, given, vocab_size, seed, sample_mb):
    """(tokenizer file or dir in tmp, its name in meta): trained on a sample, or copied in
    (`given`: a sentencepiece .model file, a local HF tokenizer dir or a Hub tokenizer)."""
    if given is None:
        sample = _sample(documents(), is_val, int(sample_mb * MB))
        train_sentencepiece(sample, tmp / SPM_FILE, vocab_size, seed)
        return tmp / SPM_FILE, SPM_FILE
    if isinstance(given, Path) and given.is_file():
        shutil.copyfile(given, tmp / SPM_FILE)
        return tmp / SPM_FILE, SPM_FILE
    hf = given if isinstance(given, HFTokenizer) else load_tokenizer(given)
    hf.hf.save_pretrained(str(tmp / HF_DIR))  # self-contained: later runs need no Hub
    return tmp / HF_DIR, HF_DIR


# ---------------------------------------------------------------- tokens


def _chunks(documents: Iterator[str], is_val: np.ndarray, chunk_chars: int):
    """(texts, is_val flags) of consecutive documents, about `chunk_chars` characters each."""
    texts: list[str] = []
    flags: list[bool] = []
    size = 0
    for i, doc in enumerate(documents):
        if i >= len(is_val):
            raise DataError("the inputs changed during preparation; rerun")
        texts.append(doc)
        flags.append(bool(is_val[i]))
        size += len(doc)
        if size >= chunk_chars:
            yield texts, flags
            texts, flags, size = [], [], 0
    if texts:
        yield texts, flags


def _write_tokens(documents, is_val, tmp: Path, tokenizer_path, dtype: str, opts) -> dict:
    """Encode every chunk and append it to train / val (tokens and document offsets,
    documents.py); the splits' token and document counts and largest ids, for meta.json."""
    n_val = int(is_val.sum())
    writers = [SplitWriter(tmp, "train", len(is_val) - n_val), SplitWriter(tmp, "val", n_val)]
    chunks = _chunks(documents(), is_val, max(1, int(opts["chunk_mb"] * MB)))
    try:
        for parts in encode_chunks(chunks, tokenizer_path, opts["workers"], dtype):
            for writer, part in zip(writers, parts):
                writer.append(part)
    finally:
        complete = [writer.close() for writer in writers]
    if not all(complete):  # fewer documents than counted (more fail in _chunks)
        raise DataError("the inputs changed during preparation; rerun")
    stats = {}
    for split, writer in zip(("train", "val"), writers):
        stats[f"n_{split}_tokens"] = writer.n_tokens
        stats[f"n_{split}_documents"] = writer.n_docs
        stats[f"max_{split}_id"] = writer.max_id
    return stats


def _tail_to_val(tmp: Path, stats: dict, val_fraction: float, dtype: str) -> dict:
    """With no val document (a corpus of one), val is the tail of the train tokens."""
    n_train = stats["n_train_tokens"]
    if stats["n_val_tokens"] or val_fraction <= 0 or n_train <= 1:
        return stats
    return {**stats, **move_tail_to_val(tmp, max(1, round(n_train * val_fraction)), dtype)}


# ---------------------------------------------------------------- the whole preparation


def prepare(
    out: Path,
    inputs: list[str | Path] | None = None,
    tokenizer_dir: str | Path | None = None,
    vocab_size: int = 2048,
    val_fraction: float = 0.05,
    text_field: str = "text",
    cache_dir: Path = Path("data/cache"),
    seed: int = 0,
    *,
    workers: int = 1,
    chunk_mb: float = 4.0,
    tokenizer_sample_mb: float = 64.0,
    txt_doc: str = "file",
) -> dict:
    """Write the dataset to `out` (train.bin, val.bin, their .docs.npy offsets, meta.json, the
    tokenizer) and return its meta.

    `tokenizer_dir` is a local HF tokenizer dir, a sentencepiece .model file or a Hub tokenizer
    id (loader.hub_tokenizer); None trains sentencepiece to `vocab_size` pieces. `workers`,
    `chunk_mb` and `tokenizer_sample_mb` shape the streaming (module docstring); `txt_doc` is
    what a .txt document is: the whole file, a paragraph or a line (inputs.py).
    """
    out, cache_dir = Path(out), Path(cache_dir)
    _check_options(val_fraction, workers, chunk_mb, tokenizer_sample_mb, txt_doc)
    given = None if tokenizer_dir is None else _check_tokenizer(str(tokenizer_dir))
    _check_out(out)
    documents, source = _open_corpus(inputs, text_field, txt_doc, cache_dir)
    n_docs, n_chars = 0, 0
    for doc in documents():  # checks every input before any long work
        n_docs, n_chars = n_docs + 1, n_chars + len(doc)
    is_val = val_mask(n_docs, val_fraction, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_tmp(out)
    try:
        tokenizer_path, tokenizer_name = _make_tokenizer(
            documents, is_val, tmp, given, vocab_size, seed, tokenizer_sample_mb
        )
        tokenizer = load_tokenizer(tokenizer_path)
        dtype = "uint16" if tokenizer.vocab_size <= 65535 else "uint32"
        opts = {"chunk_mb": chunk_mb, "workers": workers}
        stats = _write_tokens(documents, is_val, tmp, tokenizer_path, dtype, opts)
        stats = _tail_to_val(tmp, stats, val_fraction, dtype)
        meta = {
            "format": FORMAT, "vocab_size": tokenizer.vocab_size, "dtype": dtype,
            "tokenizer": tokenizer_name, **stats, "eos_id": tokenizer.eos_id,
            "n_documents": n_docs, "n_characters": n_chars, "source": source,
        }  # fmt: skip
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _check_tokenizer(given: str) -> Path | HFTokenizer:
    """A local HF tokenizer dir, a sentencepiece .model file that loads, or else a Hub
    tokenizer id, loaded now (fails fast, before the corpus is read)."""
    path = Path(given)
    if path.is_file():
        try:
            load_tokenizer(path)
        except (OSError, RuntimeError) as err:
            reason = str(err).split("] ")[-1].splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"--tokenizer {path} is not a sentencepiece .model file ({reason}); give a "
                ".model file or a local HF tokenizer dir"
            ) from None
        return path
    if path.is_dir():
        return path
    if is_hub_id(given):
        return hub_tokenizer(given)
    raise DataError(
        f"tokenizer dir {path} not found; give a local HF tokenizer dir, a sentencepiece "
        ".model file or a Hugging Face Hub tokenizer id (e.g. gpt2)"
    )


def _check_options(val_fraction, workers, chunk_mb, sample_mb, txt_doc) -> None:
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if workers < 1:
        raise DataError(f"--workers {workers} must be >= 1")
    if chunk_mb <= 0 or sample_mb <= 0:
        raise DataError(f"--chunk-mb {chunk_mb} and --tokenizer-sample-mb {sample_mb} must be > 0")
    if txt_doc not in TXT_DOCS:
        raise DataError(f"--txt-doc {txt_doc!r} unknown; use one of {', '.join(TXT_DOCS)}")


def _open_corpus(inputs, text_field: str, txt_doc: str, cache_dir: Path):
    """(a function returning a fresh document iterator, source description)."""
    if not inputs:
        docs, source = shakespeare_documents(cache_dir)  # 5 MB: small enough to hold
        return (lambda: iter(docs)), source
    paths = expand_inputs(list(inputs))
    return partial(iter_documents, paths, text_field, txt_doc), "inputs: " + ", ".join(
        str(p) for p in inputs
    )


def _fresh_tmp(out: Path) -> Path:
    """The temp dir beside `out`, emptied of what an interrupted run left there."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for old in out.parent.glob(f".{out.name}.old-*"):  # left by a run killed in _replace_dir
        shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _check_out(out: Path) -> None:
    """Refuse to replace a directory that is not a dataset this tool wrote."""
    replaceable = out.is_dir() and (not any(out.iterdir()) or (out / META_FILE).is_file())
    if out.exists() and not replaceable:
        raise DataError(f"--out {out} exists and is not a dataset; remove it or pick another --out")


def replace_dir(new: Path, out: Path) -> None:
    """Move `new` to `out`; an older dataset there is removed only once `new` is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old)
