"""A stage's output between its forward and its backward: keep the autograd node, not the values.

A pipeline stage sends its output on and runs its backward much later, from the grad the next
stage sends back. Megatron (Narayanan et al. 2021, deallocate_output_tensor) frees the output's
values as soon as they are handed to the send: only its grad_fn is needed for backward. With
1F1B's p microbatches in flight that is p·(b, T, d) floats per stage that no longer wait.
"""

from __future__ import annotations

import torch

from megapipe._torch_compat import run_backward, view_base


def release_values(out: torch.Tensor) -> None:
    """Drop `out`'s values but keep its autograd node (Megatron's deallocate_output_tensor,
    Narayanan et al. 2021): a stage's output is a residual sum, whose backward reads no output,
    so only its grad_fn must live until backward; the values travel on in the detached copy."""
    if view_base(out) is not None:  # a view: its base (and storage) lives on in the graph
        return
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def backward_from(roots, grads) -> None:
    """torch.autograd.backward without its root/grad shape check, which a released output
    (release_values) fails: the engine only needs each root's grad_fn and the grads."""
    roots = (roots,) if isinstance(roots, torch.Tensor) else tuple(roots)
    grads = (grads,) if grads is None or isinstance(grads, torch.Tensor) else tuple(grads)
    if grads[0] is None:  # the last stage: the root is the (scaled) loss, d loss / d loss = 1
        grads = (torch.ones_like(roots[0]), *grads[1:])
    run_backward(roots, grads)
