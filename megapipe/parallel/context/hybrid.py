"""Hybrid context parallelism (`parallel.cp_comm=hybrid`, `parallel.cp_a2a=K`): Ulysses'
all-to-all inside groups of K cp ranks, the kv ring across the R = cp/K groups.

Fang and Zhao 2024, "USP: A Unified Sequence Parallelism Approach" (arXiv 2405.07719), §3: a
"ulysses degree" K times a "ring degree" R; Megatron-Core calls it `a2a+p2p`. The all-to-all
moves 4·s·h/cp elements per rank but needs K | heads and fast links; the ring moves K/V blocks
that hide behind compute and scales past the heads. Layout (distributed/mesh.py,
cp_split_ranks): cp rank c = g·K + j is place j of a2a group g; the a2a groups are the inner,
adjacent cp ranks (one node, as tp), and the ring runs over the K ring groups {g·K + j : g}.

Why no permutation is needed: the loader gives cp rank c the zigzag chunks c and 2cp−1−c of
2cp chunks (zigzag.py). Group g thus holds chunks [gK, gK+K) and [2cp−gK−K, 2cp−gK): with
"super-chunks" of K chunks (2R of them), that is super-chunks g and 2R−1−g, exactly the zigzag
shard over a ring of R at ring rank g. Ulysses' seq_to_heads over the group puts its K shards
back in zigzag-unshard order over K ([lo_0 .. lo_{K−1}, hi_{K−1} .. hi_0]), which is that shard
in natural order. So the ring sees a valid zigzag split over R, of the natural row: RoPE
positions, the causal plan and the document ids (the whole row's, sliced by the ring over R)
all hold as they are, and heads_to_seq undoes the all-to-all after.

Balanced packing (`parallel.cp_balance=documents`, balance.py): cp rank c holds the chunks
`layout.ranks[c]` instead of zigzag's. The all-to-all then leaves group g's members' shards side
by side in member order, so ring rank g holds the chunk list of cp ranks gK .. gK+K−1 in that
order (`group_layout`): a layout over R ranks whose tile plan, with its visible tiles, takes
chunks in any order (kernels.plan_step). A group's work is the sum of its members', each within
a few percent of the mean, so the groups are balanced as well as the ranks.

Heads: the a2a splits the heads on this tp rank over K (K must divide them; kv heads fewer than
K are repeated by ulysses.kv_repeats with K for cp); the ring then runs with H/K query heads
and grouped kv heads as it does anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.parallel.context.balance import ChunkLayout
from megapipe.parallel.context.ring import ring_attention
from megapipe.parallel.context.ulysses import (
    HEADS,
    heads_to_seq,
    heads_to_shards,
    kv_repeats,
    seq_to_heads,
    shards_to_heads,
)


def group_layout(layout: ChunkLayout, a2a_size: int) -> ChunkLayout:
    """`layout` over cp ranks as the ring over the cp/K a2a groups sees it: ring rank g holds
    the chunks of cp ranks gK .. gK+K−1, in member order (the module docstring)."""
    members = layout.ranks
    ranks = tuple(
        tuple(c for held in members[g : g + a2a_size] for c in held)
        for g in range(0, len(members), a2a_size)
    )
    return ChunkLayout(layout.n, ranks, layout.visible)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a2a_group,
    ring_group,
    dropout_p: float = 0.0,
    documents: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
    window: int = 0,
) -> torch.Tensor:
    """This rank's queries (B, H, T/cp, hd) attended over the whole sequence: (B, H, T/cp, hd).

    q, k, v hold this cp rank's zigzag slice (k, v may have fewer heads: GQA); `a2a_group`
    is its K adjacent cp ranks, `ring_group` the R ranks at its place in every such group;
    `documents` (B, T), the whole row's ids, go to the ring unchanged (module docstring);
    `layout`, a balanced split over cp (balance.py), replaces the zigzag slices; the ring
    applies the sliding `window` on the natural row's positions, which both cases keep.
    """
    rep = kv_repeats(q.shape[HEADS], k.shape[HEADS], dist.get_world_size(a2a_group))
    if rep > 1:  # (B, Hkv, T/cp, hd) -> (B, rep·Hkv, T/cp, hd)
        k, v = k.repeat_interleave(rep, dim=HEADS), v.repeat_interleave(rep, dim=HEADS)
    if layout is not None:  # (B, H/K, T/R, hd): the members' chunks, in member order
        ring_layout = group_layout(layout, dist.get_world_size(a2a_group))
        q, k, v = (shards_to_heads(t, a2a_group) for t in (q, k, v))
        out = ring_attention(
            q, k, v, ring_group, dropout_p=dropout_p, documents=documents, layout=ring_layout,
            window=window,
        )  # fmt: skip
        return heads_to_shards(out, a2a_group)
    # (B, H/K, T/R, hd): the group's zigzag shard over the R ring ranks, in natural order
    q, k, v = (seq_to_heads(t, a2a_group) for t in (q, k, v))
    out = ring_attention(
        q, k, v, ring_group, dropout_p=dropout_p, documents=documents, window=window
    )
    return heads_to_seq(out, a2a_group)  # (B, H, T/cp, hd)
