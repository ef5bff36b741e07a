"""How a logical (unsharded) parameter maps to this tensor-parallel rank's shard.

Parameters are initialised and checkpointed under their logical shape and name; each rank keeps
the slice given by a `ShardSpec`. Keeping the rule in one pure function lets the same code
serve initialisation, checkpoint save/load, gradient sync of replicated kv heads and the parity
tests' gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class TPInfo:
    """This rank's place on the tensor-parallel axis (size 1: no tensor parallelism).

    `sequence_parallel` turns on Megatron SP (Korthikanti et al. 2022, §4.2.2): activations
    outside the tp-split regions are split along the sequence. `rng` is the tracker whose
    forked stream drives dropout inside tp-split regions (see random.py). `overlap`: the SP
    linears run their collective chunk by chunk beside the matmul (overlap.py).
    """

    size: int = 1
    rank: int = 0
    group: object = None  # torch.distributed ProcessGroup when size > 1
    sequence_parallel: bool = False
    rng: object = None  # random.TPRNGTracker when size > 1
    overlap: bool = False  # parallel.tp_overlap: SP's collectives chunked beside the matmuls

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside tp size {self.size}")

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on and has an effect (tp > 1)."""
        return self.sequence_parallel and self.size > 1


NO_TP = TPInfo()


class Piece(NamedTuple):
    """A run of rows along the shard dim: logical [global_lo, +length) = local [local_lo, +len).

    `owner` is False on all but the first of the tp ranks that hold a replicated piece, so
    checkpoints write it once and the gradient norm counts it once.
    """

    global_lo: int
    local_lo: int
    length: int
    owner: bool


@dataclass(frozen=True)
class ShardSpec:
    """Split `dim` of the logical tensor into `segments` (e.g. q | k | v), each in `unit` rows.

    Each segment is divided over tp in whole units (heads). A segment with fewer units than tp
    is replicated: rank r takes unit r·units // tp (Megatron's kv-head replication for GQA).
    With `pad`, a segment tp does not divide is split in ceil(units/tp) chunks, the last ones
    short and zero-padded (a vocabulary that tp does not divide). `dim=None` means the
    parameter is replicated on every tp rank.
    """

    dim: int | None = None
    segments: tuple[int, ...] = ()
    unit: int = 1
    pad: bool = False

    def local_size(self, tp: int) -> int:
        return sum(
            _units_on_rank(seg // self.unit, tp, self.pad) * self.unit for seg in self.segments
        )

    def pieces(self, tp_size: int, tp_rank: int) -> list[Piece]:
        """The logical rows this rank holds, segment by segment (padding excluded)."""
        out, start, local = [], 0, 0
        for seg in self.segments:
            units = seg // self.unit
            first, count, owner = _unit_range(units, tp_size, tp_rank, self.pad)
            length = max(min(count, units - first), 0) * self.unit
            out.append(Piece(start + first * self.unit, local, length, owner))
            start += seg
            local += count * self.unit
        return out

    def shard(self, full: torch.Tensor, tp: TPInfo) -> torch.Tensor:
        """This rank's slice of the logical tensor `full` (zeros in padding rows)."""
        if self.dim is None or tp.size == 1:
            return full
        shape = list(full.shape)
        shape[self.dim] = self.local_size(tp.size)
        out = full.new_zeros(shape)
        for p in self.pieces(tp.size, tp.rank):
            src = full.narrow(self.dim, p.global_lo, p.length)
            out.narrow(self.dim, p.local_lo, p.length).copy_(src)
        return out

    def replicated_units(self, tp_size: int) -> bool:
        """Whether some segment's units are shared by several tp ranks (kv replication)."""
        return self.dim is not None and any(seg // self.unit < tp_size for seg in self.segments)


def unshard(spec: ShardSpec, shards: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The logical tensor from every tp rank's shard (`shards[r]` from rank r)."""
    if spec.dim is None or len(shards) == 1:
        return shards[0].clone()
    full = shards[0].new_zeros(shape)
    for rank, local in enumerate(shards):
        for p in spec.pieces(len(shards), rank):
            src = local.narrow(spec.dim, p.local_lo, p.length)
            full.narrow(spec.dim, p.global_lo, p.length).copy_(src)
    return full


def _units_on_rank(units: int, tp: int, pad: bool = False) -> int:
    if units % tp == 0:
        return units // tp
    if pad:
        return -(-units // tp)
    return 1


def _unit_range(units: int, tp: int, rank: int, pad: bool = False) -> tuple[int, int, bool]:
    """(first unit, units held including padding, owner) of `rank`."""
    if units % tp == 0:
        per = units // tp
        return rank * per, per, True
    if pad:
        per = -(-units // tp)
        return rank * per, per, True
    if tp % units == 0:  # fewer units than ranks: replicate, tp // units ranks share a unit
        share = tp // units
        return rank // share, 1, rank % share == 0
    raise ValueError(f"{units} units cannot be split over tp={tp}")


REPLICATED = ShardSpec()
