"""Activation recompute (Chen et al. 2016; GPipe §2.3; Korthikanti et al. 2022) and offload.

`full` keeps only each layer's input and reruns the layer in backward; `selective` reruns the
parts recompute.modules names: `core_attn`, the attention core (softmax(QKᵀ)V), whose
activations grow with T² but cost few FLOPs; `mlp`, a dense layer's norm2 and MLP from the
residual they read (Megatron-Core's `--recompute-modules mlp layernorm`; MaxText's
save_dot_except_mlpwi policy keeps the same dots), whose d_ff-wide activations are the largest
a dense layer keeps. torch's non-reentrant checkpoint stops its rerun once the last saved
tensor is back, but fc2 saves its input after its matmul ran: both MLP matmuls run again
(config/flops.mlp_rerun_params), fc2's tp sum does not (config/comm_bytes.mlp_rerun_ops);
`layernorm` (Megatron-Core's module of that name) asks what every norm already does: it keeps
its input alone and reruns in backward (parallel/autograd/rerun.py), so it adds nothing.
`layers=N` limits either mode to the first N transformer layers. The RNG state is replayed so
dropout masks, and hence gradients, equal those of `none`.

`offload` reruns nothing: every tensor a layer saves for backward moves to host memory in
forward and comes back when backward unpacks it (torch's saved-tensor hooks, as
`torch.autograd.graph.save_on_cpu`; Megatron-LM's activation offloading). The values are copies,
so losses and grads equal those of `none` bitwise. Parameters (the weights a matmul saves)
stay on the device: they are held anyway. On CUDA the copies run on a side stream into pinned
host buffers, overlapping the next operators; on the CPU the same code makes plain copies.
`offload_layers=N` limits it to the first N layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megapipe.config.schema import layer_mode, selective_parts

# layer_mode, selective_parts: for the model
__all__ = ["ActivationOffload", "layer_mode", "maybe_checkpoint", "selective_parts"]


def maybe_checkpoint(enabled: bool, fn: Callable, *args, random: bool = True):
    """fn(*args), storing only its inputs for backward when `enabled`; `random` False for an
    `fn` that draws no random numbers (a norm), whose rerun needs no RNG state stashed."""
    if not enabled:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=random)


class ActivationOffload:
    """Within `hooks()`: the tensors autograd saves move to host memory, except the weights of
    `module` (its parameters, whose storages are looked up at each save: ZeRO-3 gathers them
    anew for each use, bf16 casts replace them)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _weight(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self.module.parameters())

    def _pack(self, tensor: torch.Tensor):
        if tensor.numel() == 0 or self._weight(tensor) or getattr(tensor, "kept_in_place", False):
            # a weight (or a view of one), or a tensor shared by every layer (RoPE's tables,
            # models/rope.SharedTables): kept where it is
            return (None, tensor)
        if tensor.device.type != "cuda":
            return (None, tensor.detach().clone())  # the host is this device: a plain copy
        side = self._side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))  # tensor is written
        with torch.cuda.stream(side):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        tensor.record_stream(side)  # its memory not reused before the copy has read it
        return (tensor.device, host, done)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        if packed[0] is None:
            return packed[1]
        device, host, done = packed
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]
