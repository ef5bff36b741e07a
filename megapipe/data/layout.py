"""A prepared dataset on disk (docs/data.md, "What a dataset holds"): the file names and the
checked readers of its two small files, `meta.json` and `<split>.docs.npy`.

`<split>.docs.npy` is the document index: int64, n_docs + 1 token offsets into `<split>.bin`,
first 0, last the split's token count, so document i is tokens[docs[i]:docs[i + 1]] (the .idx
Megatron-LM's indexed dataset keeps beside its token file). Both are read without touching a
token, so start-up costs the same for a 1 GB and a 1 TB corpus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from megapipe.data.errors import DataError

META_FILE = "meta.json"
DTYPES = ("uint16", "uint32")
DOCS_SUFFIX = ".docs.npy"
RERUN = "rerun python tools/prepare_data.py"


def docs_path(root: Path, split: str) -> Path:
    """The document offsets file of `split` in the dataset dir `root`."""
    return Path(root) / f"{split}{DOCS_SUFFIX}"


def read_meta(root: Path) -> dict[str, Any]:
    """`meta.json` of a dataset directory, with its required keys checked."""
    path = root / META_FILE
    if not path.is_file():
        raise DataError(f"{path} not found; run python tools/prepare_data.py --out {root}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is corrupt ({err}); rerun python tools/prepare_data.py") from None
    required = ("vocab_size", "dtype", "n_train_tokens", "n_val_tokens", "eos_id", "tokenizer")
    missing = [key for key in required if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; rerun python tools/prepare_data.py")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{path} has dtype {meta['dtype']!r}, expected one of {DTYPES}")
    return meta


def read_docs(root: Path, split: str, meta: dict[str, Any]) -> np.ndarray:
    """`<split>.docs.npy` memory-mapped, checked against meta.json's token and document counts
    (two reads of the mapped array, whatever its size; the inspector's --verify rescans)."""
    path = docs_path(root, split)
    if not path.is_file():
        raise DataError(
            f"{path} not found (data prepared before format 2); {RERUN} or set data.sampler: random"
        )
    try:
        docs = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is corrupt ({err}); {RERUN}") from None
    n_tokens = int(meta[f"n_{split}_tokens"])
    n_docs = meta.get(f"n_{split}_documents", len(docs) - 1)
    shape_ok = docs.ndim == 1 and len(docs) == n_docs + 1 and len(docs) >= 1
    if not shape_ok or docs[0] != 0 or int(docs[-1]) != n_tokens:
        raise DataError(
            f"{path} does not match {META_FILE} ({n_docs} documents, {n_tokens} tokens); {RERUN}"
        )
    return docs
