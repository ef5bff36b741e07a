"""Checkpoints: save and resume everything a run needs to continue bit for bit.

Layout of one checkpoint, `<checkpoint.dir>/step_00000100/`:
  .metadata, *.distcp   model and optimizer tensors via torch.distributed.checkpoint, keyed by
                        logical names (`model.layers.3.attn.qkv.weight`, `optim.<name>.exp_avg`)
                        with their logical shapes: under tp each rank writes the pieces of its
                        shard as a ShardedTensor (offsets from ShardSpec; padding rows dropped;
                        a replicated kv head and dp/cp replicas written once), and a load reads
                        each logical tensor whole and shards it, so a later reshard is a
                        relaxation of the mesh check only
  rng_rank<R>.pt        each rank's RNG states, tp dropout tracker included (replays exactly)
  config.yaml           the resolved config of the run that wrote it
  meta.json             step, mesh, LR schedule, sampler position; written last
A checkpoint is written under `step_N.tmp` and renamed when complete, so a crash never leaves a
half-written `step_N`, and older checkpoints are pruned only after the new one exists.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from megapipe.config import Config, ConfigError, write_config
from megapipe.mesh import MeshSizes, coords
from megapipe.tensor_parallel.sharding import ShardSpec, TPInfo
from models.init import sharded_params

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A missing, corrupt or incompatible checkpoint; the message is one line."""


def checkpoint_root(cfg: Config) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _rank() -> int:
    return 0 if _no_dist() else dist.get_rank()


def is_rank0() -> bool:
    """The rank that writes run-level files (config, metrics, meta.json)."""
    return _rank() == 0


def _barrier() -> None:
    if not _no_dist():
        dist.barrier()


def _ensure_optim_state(param: nn.Parameter, optimizer) -> dict:
    """AdamW state of `param`, created (zeros) if absent so a load has tensors to fill."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def training_entries(model: nn.Module, optimizer) -> list[tuple]:
    """(logical key, local tensor, logical shape, shard spec, tp) of every model and optimizer
    tensor; optimizer moments share their parameter's sharding, the step count is replicated."""
    out = []
    for name, param, shape, spec, tp in sharded_params(model):
        out.append((f"model.{name}", param.data, shape, spec, tp))
        for key, value in _ensure_optim_state(param, optimizer).items():
            sharded = value.shape == param.shape
            out.append((f"optim.{name}.{key}", value, shape if sharded else value.shape,
                        spec if sharded else ShardSpec(), tp))  # fmt: skip
    return out


def training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model and optimizer tensors by logical name (one process: the tensors themselves)."""
    return {key: local for key, local, *_ in training_entries(model, optimizer)}


def _sharded(local, shape, spec: ShardSpec, tp: TPInfo, writer: bool):
    """A ShardedTensor of logical `shape` holding this rank's pieces (none if not a writer)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = []
    for piece in spec.pieces(tp.size, tp.rank) if writer else []:
        if not (piece.owner and piece.length):
            continue
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[spec.dim], sizes[spec.dim] = piece.global_lo, piece.length
        data = local.narrow(spec.dim, piece.local_lo, piece.length).contiguous()
        placement = f"rank:{dist.get_rank()}/{data.device}"
        shards.append(Shard(data, ShardMetadata(offsets, sizes, placement)))
    return ShardedTensor._init_from_local_shards(shards, *shape)


def _save_state(cfg: Config, model: nn.Module, optimizer) -> dict:
    """What dcp.save writes: plain tensors where whole (DCP keeps one copy of replicas),
    ShardedTensors of the owned pieces where tp-sharded (dp/cp rank 0 writes them)."""
    if _no_dist():
        return training_tensors(model, optimizer)
    c = coords(_rank(), MeshSizes.of(cfg))
    writer = c["dp"] == 0 and c["cp"] == 0
    state = {}
    for key, local, shape, spec, tp in training_entries(model, optimizer):
        whole = spec.dim is None or tp.size == 1
        state[key] = local if whole else _sharded(local, shape, spec, tp, writer)
    return state


