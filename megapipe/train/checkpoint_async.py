"""Checkpoints written while training goes on (`checkpoint.async_save`).

The tensors to save are gathered as for a synchronous save (their ShardedTensor metadata is
agreed over the mesh's groups on the training thread) and copied in host memory (`staged`);
DCP's `async_save` then writes the copy from a background thread. The save's own collectives
(DCP's plan exchange) run on a process group of their own, so they never interleave with
training's on the default group. What needs every rank at one point (RNG files, the file
records, rank 0's rename) waits for the next save or the end of the run: `Saver.wait()`.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager

from megapipe.config import Config
from megapipe.distributed.launch import distributed
from megapipe.train.checkpoint import begin, complete, save, save_state, whole_weights
from megapipe.train.rng import rng_states


def staged(state: dict) -> dict:
    """A copy of every tensor of `state` (a ShardedTensor's local shards in place), taken now:
    the background write reads these while training updates the originals. (DCP's own stager
    cannot copy ShardedTensors.)"""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            out[key] = value.detach().clone()
            continue
        for shard in value.local_shards():
            shard.tensor = shard.tensor.detach().clone()
        out[key] = value
    return out


class AlreadyStaged(AsyncStager):
    """The state dict is already a copy (`staged`): nothing more to stage."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        return None


class Saver:
    """Saves checkpoints for one run, synchronously or in the background."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.pending = cfg, None
        self.background = cfg.checkpoint.async_save
        # a group for the background writes: created by every rank, once, at start-up
        self.group = dist.new_group(backend="gloo") if self.background and distributed() else None

    def save(self, step: int, model: nn.Module, optimizer) -> str:
        """Checkpoint `step`: written before returning, or (async) started; returns its dir."""
        self.wait()
        if not self.background:
            return save(self.cfg, step, model, optimizer)
        tmp, final = begin(self.cfg, step)
        with whole_weights(optimizer):  # staged copies: zero=3 may free the weights after
            state = staged(save_state(self.cfg, model, optimizer))
        rng = rng_states(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            future = dcp.async_save(
                state,
                checkpoint_id=tmp,
                process_group=self.group,
                async_stager=AlreadyStaged(),
                no_dist=not distributed(),
            )
        self.pending = (future, step, tmp, final, rng)
        return final

    def wait(self) -> str | None:
        """Finish the save in flight, if any (every rank calls it at the same step)."""
        if self.pending is None:
            return None
        future, step, tmp, final, rng = self.pending
        self.pending = None
        future.result()
        return complete(self.cfg, step, tmp, final, rng)
