"""Buffers kept from step to step for the large tensors every step makes anew.

On the CPU a tensor of a few MB or more is served by fresh pages from the kernel (glibc hands
large frees back to it), and each 4 KiB page costs a fault on first touch. At GPT-2 124M
(batch 2 × 256, 2 threads) the fresh weight grads of the fc, proj and qkv linears and the LM
head's chunk-logits buffer took ~60k faults a step, and their matmuls ran at 150-195 GFLOP/s
where the same matmul into memory already touched runs at ~215 (each matmul of a step timed
with its faults: docs/benchmarks/2026-11-24-train-throughput-cpu.md). Writing them into buffers kept
from the step before (`torch.mm(..., out=)`: the same kernel, so the same bits) removes that cost.
Autograd hands a kept buffer to the parameter's .grad without a copy (it gets a view, a tensor of
its own); after the optimizer drops .grad the storage is ours alone again and the next step writes
into it. A buffer whose storage anything else still holds (a .grad under grad accumulation, a
distributed-optimizer shard's view) is never lent: a fresh one is made instead.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe._torch_compat import storage_use_count


class KeptBuffers:
    """Up to `keep` buffers of one shape, dtype and device, each lent only while nothing else
    holds its storage; a request of another shape forgets the kept ones."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self.kept: list[torch.Tensor] = []

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor of `shape` to overwrite: a free kept buffer's view, else a new one (kept
        while fewer than `keep` are)."""
        shape = torch.Size(shape)
        self.kept = [
            b for b in self.kept if b.shape == shape and b.dtype == dtype and b.device == device
        ]
        for buffer in self.kept:
            if only_holder(buffer):
                return buffer.view(shape)
        buffer = torch.empty(shape, dtype=dtype, device=device)
        if len(self.kept) < self.keep:
            self.kept.append(buffer)
        return buffer.view(shape)


def kept_or_new(
    kept: KeptBuffers | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`kept.take(...)`, or a fresh tensor where nothing is kept."""
    if kept is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return kept.take(shape, dtype, device)


def only_holder(tensor: torch.Tensor) -> bool:
    """No other tensor (a view, a .grad, a saved tensor) shares `tensor`'s storage: the count
    is `tensor` itself and the temporary storage object made to ask."""
    return storage_use_count(tensor) == 2


def keep_none(model: nn.Module) -> None:
    """Every KeptBuffers of `model`'s modules (and of the objects they hold, the head's
    HeadBuffers) keeps nothing from now on: a CPU run that stands for a device, where a fresh
    buffer costs no page faults and none is held between steps (train/fake_ranks.py measures
    what a device holds)."""
    for module in model.modules():
        for value in vars(module).values():
            held = [value, *vars(value).values()] if hasattr(value, "__dict__") else [value]
            for kept in held:
                if isinstance(kept, KeptBuffers):
                    kept.keep, kept.kept = 0, []
