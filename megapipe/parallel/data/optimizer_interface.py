"""The one optimizer interface that checkpoints (train/checkpoint*.py), the loop and the tests
use, whatever the optimizer's shape: torch's AdamW (train/optim.AdamW), its float32 main params
for bf16 weights (parallel/precision.MainParamOptimizer), or the distributed optimizer over
bucket shards (parallel/data/zero.py, zero2.py, zero3.py). Checkpoint code asks these members
instead of telling the optimizers apart.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn


class Optimizer(Protocol):
    """What every optimizer here offers besides torch's `step`, `zero_grad`, `param_groups`."""

    shards_state: bool  # AdamW's state lives as owned flat ranges of buckets (zero >= 1)
    stage_group: object  # the ranks writing this stage's state shards (None: not sharded)

    def param_state(self, param: nn.Parameter) -> dict: ...  # whole state (not sharded)

    def owned_state(self, param: nn.Parameter): ...  # (slot, state) of the owned range

    def step_count(self) -> torch.Tensor: ...

    def set_step_count(self, value: torch.Tensor) -> None: ...

    def main_weights(self) -> dict[int, torch.Tensor]: ...  # bf16: float32 main params

    def load_targets(self) -> dict[int, torch.Tensor]: ...  # bf16: what a load reads into

    def restore_main(self, full: dict[int, torch.Tensor]) -> None: ...

    def full_weights(self, write_back: bool = False): ...  # within: the weights whole


class WholeState:
    """The interface for an optimizer whose AdamW state is whole per parameter (zero=0): its
    `state[param]` holds `step`, `exp_avg`, `exp_avg_sq`; no main weights of its own."""

    shards_state = False
    stage_group = None

    def param_state(self, param: nn.Parameter) -> dict:
        """AdamW state of `param`, created (zeros) if absent so a load has tensors to fill."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            # float32 moments whatever the weights' dtype (bf16 weights: of the main params)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        return state

    def main_weights(self) -> dict[int, torch.Tensor]:
        return {}

    def load_targets(self) -> dict[int, torch.Tensor]:
        return {}

    def restore_main(self, full: dict[int, torch.Tensor]) -> None:
        return None

    def full_weights(self, write_back: bool = False):
        return contextlib.nullcontext()
