"""Attention work per cp rank on packed documents: the positional (zigzag) split against the
document-balanced one (parallel.cp_balance=documents, parallel/context/balance.py).

python -m benchmarks.bench cp_balance [--rows 32] [--seqs 1024,2048,4096] [--cps 2,4,8]
                                      [--shakespeare data/shakespeare]

Work is counted, not timed: the (query, key) pairs the ring's kernel computes on each cp rank
for one packed row (balance.rank_work), and the pairs document masking leaves visible (what a
varlen kernel would compute). Printed per distribution, sequence length and cp, as the worst
row's max/mean over the cp ranks:
- `zigzag all`: today's ring (position split, every causal tile computed, hidden pairs masked);
- `zigzag visible`: the visible pairs under the position split: the imbalance the issue names;
- `documents`: the balanced split with hidden tiles skipped (what the ring now computes);
and `computed/visible`, the work each layout computes for one visible pair (waste).

Distributions: OWT-like, documents of lognormal length with OpenWebText's mean (8,013,769
documents, Gokaslan & Cohen 2019; ~9.04e9 GPT-2 tokens in nanoGPT's prepare: ~1,127 tokens
each) and sigma 1.0 (an assumption: no published spread; it gives the long tail, 2% of
documents over 8k tokens); real packed text: the quick-start Shakespeare (36 plays, each tens
of thousands of tokens: only the rows across a boundary between plays hold two documents,
and those are the rows measured), and the Zen of Python by lines, char-level (short real
documents, ~40 tokens: many per row).
"""

from __future__ import annotations

import argparse
import ast
import codecs
import importlib.util
import math
from pathlib import Path

import numpy as np
import torch

from megapipe.parallel.context.balance import (
    ChunkLayout,
    document_layout,
    rank_work,
    take,
    zigzag_layout,
)
from megapipe.parallel.context.documents import document_positions

OWT_MEAN_TOKENS, OWT_SIGMA = 1127, 1.0


def rows_of_lengths(lengths: list[int], seq_len: int, rows: int) -> torch.Tensor:
    """(rows, seq_len) document ids of documents of `lengths` packed end to end, as the loader
    packs them (a document may cross into the next row, where its rest starts the row)."""
    ids = np.repeat(np.arange(len(lengths)), lengths)[: rows * seq_len]
    if len(ids) < rows * seq_len:
        raise ValueError(f"{sum(lengths)} tokens do not fill {rows} rows of {seq_len}")
    out = torch.from_numpy(ids.reshape(rows, seq_len).copy())
    return out - out[:, :1]  # ids from 0 in each row, as documents.document_ids gives them


def owt_like(seq_len: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Rows packed from lognormal document lengths with OpenWebText's mean (module docstring)."""
    rng = np.random.default_rng(seed)
    mu = math.log(OWT_MEAN_TOKENS) - OWT_SIGMA**2 / 2  # the lognormal's mean is exp(mu + s²/2)
    n = 4 * rows * seq_len // OWT_MEAN_TOKENS + 64
    lengths = np.maximum(1, rng.lognormal(mu, OWT_SIGMA, n).astype(np.int64))
    return rows_of_lengths(lengths.tolist(), seq_len, rows)


def zen_lines() -> list[str]:
    """The Zen of Python's lines (stdlib `this`, ROT13 in the module, read without importing
    it: the import prints): short real documents."""
    source = Path(importlib.util.find_spec("this").origin).read_text()
    tree = ast.parse(source)
    s = next(
        n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "s"
    )
    text = codecs.decode(s, "rot13")
    return [line for line in text.splitlines() if line.strip()]


def zen_packed(seq_len: int, rows: int) -> torch.Tensor:
    """Rows packed from the Zen's lines, char-level, each line a document with its EOS."""
    lengths = [len(line) + 1 for line in zen_lines()]
    reps = rows * seq_len // sum(lengths) + 1
    return rows_of_lengths(lengths * reps, seq_len, rows)


def shakespeare_packed(path: Path, seq_len: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Rows of a prepared dataset's train split (data/shakespeare) that hold a document
    boundary: each starts at a random offset before one of the boundaries (the plays are tens
    of thousands of tokens, so a row without one is a single document, balanced by position)."""
    starts = np.load(path / "train.docs.npy")
    lengths = np.diff(starts).tolist()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        doc = 1 + i % (len(lengths) - 2)  # the boundary between documents doc and doc + 1
        head = int(rng.integers(1, min(seq_len, lengths[doc])))  # tokens of doc in the row
        out.append(rows_of_lengths([head, *lengths[doc + 1 :]], seq_len, 1))
    return torch.cat(out)


def visible_work(ids: torch.Tensor, layout: ChunkLayout) -> list[int]:
    """Visible (query, key) pairs per cp rank: a query sees its position in its document + 1."""
    seen = document_positions(ids) + 1  # (rows, T)
    return [int(take(seen, layout, r).sum()) for r in range(len(layout.ranks))]


def imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


def measure(ids: torch.Tensor, cp: int) -> dict:
    """Worst row's max/mean per layout, and each layout's computed pairs per visible pair."""
    worst = {"zigzag all": 0.0, "zigzag visible": 0.0, "documents": 0.0}
    computed = {"zigzag": 0, "documents": 0}
    visible = 0
    T = ids.shape[1]
    for row in ids.split(1):
        zig, docs = zigzag_layout(cp), document_layout(row, cp)
        cost = {"zigzag all": rank_work(zig, T, 1), "documents": rank_work(docs, T, 1)}
        cost["zigzag visible"] = visible_work(row, zig)
        for name, work in cost.items():
            worst[name] = max(worst[name], imbalance(work))
        computed["zigzag"] += sum(cost["zigzag all"])
        computed["documents"] += sum(cost["documents"])
        visible += sum(cost["zigzag visible"])
    return {**worst, **{f"{k} computed/visible": v / visible for k, v in computed.items()}}


def distributions(args, seq: int) -> dict[str, torch.Tensor]:
    out = {"owt-like": owt_like(seq, args.rows), "zen-lines": zen_packed(seq, args.rows)}
    if args.shakespeare and (Path(args.shakespeare) / "train.docs.npy").is_file():
        out["shakespeare"] = shakespeare_packed(Path(args.shakespeare), seq, args.rows)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.bench cp_balance", description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--cps", default="2,4,8")
    parser.add_argument("--shakespeare", default="data/shakespeare")
    args = parser.parse_args(argv)
    cols = ["zigzag all", "zigzag visible", "documents"]
    waste = ["zigzag computed/visible", "documents computed/visible"]
    print("| data | seq | cp | " + " | ".join(cols + waste) + " |")
    print("|---" * (3 + len(cols) + len(waste)) + "|")
    for seq in (int(s) for s in args.seqs.split(",")):
        for name, ids in distributions(args, seq).items():
            for cp in (int(c) for c in args.cps.split(",")):
                r = measure(ids, cp)
                cells = [f"{r[c]:.3f}" for c in cols + waste]
                print(f"| {name} | {seq} | {cp} | " + " | ".join(cells) + " |")
    return 0
