"""Gradients that tp ranks hold partial copies of, summed over tp after backward.

Two cases, both linear, so the sum may run before or after the data-parallel all-reduce:
- Sequence parallelism (Korthikanti et al. 2022, §4.2.2): replicated parameters (norm gains,
  row-linear biases, learned positions) see only this rank's sequence chunk; Megatron
  all-reduces their grads over tp.
- GQA with fewer kv heads than tp: tp/n_kv ranks hold a copy of one kv head, and each copy's
  grad comes from that rank's query heads only; the logical grad is the sum over the copies.
"""

from __future__ import annotations

import torch

from megapipe.distributed import collectives as C
from megapipe.parallel.precision import grad_of
from megapipe.parallel.tensor.layers import sharded_params


def _kv_buffers(param, spec, tp) -> list[tuple]:
    """(local piece, segment offset, buffer) per replicated segment: the local grad placed at
    its position in a zero buffer the size of the logical segment."""
    out, start, dim = [], 0, spec.dim
    for seg, piece in zip(spec.segments, spec.pieces(tp.size, tp.rank)):
        if seg // spec.unit < tp.size:
            grad = grad_of(param)
            shape = list(grad.shape)
            shape[dim] = seg
            buf = grad.new_zeros(shape)
            src = grad.narrow(dim, piece.local_lo, piece.length)
            buf.narrow(dim, piece.global_lo - start, piece.length).copy_(src)
            out.append((piece, start, buf))
        start += seg
    return out


def synced_elements(model: torch.nn.Module) -> int:
    """Elements sync_tp_partial_grads all-reduces for `model` once its grads exist: each
    parameter it sums whole, and each replicated kv segment's logical size (its buffer); the
    same selection, counted from the parameters' shapes (meta-device models too)."""
    total = 0
    for _, param, _, spec, module_tp in sharded_params(model):
        if module_tp.size == 1:
            continue
        if spec.dim is None and module_tp.sp:
            total += param.numel()
        elif spec.replicated_units(module_tp.size):
            rest = param.numel() // param.shape[spec.dim]
            total += sum(seg * rest for seg in spec.segments if seg // spec.unit < module_tp.size)
    return total


def sync_tp_partial_grads(model: torch.nn.Module) -> int:
    """All-reduce over tp (one flat buffer) the partial grads; returns the elements reduced."""
    whole, kv = [], []
    tp = None
    for _, param, _, spec, module_tp in sharded_params(model):
        if module_tp.size == 1 or grad_of(param) is None:
            continue
        tp = module_tp
        if spec.dim is None and module_tp.sp:
            whole.append(param)
        elif spec.replicated_units(module_tp.size):
            kv += [(param, spec, *entry) for entry in _kv_buffers(param, spec, module_tp)]
    tensors = [grad_of(p) for p in whole] + [entry[-1] for entry in kv]
    if not tensors:
        return 0
    flat = C.all_reduce(torch.cat([t.flatten() for t in tensors]), tp.group)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))
    for param, spec, piece, start, buf in kv:
        summed = buf.narrow(spec.dim, piece.global_lo - start, piece.length)
        grad_of(param).narrow(spec.dim, piece.local_lo, piece.length).copy_(summed)
    return flat.numel()


def grads_counted_once(model: torch.nn.Module, skip=(), keep=None) -> list[torch.Tensor]:
    """Each logical gradient element once over the tp group: replicated parameters on tp rank 0
    only, replicated kv-head copies on their first holder only (for the global grad norm).
    Parameters named in `skip` are left out (a pipeline stage's copy of the tied embedding), and
    those `keep(param)` rejects (a replica that another rank counts: parallel/data/reducer.py)."""
    out = []
    for name, param, _, spec, tp in sharded_params(model):
        grad = grad_of(param)
        if grad is None or name in skip or (keep is not None and not keep(param)):
            continue
        if spec.dim is None or tp.size == 1:
            if tp.rank == 0:
                out.append(grad)
            continue
        for piece in spec.pieces(tp.size, tp.rank):
            if piece.owner and piece.length:
                out.append(grad.narrow(spec.dim, piece.local_lo, piece.length))
    return out
