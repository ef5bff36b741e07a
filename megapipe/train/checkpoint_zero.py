"""Checkpoint pieces of the distributed optimizer (ZeRO-1 and up): the same logical names and
shapes as a zero=0 checkpoint, so either loads into the other.

A rank owns a flat range of each local (tp-sharded) parameter (parallel/data/zero.py). Row-
major, that range is at most three rectangles of a 2-D local tensor: the tail of a first row,
whole rows, the head of a last row (an N-D one, such as stacked experts, cuts its partial rows
again). Each rectangle, cut by the tp pieces this rank owns (ShardSpec: padding rows dropped, a
replicated kv head written by its first holder), is a block of the logical tensor at known
offsets, so every rank writes only the moments it steps, as a ShardedTensor over the ranks
holding this pipeline stage (dp × cp × tp). An ep rank's experts are a slice of the logical
stacked tensor from its first expert on (parallel/expert/sharding.expert_offset). A load asks
for the same blocks (train/checkpoint_read.py), from a checkpoint written under any mesh and
either zero setting.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megapipe._torch_compat import sharded_tensor
from megapipe.parallel.expert.sharding import expert_offset
from megapipe.parallel.tensor.layers import sharded_params
from megapipe.parallel.tensor.sharding import ShardSpec, TPInfo

MOMENTS = ("exp_avg", "exp_avg_sq")


def flat_blocks(shape: tuple, lo: int, hi: int) -> list[tuple[list, list, int]]:
    """The flat range [lo, hi) of a row-major tensor of `shape` as boxes, each a contiguous
    run of the range: (offsets, sizes, start in the range) each, in order. Along the first dim:
    the tail of a first row, whole rows, the head of a last row; a partial row of an N-D tensor
    (stacked experts, (E, f, d)) is cut the same way one dim down."""
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [([lo], [hi - lo], 0)]
    cols = math.prod(shape[1:])

    def part_of_row(at: int, end: int) -> list[tuple[list, list, int]]:
        row = at // cols
        inner = flat_blocks(shape[1:], at - row * cols, end - row * cols)
        return [([row, *o], [1, *z], s + at - lo) for o, z, s in inner]

    out, at = [], lo
    if at % cols:  # the tail of a first row
        end = min(hi, (at // cols + 1) * cols)
        out += part_of_row(at, end)
        at = end
    whole = hi // cols * cols
    if at < whole:
        out.append(([at // cols] + [0] * (len(shape) - 1), [(whole - at) // cols, *shape[1:]],
                    at - lo))  # fmt: skip
        at = whole
    if at < hi:  # the head of a last row
        out += part_of_row(at, hi)
    return out


def logical_pieces(
    data: torch.Tensor,
    shape: tuple,
    lo: int,
    hi: int,
    spec: ShardSpec,
    tp: TPInfo,
    every_holder: bool = False,
    first: int = 0,
) -> list[tuple[list, torch.Tensor]]:
    """(logical offsets, block: a view of `data`) for the elements [lo, hi) of a local tensor
    of `shape` whose values are `data` (1-D, hi − lo long): the blocks this rank writes (tp
    replicas and replicated kv heads once), or with `every_holder` all it holds (to read).
    `first`: the logical index of the local tensor's dim 0 (an ep rank's first expert)."""
    out = []
    for offsets, sizes, start in flat_blocks(shape, lo, hi):
        block = data[start : start + math.prod(sizes)].view(sizes)
        offsets = [offsets[0] + first, *offsets[1:]]
        if spec.dim is None or tp.size == 1:
            if spec.dim is None and tp.rank and not every_holder:  # tp replicas: rank 0
                continue
            out.append((offsets, block))
            continue
        for piece in spec.pieces(tp.size, tp.rank):
            a = max(offsets[spec.dim], piece.local_lo)
            b = min(offsets[spec.dim] + sizes[spec.dim], piece.local_lo + piece.length)
            if (piece.owner or every_holder) and a < b:
                at = list(offsets)
                at[spec.dim] = piece.global_lo + a - piece.local_lo
                out.append((at, block.narrow(spec.dim, a - offsets[spec.dim], b - a)))
    return out


def _logical(chunks: list[nn.Module]):
    """(logical name, parameter, logical shape, ShardSpec, TPInfo) of every written parameter:
    the last stage's copy of the tied table is left out (stage 0 writes the table)."""
    for chunk in chunks:
        copies = chunk.tied_copy_names()
        for name, param, shape, spec, tp in sharded_params(chunk):
            if name not in copies:
                yield name, param, shape, spec, tp


def main_weights(optimizer, load: bool = False) -> dict:
    """bf16 weights: {id(param): its whole float32 main param}, written and read as the
    model's weights, so float32 and bf16 runs resume each other (parallel/precision.py)."""
    if optimizer is None:
        return {}
    return optimizer.load_targets() if load else optimizer.main_weights()


def state_keys(owned) -> tuple[tuple[str, ...], bool]:
    """(the flat state keys, whether a step count goes with them) of an `owned_state` answer:
    AdamW's moments and step, or what else it holds (Muon's momentum buffer, no step count:
    train/muon_zero.py). Every rank of the stage answers alike for a parameter."""
    if owned is None or "step" in owned[1]:
        return MOMENTS, True
    return tuple(sorted(owned[1])), False


def optimizer_state(chunks: list[nn.Module], optimizer, writer: bool, shard=sharded_tensor) -> dict:
    """What this rank writes of the optimizer: its owned moments as ShardedTensors under their
    logical names and shapes (HSDP: the first replica's); the step count (replicated) from
    `writer` ranks."""
    state = {}
    for name, param, shape, spec, tp in _logical(chunks):
        owned = optimizer.owned_state(param)
        keys, counted = state_keys(owned)
        for key in keys:
            pieces = []
            if owned is not None and optimizer.writes_shards:  # HSDP: one replica writes
                slot, st = owned
                pieces = logical_pieces(
                    st[key], tuple(param.shape), slot.lo, slot.hi, spec, tp,
                    first=expert_offset(param),
                )  # fmt: skip
            state[f"optim.{name}.{key}"] = shard(pieces, shape, optimizer.stage_group)
        if writer and counted:
            state[f"optim.{name}.step"] = optimizer.step_count()
    return state
