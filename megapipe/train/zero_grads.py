"""Step 3 of a training step on gradient shards (ZeRO-2 and -3, parallel/data/zero2.py):
the same sums, norm and clip as on full-size grads, each on the part this rank holds.

After the dp × cp reduce-scatter a rank holds, per bucket, the summed grads of one contiguous
range. The later sums are linear and elementwise, and the ranges line up across the ranks
they combine (parallel/data/zero.py's docstring): tp ranks share one bucket layout and replica
index, and the tied table sits in a bucket of its own on both of its pipeline stages. So:
- tp partial sums (sequence-parallel replicated parameters, replicated kv heads): each such
  parameter's owned range placed in a zero tensor of its local shape (only these small
  parameters, one step at a time), summed over tp as without sharding, the range taken back;
- the tied embedding: the two copies' owned ranges swapped with the pp peer and summed;
- the norm counts each logical element once: the owned range's blocks a checkpoint would
  write (train/checkpoint_zero.logical_pieces), squared-summed over every rank;
- the clip scales the shards.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.parallel.tensor.grad_sync import sync_tp_partial_grads
from megapipe.parallel.tensor.layers import sharded_params
from megapipe.pipeline.p2p import TIED_TAG, swap_with_pp_peer
from megapipe.pipeline.protocol import Grads
from megapipe.train.checkpoint_zero import logical_pieces


def finish_grad_shards(grads: Grads) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reduce-scatter, then the tp and tied sums on the shards; returns (each logical grad
    element once, for the norm; the shards, to clip)."""
    for chunk, reducer in zip(grads.chunks, grads.reducers):
        reducer.finish()
        _sync_tp_partial(chunk, reducer)
    tied = getattr(grads, "tied", None)  # a pipeline's tied embedding (pipeline/tied.py)
    if tied is not None:
        _sync_tied(tied, grads.reducers)
    counted = [g for c, r in zip(grads.chunks, grads.reducers) for g in _counted_once(c, r)]
    return counted, [s for r in grads.reducers for s in r.shards()]


def _tp_partial(spec, tp) -> bool:
    """grad_sync.sync_tp_partial_grads sums this parameter's grad over tp."""
    if tp.size == 1:
        return False
    return (spec.dim is None and tp.sp) or spec.replicated_units(tp.size)


def _sync_tp_partial(chunk: nn.Module, reducer) -> None:
    params = [p for _, p, _, spec, tp in sharded_params(chunk) if _tp_partial(spec, tp)]
    if not params:
        return
    whole = {}  # by id(p): each parameter's float32 grad of its local shape
    for p in params:  # every tp rank materialises the same set: one flat all-reduce
        whole[id(p)] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        piece = reducer.grad_piece(p)
        if piece is not None:
            slot, _ = reducer.slot_of[id(p)]
            whole[id(p)].view(-1)[slot.lo : slot.hi].copy_(piece)
    # sync_tp_partial_grads reads grad_of(p): bf16 weights' main grad (its buffer is freed
    # after the reduce-scatter: the float32 stand-in is bound in its place), else .grad
    mains = {id(p): p.main_grad for p in params if hasattr(p, "main_grad")}
    for p in params:
        setattr(p, "main_grad" if id(p) in mains else "grad", whole[id(p)])
    sync_tp_partial_grads(chunk)
    for p in params:
        piece = reducer.grad_piece(p)
        if piece is not None:
            slot, _ = reducer.slot_of[id(p)]
            piece.copy_(whole[id(p)].view(-1)[slot.lo : slot.hi])
        if id(p) in mains:
            p.main_grad = mains[id(p)]
        else:
            p.grad = None


def _piece(reducers: list, param: nn.Parameter, device) -> torch.Tensor:
    for r in reducers:
        if id(param) in r.slot_of:
            return r.grad_piece(param)
    return torch.zeros(0, device=device)  # more replicas than elements: owns nothing


def _sync_tied(tied, reducers: list) -> None:
    """The tied table's two copies summed on their owned ranges (pipeline/tied.py's order)."""
    if not tied.copies or tied.last == 0:
        return
    pieces = {s: _piece(reducers, w, w.device) for s, w in tied.copies.items()}
    if len(pieces) == 1:
        (mine,) = pieces
        other = tied.last if mine == 0 else 0
        peer = tied.placement.locate(other)[0]
        pieces[other] = swap_with_pp_peer(pieces[mine], peer, tied.mesh, TIED_TAG)
    total = pieces[0] + pieces[tied.last]  # one order on both holders: bitwise-equal copies
    for stage in tied.copies:
        pieces[stage].copy_(total)


def _counted_once(chunk: nn.Module, reducer) -> list[torch.Tensor]:
    """This rank's owned grad elements that the norm counts (tp replicas, replicated kv heads,
    the last stage's tied copy and HSDP's replicas of a shard once: reducer.counts)."""
    out, copies = [], chunk.tied_copy_names()
    for name, param, _, spec, tp in sharded_params(chunk):
        counted = name not in copies and reducer.counts(param)
        piece = reducer.grad_piece(param) if counted else None
        if piece is None:
            continue
        slot, _ = reducer.slot_of[id(param)]
        shape = tuple(param.shape)
        out += [b for _, b in logical_pieces(piece, shape, slot.lo, slot.hi, spec, tp)]
    return out
