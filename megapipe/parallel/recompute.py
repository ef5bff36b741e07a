"""Activation recompute (Chen et al. 2016; GPipe §2.3; Korthikanti et al. 2022).

`full` keeps only each layer's input and reruns the layer in backward; `selective` reruns only
the attention core (softmax(QKᵀ)V), the part whose activations grow with T² but cost few FLOPs.
`layers=N` limits either mode to the first N transformer layers. The RNG state is replayed so
dropout masks, and hence gradients, equal those of `none`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.checkpoint import checkpoint

from megapipe.config.memory_terms import layer_mode

__all__ = ["layer_mode", "maybe_checkpoint"]  # layer_mode: config/memory_terms.py's, for the model


def maybe_checkpoint(enabled: bool, fn: Callable, *args):
    """fn(*args), storing only its inputs for backward when `enabled`."""
    if not enabled:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
