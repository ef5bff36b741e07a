"""Document-aware load balance for ring attention over packed rows (`parallel.cp_balance`).

Under `data.document_mask` a query sees only the earlier keys of its own document, so the zigzag
split by position (zigzag.py) no longer balances the work: a rank holding the tails of long
documents attends far more (query, key) pairs than one holding many short ones (torchtitan RFC
#2536, "Varlen + CP with document-aware load balancing"; Megatron-Core's THD path, #1647 and
PR #3386, zigzags each packed sequence on its own instead). Here the row is cut into more,
smaller chunks (`chunks_per_rank` per rank), each chunk's work is computed from the document ids,
and the chunks are dealt to the cp ranks by longest-processing-time-first greedy (Graham 1969)
with a cardinality bound, so every rank holds the same number of tokens (the ring sends equal
blocks). The ring then skips (q chunk, kv chunk) tiles in which every pair is hidden.

Attention work is the (query, key) pairs the ring's kernel computes: a diagonal tile (a, a)
costs c(c+1)/2 per row, an earlier visible tile (a, b < a) c² per row, a tile with no visible
pair in any row of the microbatch nothing (the kernel is batched over rows, so one assignment
and one tile plan serve the whole microbatch: a per-row split would need a ring per row). A
query chunk's work does not depend on where the other chunks live (every rank's queries meet
every kv block around the ring), so a rank's work is the sum of its chunks' and the greedy
deals fixed weights. The split is a function of the ids alone, which every cp rank holds whole
(train/batches.py), so all ranks compute the same assignment without communicating; tokens,
targets and per-document positions follow their chunk, so the loss is unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor

# Chunks of fewer tokens make kernel calls too small to run well on an accelerator; 16 per rank
# bring the worst rank within a few percent of the mean on OWT-like packing
# (docs/benchmarks/2026-11-29-cp-document-balance-cpu.md).
MAX_CHUNKS_PER_RANK, MIN_CHUNK_TOKENS = 16, 16


class ChunkLayout(NamedTuple):
    """A row cut into `n` equal chunks; `ranks[r]` the ascending chunk ids cp rank r holds;
    `visible[a][b]`: q chunk a has a visible key in kv chunk b in some row (None: all tiles)."""

    n: int
    ranks: tuple[tuple[int, ...], ...]
    visible: list[list[bool]] | None = None


def chunks_per_rank(seq_len: int, cp: int) -> int:
    """Chunks per cp rank: the most (a power of two up to 16) that divide the row into chunks
    of at least MIN_CHUNK_TOKENS tokens; 2 (zigzag's granularity) at least."""
    n = MAX_CHUNKS_PER_RANK
    while n > 2 and (seq_len % (cp * n) or seq_len // (cp * n) < MIN_CHUNK_TOKENS):
        n //= 2
    return n


def chunk_visibility(ids: Tensor, n: int) -> Tensor:
    """(n, n) bool: tile (a, b) holds a visible (query, key) pair in some row of ids (b, T).
    Ids grow along a row, so an earlier chunk b shares a document with chunk a only when b's
    last id is a's first; a diagonal tile always holds each token's own pair."""
    chunks = ids.reshape(ids.shape[0], n, -1)  # (rows, n, T/n)
    first, last = chunks[:, :, 0], chunks[:, :, -1]  # (rows, n)
    shared = (first[:, :, None] == last[:, None, :]).any(dim=0)  # (n q chunks, n kv chunks)
    earlier = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1)
    return (shared & earlier) | torch.eye(n, dtype=torch.bool, device=ids.device)


def chunk_work(visible: Tensor, chunk: int, rows: int) -> list[int]:
    """Pairs the kernel computes for each q chunk over the whole ring, given the visible tiles."""
    earlier = (visible.sum(dim=1) - 1).tolist()  # visible tiles besides the diagonal
    return [rows * (chunk * (chunk + 1) // 2 + e * chunk * chunk) for e in earlier]


def deal(work: list[int], cp: int) -> tuple[tuple[int, ...], ...]:
    """Chunk ids per rank: heaviest chunk first to the least-loaded rank that still has room
    (each rank takes len(work)/cp); ties go to the lower chunk id and the lower rank."""
    room = len(work) // cp
    loads, held = [0] * cp, [[] for _ in range(cp)]
    for c in sorted(range(len(work)), key=lambda c: (-work[c], c)):
        r = min((r for r in range(cp) if len(held[r]) < room), key=lambda r: (loads[r], r))
        held[r].append(c)
        loads[r] += work[c]
    return tuple(tuple(sorted(h)) for h in held)


def document_layout(ids: Tensor, cp: int) -> ChunkLayout:
    """The balanced split of rows with document ids (b, T) over cp ranks (module docstring)."""
    n = cp * chunks_per_rank(ids.shape[1], cp)
    visible = chunk_visibility(ids, n)
    ranks = deal(chunk_work(visible, ids.shape[1] // n, ids.shape[0]), cp)
    return ChunkLayout(n, ranks, visible.tolist())


def zigzag_layout(cp: int, ids: Tensor | None = None) -> ChunkLayout:
    """The positional split (zigzag.py) as a layout; with ids, its hidden tiles marked."""
    ranks = tuple((r, 2 * cp - 1 - r) for r in range(cp))
    visible = None if ids is None else chunk_visibility(ids, 2 * cp).tolist()
    return ChunkLayout(2 * cp, ranks, visible)


def positional_layout(cp: int, zigzag: bool) -> ChunkLayout:
    """Zigzag's chunks r and 2cp−1−r per rank, or the r-th of cp contiguous slices."""
    return zigzag_layout(cp) if zigzag else ChunkLayout(cp, tuple((r,) for r in range(cp)))


def take(x: Tensor, layout: ChunkLayout, rank: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s chunks of whole rows x along dim, in ascending chunk order: (…, T/cp, …)."""
    chunks = x.chunk(layout.n, dim=dim)
    return torch.cat([chunks[c] for c in layout.ranks[rank]], dim=dim)


def rank_work(layout: ChunkLayout, seq_len: int, rows: int) -> list[int]:
    """Pairs each cp rank's kernel computes for a microbatch of `rows` rows under `layout`:
    with visible tiles marked, hidden ones skipped; without, every causal tile computed."""
    n, chunk = layout.n, seq_len // layout.n
    visible = layout.visible
    if visible is None:  # no skipping: every tile with b <= a
        visible = torch.ones(n, n, dtype=torch.bool).tril().tolist()
    work = chunk_work(torch.tensor(visible), chunk, rows)
    return [sum(work[c] for c in held) for held in layout.ranks]
