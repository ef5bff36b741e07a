"""What a step trains on, in documents (tools/inspect_data.py): each row of a batch as its
pieces [document, begin, end] (token offsets in the split's .bin; for a blend a fourth item,
the dataset's name), taken from the same index and generators as `batch`, so the pieces' tokens
are the row's; and `verify`, the rescan of a split against its meta.json and docs.npy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megapipe.data.blend import BlendData
from megapipe.data.layout import docs_path
from megapipe.data.loader import MemmapData, TokenData, step_rng
from megapipe.data.sample_index import cut

SCAN_CHUNK = 1 << 24  # tokens per chunk of a rescan


def row_pieces(data: TokenData | BlendData, step: int, size: int, split: str, picked: range):
    """Per row of `picked` (rows of step `step`'s global batch of `size`) its pieces."""
    if isinstance(data, BlendData):
        return _blend_pieces(data, step, size, split, picked)
    if not isinstance(data, MemmapData):
        raise TypeError("synthetic data has no documents")
    if data.sampler == "random":
        starts = data.random_starts(step_rng(data.seed, split, step), size, split)
        return _group(*_start_pieces(data, starts[picked.start : picked.stop], split), picked)
    ids = np.arange(step * size + picked.start, step * size + picked.stop)
    return _group(*data.pieces(ids, split), picked)


def _blend_pieces(data: BlendData, step: int, size: int, split: str, picked: range):
    out: list[list[list]] = [[] for _ in picked]
    if data.sampler == "epochs":
        first, stop = step * size + picked.start, step * size + picked.stop
        which, within = (np.asarray(a[first:stop]) for a in data.blend(split, stop))
        for d, (name, one) in enumerate(data.datasets.items()):
            mine = np.flatnonzero(which == d)
            for r, pieces in zip(mine, _group(*one.pieces(within[mine], split), mine, name)):
                out[r] = pieces
        return out
    rng = data.step_rng(split, step)  # BlendData._random_rows' draws, in its order
    which = data.draw_sources(rng, size)
    children = rng.bit_generator.seed_seq.spawn(len(data.datasets))
    for d, (name, one) in enumerate(data.datasets.items()):
        mine = np.flatnonzero(which == d)
        keep = (mine >= picked.start) & (mine < picked.stop)
        starts = one.random_starts(np.random.default_rng(children[d]), len(mine), split)[keep]
        rows = mine[keep] - picked.start
        for r, pieces in zip(rows, _group(*_start_pieces(one, starts, split), rows, name)):
            out[r] = pieces
    return out


def _start_pieces(data: MemmapData, starts: np.ndarray, split: str) -> tuple[np.ndarray, ...]:
    """(row, document, begin, end) of random windows at `starts`, cut at document ends."""
    if not docs_path(data.root, split).is_file():  # format 1: documents unknown (-1)
        rows = np.arange(len(starts))
        return rows, np.full(len(starts), -1), starts, starts + data.seq_len + 1
    return cut(np.asarray(starts), data.seq_len + 1, data.docs(split))  # docs: file offsets


def _group(row, doc, begin, end, rows, name: str | None = None) -> list[list[list]]:
    out: list[list[list]] = [[] for _ in range(len(rows))]
    extra = [name] if name is not None else []
    for r, d, b, e in zip(row.tolist(), doc.tolist(), begin.tolist(), end.tolist()):
        out[r].append([d, b, e, *extra])
    return out


@dataclass
class Scan:
    """A split's rescan: what its tokens say against what meta.json and docs.npy record."""

    split: str
    tokens: int
    largest: int  # -1: no tokens
    recorded_largest: int | None  # meta's max_<split>_id (None: not recorded, format 1)
    eos: int  # EOS tokens found
    documents: int | None  # docs.npy's count (None: no docs.npy)
    eos_mismatches: int  # EOS positions that are not a document's last token, and the reverse

    @property
    def ok(self) -> bool:
        return (self.recorded_largest in (None, self.largest)) and (
            self.documents is None or (self.eos_mismatches == 0 and self.eos == self.documents)
        )


def verify(data: MemmapData, split: str) -> Scan:
    """Read every token of `split` (by chunks): its largest id and EOS positions, against
    meta.json's max_<split>_id and docs.npy's document ends."""
    tokens, eos_id = data.memmap(split), int(data.meta["eos_id"])
    has_docs = docs_path(data.root, split).is_file()
    ends = np.asarray(data.docs(split)[1:]) - 1 if has_docs else None
    largest, eos, mismatches = -1, 0, 0
    for low in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[low : low + SCAN_CHUNK])
        largest = max(largest, int(chunk.max()))
        found = np.flatnonzero(chunk == eos_id) + low
        eos += len(found)
        if ends is not None:
            mine = ends[(ends >= low) & (ends < low + len(chunk))]
            mismatches += len(np.setxor1d(found, mine))
    recorded = data.meta.get(f"max_{split}_id")
    documents = len(ends) if ends is not None else None
    return Scan(split, len(tokens), largest, recorded, eos, documents, mismatches)
