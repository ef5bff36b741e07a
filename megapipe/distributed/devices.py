"""This machine's CUDA devices as the code sizes and picks its kernels by: each device's compute
capability (the attention kernel, parallel/context/kernel_choice; the experts' grouped matmul,
parallel/autograd/grouped_linear) and its memory (the LM head's chunks, config/memory_terms
.head_chunk_rows), asked of torch once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def capability(device: torch.device | int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA `device` (a torch.device or an index)."""
    return tuple(torch.cuda.get_device_capability(device))


@functools.cache
def _total_memory(device: torch.device | int) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def memory(device: torch.device | int | None) -> int | None:
    """Bytes of memory of CUDA `device` (None: the current one); None off CUDA or without one."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return _total_memory(torch.cuda.current_device() if device is None else device)
