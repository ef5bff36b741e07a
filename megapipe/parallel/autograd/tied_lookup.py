"""The token lookup of a tied table whose LM head is in the same graph, as one autograd node
that also hands the head its table: the lookup's grad is added into the head's.

A plain lookup's backward (embedding_dense_backward) makes a fresh V·d table of zeros, adds the
looked-up rows' grads into it, and autograd then adds that into the head's V·d grad for the same
table: at GPT-2's 50257 × 768 the zero table alone (its fresh pages) cost ~4% of a training step
on this CPU. Here the head reads the table through this node's second output, so the node's
backward receives the head's dense table grad and adds the rows into it in place (index_add_):
one dense grad, made once, by the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _TiedLookup(torch.autograd.Function):
    """(ids, table) -> (table[ids], table): the second output is the table for the head."""

    @staticmethod
    def forward(ctx, ids, table):
        ctx.save_for_backward(ids)
        ctx.table_shape = table.shape
        return F.embedding(ids, table), table.view_as(table)

    @staticmethod
    def backward(ctx, grad_rows, grad_table):
        (ids,) = ctx.saved_tensors
        if grad_table is None:  # the head was not in this backward: the lookup's grad alone
            grad_table = grad_rows.new_zeros(ctx.table_shape)
        if grad_rows is not None:
            # In place: the head's grad is made for this table alone (its fused loss's weight
            # grad, or autograd's sum of the table's uses, a fresh tensor either way).
            rows = grad_rows.reshape(-1, grad_rows.shape[-1]).to(grad_table.dtype)
            grad_table.index_add_(0, ids.reshape(-1), rows)
        return None, grad_table


def tied_lookup(ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`table[ids]` and the table to give the tied head (module docstring)."""
    return _TiedLookup.apply(ids, table)
