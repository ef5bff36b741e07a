"""How a logical (unsharded) parameter maps to this tensor-parallel rank's shard.

Parameters are initialised and checkpointed under their logical shape and name; each rank keeps
the slice given by a `ShardSpec`. Keeping the rule in one pure function lets the same code
serve initialisation, checkpoint save/load and the parity tests' gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPInfo:
    """This rank's place on the tensor-parallel axis (size 1: no tensor parallelism)."""

    size: int = 1
    rank: int = 0
    group: object = None  # torch.distributed ProcessGroup when size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside tp size {self.size}")


NO_TP = TPInfo()


@dataclass(frozen=True)
class ShardSpec:
    """Split `dim` of the logical tensor into `segments` (e.g. q | k | v), each in `unit` rows.

    Each segment is divided over tp in whole units (heads). A segment with fewer units than tp
    is replicated: rank r takes unit r·units // tp (Megatron's kv-head replication for GQA).
    `dim=None` means the parameter is replicated on every tp rank.
    """

    dim: int | None = None
    segments: tuple[int, ...] = ()
    unit: int = 1

    def local_size(self, tp: int) -> int:
        return sum(_units_on_rank(seg // self.unit, tp) * self.unit for seg in self.segments)

    def shard(self, full: torch.Tensor, tp: TPInfo) -> torch.Tensor:
        if self.dim is None or tp.size == 1:
            return full
        pieces, start = [], 0
        for seg in self.segments:
            units = seg // self.unit
            first, count = _unit_range(units, tp.size, tp.rank)
            lo = start + first * self.unit
            pieces.append(full.narrow(self.dim, lo, count * self.unit))
            start += seg
        return torch.cat(pieces, dim=self.dim)


def _units_on_rank(units: int, tp: int) -> int:
    return units // tp if units % tp == 0 else 1


def _unit_range(units: int, tp: int, rank: int) -> tuple[int, int]:
    if units % tp == 0:
        per = units // tp
        return rank * per, per
    if tp % units == 0:  # fewer units than ranks: replicate, tp // units ranks share a unit
        return rank * units // tp, 1
    raise ValueError(f"{units} units cannot be split over tp={tp}")


REPLICATED = ShardSpec()
