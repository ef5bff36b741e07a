"""Checkpoints written while training goes on (`checkpoint.async_save`).

The tensors to save are gathered as for a synchronous save (their ShardedTensor metadata is
agreed over the mesh's groups on the training thread) and copied in host memory (`staged`);
DCP's `async_save` then writes the copy from a background thread. The save's own collectives
(DCP's plan exchange) run on a process group of their own, so they never interleave with
training's on the default group. What needs every rank at one point (RNG files, the file
records, rank 0's rename) waits for the next save or the end of the run: `Saver.wait()`; a
write that failed in the background is found there, on every rank alike.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager

from megapipe.config import Config, ConfigError
from megapipe.distributed.launch import distributed, rank
from megapipe.models.hf import hf_config
from megapipe.train.checkpoint import SaveFailed, begin, complete, save, save_state, whole_weights
from megapipe.train.checkpoint_faults import payload_bytes, written
from megapipe.train.export import export_hf
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


HF_DIR = "hf"  # checkpoint.save_hf's transformers directory inside each step_* checkpoint


def _check_exportable(cfg: Config) -> None:
    try:
        hf_config(cfg.model)
    except ValueError as err:
        raise ConfigError(f"checkpoint.save_hf=true: {err}") from None


class Saver:
    """Saves checkpoints for one run, synchronously or in the background. A save that cannot
    be written (train/checkpoint_faults.py) stops the run (SaveFailed) or, under
    checkpoint.on_save_error=continue, is said in one line and training goes on."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.pending, self.failed = cfg, None, []
        if cfg.checkpoint.save_hf:  # every rank refuses alike, before the first step
            _check_exportable(cfg)
        self.background = cfg.checkpoint.async_save
        # a group for the background writes: created by every rank, once, at start-up
        self.group = dist.new_group(backend="gloo") if self.background and distributed() else None
        if self.background and not distributed():  # DCP's writer thread warns at every save,
            # outside the caller's catch_warnings: a one-process save is what is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

    def save(
        self, step: int, model: nn.Module, optimizer, train_state: dict | None = None
    ) -> str | None:
        """Checkpoint `step` (with the loop's `train_state`): written before returning, or
        (async) started; returns its dir (None: it failed and the run goes on)."""
        self.wait()
        if not self.background:
            return self._hf(
                self._settled(step, save, self.cfg, step, model, optimizer, train_state)
            )
        started = self._settled(step, begin, self.cfg, step)
        if started is None:
            return None
        tmp, final = started
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
        self.pending = (future, step, tmp, final, rng, payload_bytes(state), train_state)
        return final

    def wait(self) -> str | None:
        """Finish the save in flight, if any (every rank calls it at the same step)."""
        if self.pending is None:
            return None
        future, step, tmp, final, rng, nbytes, train_state = self.pending
        self.pending = None
        failed = written(future.result)
        return self._hf(
            self._settled(
                step, complete, self.cfg, step, tmp, final, rng, nbytes, failed, train_state
            )
        )

    def _hf(self, final: str | None) -> str | None:
        """checkpoint.save_hf: rank 0 writes the complete checkpoint `final` again as a
        transformers directory `final`/hf (train/export.py: read whole from disk, with the run's
        tokenizer), pruned with its checkpoint."""
        if final is not None and self.cfg.checkpoint.save_hf and rank() == 0:
            export_hf(final, os.path.join(final, HF_DIR), force=True)
        return final

    def _settled(self, step: int, fn, *args):
        """fn(*args), or None where it raised SaveFailed and checkpoint.on_save_error=continue
        (every rank raises it alike: the ranks agree on a failed save)."""
        try:
            return fn(*args)
        except SaveFailed as e:
            if self.cfg.checkpoint.on_save_error != "continue":
                raise
            self.failed.append(step)
            if rank() == 0:
                print(f"warning: {e}; training goes on (checkpoint.on_save_error=continue)",
                      file=sys.stderr, flush=True)  # fmt: skip
            return None
