"""Tokenizer workers: chunks of documents in, packed token arrays out, in input order.

With `workers` >= 2 a spawn-context process pool encodes the chunks while this process reads
the next ones and writes the results; each worker loads the tokenizer once from its saved file
or directory (nothing large is pickled to it) and gives sentencepiece its share of the cores,
so N workers never run more encoding threads than there are cores. Results come back as
numpy arrays (one buffer per split, not a Python int per token), with each document's length
and the split's largest id, so the document offsets and meta.json's largest ids need no second
pass over the tokens. At most
`INFLIGHT_PER_WORKER * workers` chunks are submitted and not yet written, so memory is bounded
by chunk size × workers whatever the corpus size (Pool.imap would read the whole input ahead).
With one worker the chunks are encoded in a thread of this process, overlapped with reading
and writing: same tokens, no start-up cost.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megapipe.data.tokenizers import Tokenizer, load_tokenizer

INFLIGHT_PER_WORKER = 2  # one chunk encoding, one queued, per worker: workers never wait long

_tokenizer: Tokenizer | None = None  # this worker process's tokenizer, set by _load
_threads = -1  # this worker process's sentencepiece threads per batch


def _load(path: str, threads: int) -> None:
    global _tokenizer, _threads
    _tokenizer, _threads = load_tokenizer(path), threads


class Encoded(NamedTuple):
    """One split's share of an encoded chunk."""

    tokens: np.ndarray  # the documents' tokens, each document followed by EOS
    lengths: np.ndarray  # int64 tokens per document, its EOS included
    max_id: int  # the largest id in `tokens`; -1 when there are none


def _encoded(tokens: np.ndarray, lengths: np.ndarray) -> Encoded:
    return Encoded(tokens, lengths, int(tokens.max()) if len(tokens) else -1)


def encode_chunk(
    texts: list[str],
    is_val: list[bool],
    dtype: str,
    tokenizer: Tokenizer | None = None,
    threads: int | None = None,
) -> tuple[Encoded, Encoded]:
    """(train, val) of one chunk: each document followed by EOS, in order."""
    tokenizer = tokenizer or _tokenizer
    rows = tokenizer.encode_arrays(texts, _threads if threads is None else threads)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    # ids < vocab_size, which the dtype was chosen to hold: the cast loses nothing
    flat = np.concatenate([part for row in rows for part in (row, eos)], dtype=dtype,
                          casting="unsafe")  # fmt: skip
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)) + 1  # EOS included
    val = np.asarray(is_val, dtype=bool)
    if not val.any():
        return _encoded(flat, lengths), _encoded(flat[:0], lengths[:0])
    token_is_val = np.repeat(val, lengths)
    return (
        _encoded(flat[~token_is_val], lengths[~val]),
        _encoded(flat[token_is_val], lengths[val]),
    )


def encode_chunks(
    chunks: Iterable[tuple[list[str], list[bool]]], tokenizer_path: Path, workers: int, dtype: str
) -> Iterator[tuple[Encoded, Encoded]]:
    """encode_chunk of every chunk, in order, over `workers` processes."""
    if workers <= 1:
        yield from _encode_in_thread(chunks, load_tokenizer(tokenizer_path), dtype)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // workers)
    context = multiprocessing.get_context("spawn")  # fork would copy this process's memory
    # Leaving the with block (done, error, or generator closed) terminates the workers.
    with context.Pool(workers, initializer=_load, initargs=(str(tokenizer_path), threads)) as pool:
        pending: deque = deque()
        for texts, is_val in chunks:
            pending.append(pool.apply_async(encode_chunk, (texts, is_val, dtype)))
            if len(pending) >= INFLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _encode_in_thread(chunks, tokenizer: Tokenizer, dtype: str):
    """One worker: chunk k is encoded in a thread (sentencepiece lets go of the GIL during a
    batch, with its default threads) while this thread reads chunk k + 1 and writes k - 1."""
    with ThreadPoolExecutor(1) as pool:
        pending: deque = deque()
        for texts, is_val in chunks:
            pending.append(pool.submit(encode_chunk, texts, is_val, dtype, tokenizer, -1))
            if len(pending) >= INFLIGHT_PER_WORKER:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
