"""DualPipe's two copies of every stage: one gradient, the same step on both.

Under the "dual" placement (DeepSeek-V3 §3.2.1) rank r runs stage r for the microbatches going
down (chunk 0) and stage pp−1−r for those going up (chunk 1), so each stage's parameters live on
two ranks, r and pp−1−r, as chunk 0 of one and chunk 1 of the other (parameters 2×). Like the
tied embedding (tied.py) the two copies start equal (weights from (seed, name)), their grads are
summed after backward in one order on both (the down copy's first), so they stay bitwise equal
through the optimizer; the grad norm and checkpoints count the down copy only (chunk 0).
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.parallel.precision import grad_of, set_grad
from megapipe.pipeline.p2p import TWIN_TAG, swap_with_pp_peer
from megapipe.plan.actions import Placement


def counted_chunks(chunks: list[nn.Module], placement: Placement) -> list[nn.Module]:
    """The chunks whose parameters this rank counts (norm): all, or under dual the down copy."""
    return chunks[:1] if placement.style == "dual" else chunks


def sync_twin_grads(chunks: list[nn.Module], placement: Placement, mesh) -> None:
    """Under dual: sum each chunk's grads with its twin's on pp rank pp−1−r (chunk 1−c)."""
    if placement.style != "dual" or placement.pp == 1:
        return
    grads = [[_grad(p) for p in chunk.parameters()] for chunk in chunks]
    flat = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
    for chunk, gs, total in zip(chunks, grads, twin_sums(flat, placement, mesh), strict=True):
        for p, piece in zip(chunk.parameters(), total.split([g.numel() for g in gs])):
            set_grad(p, piece.view_as(p).clone())


def twin_sums(parts: list[torch.Tensor], placement: Placement, mesh) -> list[torch.Tensor]:
    """Under dual: each chunk's tensor in `parts` plus its twin's, the same stage's copy on pp
    rank pp−1−r (its chunk 1−c), summed in one order on both holders (the down copy's first),
    so both get bitwise the same sums; `parts` itself elsewhere."""
    if placement.style != "dual" or placement.pp == 1:
        return parts
    mine = torch.cat([t.reshape(-1) for t in parts])
    theirs = swap_with_pp_peer(mine, placement.pp - 1 - mesh.coord("pp"), mesh, TWIN_TAG)
    # theirs is [twin's chunk 0 | twin's chunk 1] = [copy of my chunk 1 | copy of my chunk 0]
    twin = dict(zip((1, 0), theirs.split([t.numel() for t in parts][::-1])))
    out = []
    for c, t in enumerate(parts):
        down, up = (t.reshape(-1), twin[c])[:: 1 if c == 0 else -1]
        out.append((down + up).view_as(t))
    return out


def _grad(p: nn.Parameter) -> torch.Tensor:
    grad = grad_of(p)
    return grad if grad is not None else torch.zeros_like(p)
