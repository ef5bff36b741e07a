"""Zigzag sharding of sequences over the cp axis, and this rank's place on that axis.

Causal load balance (zigzag): the sequence is cut into 2·cp chunks and rank r holds chunks r and
2cp−1−r, so every rank computes the same number of unmasked scores (Brandon et al. 2023,
"Striped Attention"; this pairing is Llama 3's context parallelism, Dubey et al. 2024, §3.3.2).
The data loader cuts inputs and targets this way; ring.py attends over the cut.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megapipe.distributed import collectives as C
from megapipe.parallel.context.balance import ChunkLayout, document_layout, take


def _check_zigzag(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(
            f"zigzag sharding needs seq_len % (2·cp) == 0, got seq_len={seq_len}, cp={cp}: "
            f"make the sequence length a multiple of {2 * cp}"
        )


def zigzag_chunks(cp: int, rank: int) -> list[int]:
    """The two of 2·cp chunks a rank holds: r and 2cp−1−r (ascending)."""
    return [rank, 2 * cp - 1 - rank]


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (T/cp,) held by a cp rank under zigzag sharding; RoPE positions follow these."""
    _check_zigzag(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in zigzag_chunks(cp, rank)])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """This rank's zigzag slice of x along dim: (…, T, …) -> (…, T/cp, …)."""
    _check_zigzag(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in zigzag_chunks(cp, rank)], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], cp: int, dim: int) -> torch.Tensor:
    """Inverse of zigzag_shard: the cp rank slices (in rank order) back to the sequence."""
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        lo, hi = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = lo, hi
    return torch.cat(chunks, dim=dim)


def local_chunks(cp: int, rank: int, zigzag: bool) -> list[int]:
    """Global chunk ids held by a rank: zigzag (2·cp chunks) or contiguous (cp chunks)."""
    return zigzag_chunks(cp, rank) if zigzag else [rank]


@dataclass(frozen=True)
class CPInfo:
    """This rank's place on the context-parallel axis (size 1: the whole sequence is local).

    Under cp > 1 every sequence is zigzag-sharded: this rank holds positions
    `positions(T)` of each sequence, its attention runs `attention` (the parallel.cp_comm
    variant, variants.py: the ring or Ulysses' all-to-all) over `group`, and gradients are
    summed over dp × cp (each cp rank saw different tokens of the same rows).
    Under parallel.cp_balance=documents (ring or hybrid), rows with document ids are split by
    `layout` instead (balance.py), the same on every rank: the loader cuts with it and the ring
    attends over it.
    """

    size: int = 1
    rank: int = 0
    group: object = None  # torch.distributed ProcessGroup when size > 1
    attention: object = None  # the cp attention variant (variants.py); the model's needs one
    balance: str = "position"  # parallel.cp_balance

    def layout(self, documents: torch.Tensor | None) -> ChunkLayout | None:
        """The split of rows with document ids (b, T) by attention work; None: zigzag's."""
        if self.size == 1 or documents is None or self.balance != "documents":
            return None
        return _layout_of(documents, self.size)

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions (T/cp,) of this rank's tokens: RoPE and learned positions use them."""
        if self.size == 1:
            return torch.arange(seq_len, device=device)
        return zigzag_indices(seq_len, self.size, self.rank).to(device)

    def shard(self, x: torch.Tensor, dim: int = 1, layout: ChunkLayout | None = None):
        """This rank's slice of full sequences x along `dim` (the data loader's cut): zigzag,
        or its chunks of `layout`."""
        if self.size == 1:
            return x
        return (
            zigzag_shard(x, self.size, self.rank, dim)
            if layout is None
            else take(x, layout, self.rank, dim)
        )

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequences from every cp rank's slice x along `dim` (the inverse of `shard`:
        all-gather over the cp group, then the zigzag chunks put back in order)."""
        if self.size == 1:
            return x
        parts = C.all_gather(x, dim, self.group).chunk(self.size, dim=dim)  # rank order
        return zigzag_unshard(list(parts), self.size, dim)


NO_CP = CPInfo()

# Every attention layer of a microbatch asks for the layout of the same ids tensor: compute it
# once per tensor (keyed by identity: a tensor hashes by id, and the cache holds it alive, so an
# id is never reused while cached). A few entries cover the microbatches a schedule has in flight.
_layout_of = functools.lru_cache(maxsize=8)(document_layout)


def cp_info(mesh, attention=None, balance: str = "position") -> CPInfo:
    """CPInfo of this rank of `mesh`: its slice of every sequence (zigzag, or by document work
    under balance="documents"), the cp group and the attention variant run over it (None: the
    data loader's, which only shards)."""
    if mesh is None or mesh.size("cp") == 1:
        return NO_CP
    return CPInfo(mesh.size("cp"), mesh.coord("cp"), mesh.group("cp"), attention, balance)
