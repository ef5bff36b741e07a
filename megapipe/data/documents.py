"""A prepared split on disk: `<split>.bin` (the tokens, an EOS after every document) and
`<split>.docs.npy`, the document index: int64, n_docs + 1 token offsets into the .bin, first 0,
last the split's token count, so document i is tokens[docs[i]:docs[i + 1]]. It is the document
index Megatron-LM's indexed dataset keeps beside its token file (the .idx), from which a sample
index is built, and the split's largest id goes to meta.json, so that training starts without
reading the tokens.

Both files are written while the chunks stream in (prepare.py): the document count is known
before encoding (the documents are counted first), so the .npy header is written first and each
chunk's offsets are appended after it. Memory holds one chunk, whatever the corpus size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from megapipe.data.layout import docs_path
from megapipe.data.workers import Encoded

OFFSET_DTYPE = "<i8"  # int64, little-endian as np.save writes it here
COPY_BLOCK = 1 << 24  # bytes per read when moving or scanning token files


class SplitWriter:
    """One split's tokens and document offsets, appended chunk by chunk."""

    def __init__(self, root: Path, split: str, n_docs: int):
        self.n_docs_expected = n_docs
        self.n_docs = self.n_tokens = 0
        self.max_id = -1
        self._tokens = (root / f"{split}.bin").open("wb")
        self._docs = docs_path(root, split).open("wb")
        header = {"descr": OFFSET_DTYPE, "fortran_order": False, "shape": (n_docs + 1,)}
        np.lib.format.write_array_header_1_0(self._docs, header)
        np.zeros(1, OFFSET_DTYPE).tofile(self._docs)  # the first document starts at 0

    def append(self, part: Encoded) -> None:
        part.tokens.tofile(self._tokens)
        ends = np.cumsum(part.lengths, dtype=np.int64) + self.n_tokens
        ends.astype(OFFSET_DTYPE, copy=False).tofile(self._docs)
        self.n_docs += len(part.lengths)
        self.n_tokens += len(part.tokens)
        self.max_id = max(self.max_id, part.max_id)

    def close(self) -> bool:
        """Close both files; False if fewer documents came than the header announced."""
        self._tokens.close()
        self._docs.close()
        return self.n_docs == self.n_docs_expected


def move_tail_to_val(root: Path, n_val: int, dtype: str) -> dict[str, int]:
    """Make val the last `n_val` tokens of train (for a corpus with no val document, i.e. one
    document: the cut splits it, and val's offsets start at 0 at the cut).

    Returns the new n_<split>_tokens, n_<split>_documents and max_<split>_id. The largest ids
    are rescanned here, which costs one read of the tokens; a corpus of one document only.
    """
    size = np.dtype(dtype).itemsize
    n_train = (root / "train.bin").stat().st_size // size
    cut = n_train - n_val
    with (root / "train.bin").open("r+b") as src, (root / "val.bin").open("wb") as dst:
        src.seek(cut * size)
        shutil.copyfileobj(src, dst, COPY_BLOCK)
        src.truncate(cut * size)
    offsets = np.load(docs_path(root, "train"))  # a few entries: the documents are few
    train_docs = np.append(offsets[offsets < cut], cut)
    val_docs = np.concatenate([[0], offsets[offsets > cut] - cut]).astype(np.int64)
    np.save(docs_path(root, "train"), train_docs)
    np.save(docs_path(root, "val"), val_docs)
    stats = {"n_train_tokens": cut, "n_val_tokens": n_val}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        stats[f"n_{split}_documents"] = len(docs) - 1
        stats[f"max_{split}_id"] = largest_id(root / f"{split}.bin", dtype)
    return stats


def largest_id(path: Path, dtype: str) -> int:
    """The largest token id of a token file, read in blocks; -1 for an empty one."""
    largest = -1
    with path.open("rb") as f:
        while block := f.read(COPY_BLOCK):
            largest = max(largest, int(np.frombuffer(block, dtype=dtype).max()))
    return largest
