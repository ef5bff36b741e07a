"""Mixed precision: bfloat16 autocast with float32 master weights, optimizer and reductions."""

from __future__ import annotations

import contextlib

import torch


def autocast(dtype: str, device: torch.device | str):
    """bfloat16 autocast when `dtype` (train.dtype) says so; parameters stay float32."""
    if dtype == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