def save(cfg: Config, step: int, model: nn.Module, optimizer, extra: dict) -> str:
    """Write checkpoint `step` atomically and prune old ones; returns its directory."""
    root = checkpoint_root(cfg)
    final, tmp = step_dir(root, step), step_dir(root, step) + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP warns when used without a group
        dcp.save(_save_state(cfg, model, optimizer), checkpoint_id=tmp, no_dist=_no_dist())
    torch.save(_rng_states(model), os.path.join(tmp, f"rng_rank{_rank()}.pt"))
    _barrier()
    if _rank() == 0:
        write_config(cfg, os.path.join(tmp, "config.yaml"))
        meta = {"format": FORMAT_VERSION, "step": step, "mesh": asdict(MeshSizes.of(cfg))}
        _write_json(os.path.join(tmp, "meta.json"), {**meta, **extra})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(root, cfg.checkpoint.keep)
    _barrier()
    return final


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def complete_checkpoints(root: str) -> list[str]:
    """Finished checkpoints under `root`, oldest first (temporary dirs are not listed)."""
    found = glob.glob(os.path.join(root, "step_*"))
    done = [p for p in found if not p.endswith(".tmp") and os.path.isfile(f"{p}/meta.json")]
    return sorted(done)


def _prune(root: str, keep: int) -> None:
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resume_path(cfg: Config) -> str | None:
    """The checkpoint to resume from: `auto` takes the newest, `none` nothing, else the path."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        return found[-1] if found else None
    if not os.path.isdir(resume):
        raise CheckpointError(
            f"checkpoint.resume='{resume}' not found; give an existing step_* dir, auto or none"
        )
    return resume


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        _ = meta["step"], meta["mesh"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint '{path}' is incomplete or corrupt (meta.json: {type(e).__name__}); "
            "resume from another one with checkpoint.resume=PATH"
        ) from None
    return meta


def load(path: str, cfg: Config, model: nn.Module, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG from `path`; returns its meta.json."""
    meta = read_meta(path)
    saved, current = MeshSizes(**meta["mesh"]), MeshSizes.of(cfg)
    if saved != current:
        raise CheckpointError(
            f"checkpoint '{path}' was written under mesh {saved} but this run uses {current}; "
            "resume with the same parallel sizes"
        )
    _load_sharded(path, training_entries(model, optimizer))
    rng_file = os.path.join(path, f"rng_rank{_rank()}.pt")
    try:
        _set_rng_states(torch.load(rng_file, weights_only=False), model)
    except (OSError, RuntimeError, KeyError, EOFError) as e:
        raise CheckpointError(f"checkpoint '{path}': cannot read {rng_file} ({e})") from None
    return meta


@torch.no_grad()
def _load_sharded(path: str, entries: list[tuple]) -> None:
    """Read each tp-sharded tensor whole under its logical shape, then keep this rank's shard."""
    targets, whole = {}, {}
    for key, local, shape, spec, tp in entries:
        sharded = spec.dim is not None and tp.size > 1
        targets[key] = local.new_empty(shape) if sharded else local
        if sharded:
            whole[key] = (local, spec, tp)
    _load_tensors(path, targets)
    for key, (local, spec, tp) in whole.items():
        local.copy_(spec.shard(targets[key], tp))


def _load_tensors(path: str, tensors: dict) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, checkpoint_id=path, no_dist=_no_dist())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint '{path}' is corrupt or does not match the model ({first_line[:200]}); "
            "resume from another one with checkpoint.resume=PATH"
        ) from None


def _tp_tracker(model: nn.Module):
    """The tp dropout RNG tracker the model's layers share (None with tp size 1)."""
    for module in model.modules():
        rng = getattr(getattr(module, "tp", None), "rng", None)
        if rng is not None:
            return rng
    return None


def _rng_states(model: nn.Module) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _tp_tracker(model)
    if tracker is not None:
        states["tp_tracker"] = tracker.state.clone()
    return states


def _set_rng_states(states: dict, model: nn.Module) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    tracker = _tp_tracker(model)
    if tracker is not None:
        tracker.state = states["tp_tracker"]


def load_for_inference(path: str):
    """(Config, GPT in eval mode) from a checkpoint dir, or the newest one under a run dir."""
    from megapipe.config import load_config
    from models.gpt import GPT

    if not os.path.isfile(os.path.join(path, "meta.json")):
        found = complete_checkpoints(os.path.join(path, "checkpoints")) or complete_checkpoints(
            path
        )
        if not found:
            raise CheckpointError(f"no checkpoint found at '{path}'; pass a step_* directory")
        path = found[-1]
    read_meta(path)
    try:
        cfg = load_config(os.path.join(path, "config.yaml"))
    except ConfigError as e:
        raise CheckpointError(f"checkpoint '{path}': {e}") from None
    model = GPT(cfg.model, seed=cfg.train.seed)
    tensors = {f"model.{name}": p.data for name, p in model.named_parameters()}
    _load_tensors(path, tensors)
    return cfg, model.eval()
