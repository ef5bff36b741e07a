"""A checkpoint's save plan without writing it: what this rank's save would write, from the
real save path (checkpoint.save_state), and the check that a world's plans tile every tensor.

save_state builds each tp-, ep- or ZeRO-sharded tensor as a ShardedTensor, whose metadata
exchange (ShardedTensor._init_from_local_shards) is an all_gather_object over its group. Under
the fake backend that gather hands every rank its own object back (a fake all_gather copies the
input into each output), so the exchanged metadata would claim every rank holds this rank's
blocks. `planned` takes the exchange's place: it records this rank's blocks (offsets, sizes,
bytes) and exchanges nothing. What the exchange checks, that the blocks of a group's ranks tile
the logical tensor, `tiling_problems` checks across the plans of the ranks run
(train/fake_ranks.py). docs/architecture.md, "Layers".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from torch import nn

from megapipe.distributed.launch import rank
from megapipe.train.checkpoint import save_state, whole_weights

DCP_FILE = "__{rank}_0.distcp"  # FileSystemWriter's name for a rank's one file (its prefix)


@dataclass(frozen=True)
class Planned:
    """A sharded tensor in a save plan: this rank's blocks ((offsets, sizes, bytes) each)."""

    shape: tuple
    blocks: tuple


def planned(blocks, shape, group) -> Planned:
    """checkpoint._sharded's `shard`: this rank's blocks recorded, no metadata exchange."""
    del group  # the exchange over it is what a plan leaves out
    made = ((tuple(at), tuple(t.shape), t.numel() * t.element_size()) for at, t in blocks)
    return Planned(tuple(shape), tuple(made))


def save_plan(cfg, model: nn.Module, optimizer) -> dict:
    """What this rank's save writes, planned by the real save path: its DCP file (None when it
    writes nothing), each logical tensor's shape and blocks, and the bytes."""
    with whole_weights(optimizer):
        state = save_state(cfg, model, optimizer, shard=planned)
    tensors = {}
    for key, value in state.items():
        if isinstance(value, Planned):
            tensors[key] = {"shape": value.shape, "blocks": list(value.blocks)}
        else:  # written whole (DCP keeps one of its replicas)
            nbytes = value.numel() * value.element_size()
            whole = ((0,) * value.dim(), tuple(value.shape), nbytes)
            tensors[key] = {"shape": tuple(value.shape), "blocks": [whole]}
    nbytes = sum(b[2] for t in tensors.values() for b in t["blocks"])
    written = any(t["blocks"] for t in tensors.values())
    return {"file": DCP_FILE.format(rank=rank()) if written else None, "tensors": tensors,
            "bytes": nbytes}  # fmt: skip


def tiling_problems(plans: dict[int, dict]) -> list[str]:
    """Where the plans of a world's ranks do not tile a logical tensor exactly, one line each:
    shapes that disagree, blocks that overlap, a gap. Blocks at the same offsets are one block
    (DCP's dedup_save_plans keeps one of them), so they must have the same sizes."""
    shapes, blocks = {}, {}
    for r, plan in sorted(plans.items()):
        for key, t in plan["tensors"].items():
            if shapes.setdefault(key, t["shape"]) != t["shape"]:
                return [f"{key}: rank {r} plans shape {t['shape']}, another {shapes[key]}"]
            for at, sizes, _ in t["blocks"]:
                if blocks.setdefault(key, {}).setdefault(at, sizes) != sizes:
                    return [f"{key}: rank {r} plans {sizes} at {at}, another rank a different size"]
    problems = []
    for key, shape in shapes.items():
        placed = list(blocks.get(key, {}).items())
        for at, sizes in placed:
            if any(a < 0 or a + n > m for a, n, m in zip(at, sizes, shape)):
                problems.append(f"{key}: a block of {sizes} at {at} leaves the shape {shape}")
        for (a, sa), (b, sb) in combinations(placed, 2):
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, sa, b, sb)):
                problems.append(f"{key}: blocks at {a} and {b} overlap")
        covered = sum(math.prod(s) for _, s in placed)
        if covered != math.prod(shape):
            problems.append(f"{key}: blocks cover {covered} of {math.prod(shape)} elements")
    return problems
