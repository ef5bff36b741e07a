"""Context parallelism by all-to-all (`parallel.cp_comm=a2a`): DeepSpeed-Ulysses.

Jacobs et al. 2023, "DeepSpeed Ulysses" (arXiv 2309.14509), §3: each cp rank holds a slice of
the sequence for all of its heads; an all-to-all turns that into the whole sequence for 1/cp of
the heads, attention runs there as on one process, and a second all-to-all turns the output
back. Per layer the forward moves q, k, v and out, 4·s·h/cp elements per rank (§3.2), against
the ring's (cp−1)/cp of the sequence's K/V per pass; the backward moves the same in reverse (the
transpose of an all-to-all is the all-to-all with the two dims swapped).

The model's sequence shard stays the loader's zigzag shard (zigzag.py), so RoPE positions and
the loss are those of the ring. After the first all-to-all the gathered sequence is in rank
order of the zigzag chunks (0, 2cp−1, 1, 2cp−2, ...); we permute it to natural order before
attention and back after, rather than give attention a permuted causal mask: in natural order
the core is the one-process core itself (attention_core: SDPA's causal kernel, flash-attn,
cuDNN, the varlen document path), and the two permutations are copies of whole chunks.

Document masking and the sliding window come for free: every rank holds the whole row's
document ids (documents.py), and the core sees whole sequences in natural order.

Heads: q heads on this tp rank (H/tp) must divide by cp (config checks say so). Grouped-query
kv heads are split the same way when Hkv/tp divides by cp; otherwise each kv head is first
repeated rep = cp / gcd(Hkv/tp, cp) times (consecutive copies), the fewest copies whose count
cp divides. Query head j uses kv head j // g (g = H/Hkv); rank r takes q heads
[r·H/cp, (r+1)·H/cp) and, of the repeated heads, [r·rep·Hkv/cp, (r+1)·rep·Hkv/cp): exactly the
copies of kv heads r·H/cp // g ... ((r+1)·H/cp − 1) // g its queries use. rep always divides g
(cp | H = g·Hkv), so the grouping stays uniform; the repeat's backward sums the copies' grads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from megapipe.distributed import collectives as C
from megapipe.parallel.context.zigzag import zigzag_shard, zigzag_unshard

SEQ, HEADS = 2, 1  # dims of (B, H, T, hd)


class _AllToAll(torch.autograd.Function):
    """all-to-all scattering `scatter_dim`, gathering `gather_dim` fwd / the same with the two
    dims swapped bwd (its transpose)."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return C.all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return C.all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def shards_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, h, T/cp, hd) sequence shards -> (B, h/cp, T, hd): the group's shards side by side in
    rank order, as they were cut (hybrid.py reads a balanced layout's chunks this way)."""
    return _AllToAll.apply(x, HEADS, SEQ, group)


def heads_to_shards(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of shards_to_heads: (B, h/cp, T, hd) in rank order -> (B, h, T/cp, hd)."""
    return _AllToAll.apply(x, SEQ, HEADS, group)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, h, T/cp, hd) zigzag sequence shards -> (B, h/cp, T, hd) head shards in natural order."""
    cp = dist.get_world_size(group)
    x = shards_to_heads(x, group)  # (B, h/cp, T, hd), the ranks' shards in order
    return zigzag_unshard(list(x.chunk(cp, dim=SEQ)), cp, SEQ)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of seq_to_heads: (B, h/cp, T, hd) natural order -> (B, h, T/cp, hd) zigzag."""
    cp = dist.get_world_size(group)
    x = torch.cat([zigzag_shard(x, cp, r, SEQ) for r in range(cp)], dim=SEQ)  # rank order
    return heads_to_shards(x, group)  # (B, h, T/cp, hd)


def kv_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """Copies of each kv head so that cp divides their count and every rank's q heads find
    theirs (the module docstring's rule): cp / gcd(kv_heads, cp)."""
    if q_heads % cp or q_heads % kv_heads:
        raise ValueError(
            f"ulysses_attention: {q_heads} query heads on this tp rank must divide by cp={cp} "
            f"and by the {kv_heads} kv heads"
        )
    return cp // math.gcd(kv_heads, cp)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    core: Callable,
    dropout_p: float = 0.0,
    documents: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """This rank's queries (B, H, T/cp, hd) attended over the whole sequence: (B, H, T/cp, hd).

    q, k, v hold this cp rank's zigzag slice of the sequence (k, v may have fewer heads: GQA).
    `core(q, k, v, dropout_p, documents, window)` is the one-process causal attention, run on
    whole sequences of H/cp heads in natural order; `documents` (B, T), the whole row's ids,
    and the sliding `window` pass to it unchanged (its positions are the row's).
    """
    cp = dist.get_world_size(group)
    rep = kv_repeats(q.shape[HEADS], k.shape[HEADS], cp)
    if rep > 1:  # (B, Hkv, T/cp, hd) -> (B, rep·Hkv, T/cp, hd)
        k, v = k.repeat_interleave(rep, dim=HEADS), v.repeat_interleave(rep, dim=HEADS)
    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))  # (B, H/cp, T, hd), (B, rep·Hkv/cp, …)
    out = core(q, k, v, dropout_p, documents, window)  # (B, H/cp, T, hd)
    return heads_to_seq(out, group)
