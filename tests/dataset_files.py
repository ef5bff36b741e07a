"""Prepared datasets (format 2, docs/data.md) written directly, for the sampler tests."""

import json
from pathlib import Path

import numpy as np

from benchmarks.bench_cp_balance import zen_lines


def write_dataset(
    out: Path,
    documents: dict[str, list[np.ndarray]],
    vocab_size: int,
    eos_id: int = 2,
    dtype: str = "uint16",
    tokenizer: bytes = b"shared-spm",
) -> Path:
    """A dataset dir as tools/prepare_data.py lays it out: per split `<split>.bin` (each
    document followed by an EOS) and `<split>.docs.npy`, meta.json, a tokenizer file (compared
    by bytes, never loaded)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": 2, "vocab_size": vocab_size, "dtype": dtype, "eos_id": eos_id,
            "tokenizer": "tokenizer.model"}  # fmt: skip
    for split in ("train", "val"):
        docs = [np.append(np.asarray(d, dtype=np.int64), eos_id) for d in documents.get(split, [])]
        tokens = np.concatenate(docs) if docs else np.zeros(0, np.int64)
        tokens.astype(dtype).tofile(out / f"{split}.bin")
        starts = np.concatenate([[0], np.cumsum([len(d) for d in docs], dtype=np.int64)])
        np.save(out / f"{split}.docs.npy", starts.astype(np.int64))
        meta[f"n_{split}_tokens"] = len(tokens)
        meta[f"n_{split}_documents"] = len(docs)
        meta[f"max_{split}_id"] = int(tokens.max()) if len(tokens) else -1
    (out / "tokenizer.model").write_bytes(tokenizer)
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def random_documents(
    rng: np.random.Generator, n_docs: int, low: int, high: int, lengths=(1, 40)
) -> list[np.ndarray]:
    """`n_docs` documents of ids in [low, high) (no EOS inside), lengths in [lengths)."""
    sizes = rng.integers(lengths[0], lengths[1], n_docs)
    return [rng.integers(low, high, n) for n in sizes]


def zen_dataset(out: Path) -> Path:
    """Real packed text: the Zen of Python's lines as documents, char-level (ids 1-95 for
    printable ASCII, EOS 0; vocab 96 as configs/tiny.yaml), ~40 tokens each, so a 128-token
    row holds three or four documents; the last four lines are the validation split."""
    docs = [np.array([ord(c) - 31 for c in line], dtype=np.int64) for line in zen_lines()]
    return write_dataset(out, {"train": docs[:-4], "val": docs[-4:]}, 96, eos_id=0)
