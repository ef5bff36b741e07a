"""Every random stream a run draws from, saved and restored so a resume replays exactly: the
CPU (and CUDA) generators and the tensor-parallel dropout trackers (parallel/tensor/random.py)."""

from __future__ import annotations

import torch
from torch import nn


def _tp_trackers(model: nn.Module) -> list:
    """The tp dropout RNG trackers of the model (one per pipeline chunk; none with tp size 1)."""
    found = []
    for module in model.modules():
        rng = getattr(getattr(module, "tp", None), "rng", None)
        if rng is not None and not any(rng is f for f in found):
            found.append(rng)
    return found


def rng_states(model: nn.Module) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    states["tp_trackers"] = [t.state.clone() for t in _tp_trackers(model)]
    return states


def set_rng_states(states: dict, model: nn.Module) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    for tracker, state in zip(_tp_trackers(model), states["tp_trackers"], strict=True):
        tracker.state = state
