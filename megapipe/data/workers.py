"""Tokenizer workers: chunks of documents in, packed token arrays out, in input order.

With `workers` >= 2 a spawn-context process pool encodes the chunks; each worker loads the
tokenizer once from its saved file or directory (nothing large is pickled to it). At most
`INFLIGHT_PER_WORKER * workers` chunks are submitted and not yet written, so memory is bounded
by chunk size × workers whatever the corpus size (Pool.imap would read the whole input ahead).
With one worker the chunks are encoded in this process: same tokens, no start-up cost.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from megapipe.data.loader import Tokenizer, load_tokenizer

INFLIGHT_PER_WORKER = 2  # one chunk encoding, one queued, per worker: workers never wait long

_tokenizer: Tokenizer | None = None  # this worker process's tokenizer, set by _load


def _load(path: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(path)


def encode_chunk(
    texts: list[str], is_val: list[bool], dtype: str, tokenizer: Tokenizer | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, val tokens) of one chunk: each document followed by EOS, in order."""
    tokenizer = tokenizer or _tokenizer
    ids = tokenizer.encode_batch(texts)
    eos = [tokenizer.eos_id]
    splits = []
    for want in (False, True):
        rows = [row for row, val in zip(ids, is_val) if val == want]
        count = sum(len(row) for row in rows) + len(rows)
        flat = itertools.chain.from_iterable(itertools.chain(row, eos) for row in rows)
        splits.append(np.fromiter(flat, dtype=dtype, count=count))
    return splits[0], splits[1]


def encode_chunks(
    chunks: Iterable[tuple[list[str], list[bool]]], tokenizer_path: Path, workers: int, dtype: str
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """encode_chunk of every chunk, in order, over `workers` processes."""
    if workers <= 1:
        tokenizer = load_tokenizer(tokenizer_path)
        for texts, is_val in chunks:
            yield encode_chunk(texts, is_val, dtype, tokenizer)
        return
    context = multiprocessing.get_context("spawn")  # fork would copy this process's memory
    # Leaving the with block (done, error, or generator closed) terminates the workers.
    with context.Pool(workers, initializer=_load, initargs=(str(tokenizer_path),)) as pool:
        pending: deque = deque()
        for texts, is_val in chunks:
            pending.append(pool.apply_async(encode_chunk, (texts, is_val, dtype)))
            if len(pending) >= INFLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
