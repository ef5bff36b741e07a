"""Checkpoints: save and resume everything a run needs to continue bit for bit.

Layout of one checkpoint, `<checkpoint.dir>/step_00000100/`:
  .metadata, *.distcp   model and optimizer tensors via torch.distributed.checkpoint, keyed by
                        logical names (`model.layers.3.attn.qkv.weight`, `optim.<name>.exp_avg`)
                        with their logical shapes: under tp each rank writes the pieces of its
                        shard as a ShardedTensor (offsets from ShardSpec; padding rows dropped;
                        a replicated kv head and dp/cp replicas written once). A load asks DCP
                        for the blocks this rank holds (train/checkpoint_read.py), so a
                        checkpoint resumes under any mesh. Under pp each rank writes the
                        tensors of its chunks; the tied embedding that the last stage also
                        holds (Megatron's shared word embeddings) is written by stage 0 only
                        and restored into both copies. Under ZeRO-1 and up every replica
                        writes the AdamW moments of the flat ranges it owns, as blocks of the
                        same logical tensors (train/checkpoint_zero.py), so zero=0 and zero=1
                        checkpoints are one format
  rng_rank<R>.pt        each rank's RNG states, tp dropout trackers included (replays exactly)
  config.yaml           the resolved config of the run that wrote it
  train_state.json      the loop's own state (loss-spike history: train/spikes.py), if any
  meta.json             format, step, mesh, and every file's bytes and CRC-32 (read back by
                        its writer after fsync); written last (train/checkpoint_files.py)
A checkpoint is written under `step_N.tmp` and renamed when every rank's files are on disk and
rank 0 sees them all, so a crash never leaves a half-written `step_N`; older checkpoints are
pruned only after the new one is in place. A write that fails (a full disk) is agreed by every
rank, the `.tmp` removed, and the run stops or trains on (train/checkpoint_faults.py). A resume
verifies sizes and checksums first, and reads every file as data (checkpoint_metadata.py).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import warnings
from dataclasses import asdict
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megapipe._torch_compat import sharded_tensor
from megapipe.config import Config, ConfigError, load_config, write_config
from megapipe.distributed.launch import distributed, rank
from megapipe.distributed.mesh import MeshSizes, coords
from megapipe.models.gpt import GPT
from megapipe.models.moe import routing_biases
from megapipe.parallel.expert.sharding import NO_EP, EPInfo, expert_ep
from megapipe.parallel.tensor.layers import sharded_params
from megapipe.parallel.tensor.sharding import ShardSpec, TPInfo
from megapipe.train.checkpoint_faults import (
    as_failure,
    given_up,
    payload_bytes,
    rank0_says,
    save_file,
    written,
)
from megapipe.train.checkpoint_files import (
    CheckpointError,
    FilesError,
    SaveFailed,
    agreed_problem,
    check_shared,
    gather_records,
    missing,
    read_state,
    record,
    write_state,
)
from megapipe.train.checkpoint_read import load_tensors, read_blocks, read_targets, restore_rng
from megapipe.train.checkpoint_zero import main_weights, optimizer_state
from megapipe.train.rng import rng_states

FORMAT_VERSION = 2  # 2: meta.json records every file's size and CRC-32
READABLE = (1, 2)


def checkpoint_root(cfg: Config) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


class Entry(NamedTuple):
    """One model or optimizer tensor: its logical key and shape, this rank's local tensor."""

    key: str
    local: torch.Tensor
    shape: tuple
    spec: ShardSpec
    tp: TPInfo
    copy: bool  # the last pipeline stage's copy of the tied embedding: restored, not written
    ep: EPInfo = NO_EP  # an expert weight's (or its moments'): this ep rank's experts only


def _chunks(model: nn.Module) -> list[nn.Module]:
    """Modules whose parameter names are logical: a pipeline rank's chunks, or the model."""
    return list(model) if isinstance(model, nn.ModuleList) else [model]


def training_entries(model: nn.Module, optimizer, mains: dict | None = None) -> list[Entry]:
    """Every model and optimizer tensor of `model` (a GPT or a pipeline rank's ModuleList of
    chunks); optimizer moments share their parameter's sharding, the step count is replicated.
    The last stage's copy of the tied table (GPT.tied_copy_names) is marked `copy`. With
    `optimizer` None: the model's tensors only (zero=1 writes its state in checkpoint_zero).
    `mains`: the float32 main params written for bf16 weights (main_weights)."""
    out = []
    for chunk in _chunks(model):
        copies = chunk.tied_copy_names()
        for name, param, shape, spec, tp in sharded_params(chunk):
            copy, ep = name in copies, expert_ep(param)
            weight = (mains or {}).get(id(param), param.data)
            out.append(Entry(f"model.{name}", weight, shape, spec, tp, copy, ep))
            if optimizer is None:
                continue
            for key, value in optimizer.param_state(param).items():
                sharded = value.shape == param.shape
                out.append(Entry(f"optim.{name}.{key}", value, shape if sharded else value.shape,
                                 spec if sharded else ShardSpec(), tp, copy,
                                 ep if sharded else NO_EP))  # fmt: skip
        for name, buf, tp in routing_biases(chunk):  # replicated state, not a parameter
            out.append(Entry(f"model.{name}", buf, tuple(buf.shape), ShardSpec(), tp, False))
    return out


def training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model and optimizer tensors by logical name, each once (one process: the tensors)."""
    mains = main_weights(optimizer)
    return {e.key: e.local for e in training_entries(model, optimizer, mains) if not e.copy}


def _sharded(e: Entry, shard=sharded_tensor):
    """A ShardedTensor of the logical shape holding this rank's pieces of `e` (or what `shard`
    makes of them: checkpoint_plan.planned). Built over the tp group: the metadata exchange is
    a collective, and pp ranks hold different keys. An expert weight: this ep rank's experts,
    over the ep group (whole on every tp rank: DCP keeps one copy of each chunk)."""
    if e.ep.size > 1:
        at = [e.ep.rank * e.local.shape[0]] + [0] * (len(e.shape) - 1)
        return shard([(at, e.local)], e.shape, e.ep.group)
    blocks = []
    for piece in e.spec.pieces(e.tp.size, e.tp.rank):
        if not (piece.owner and piece.length):
            continue
        offsets = [0] * len(e.shape)
        offsets[e.spec.dim] = piece.global_lo
        blocks.append((offsets, e.local.narrow(e.spec.dim, piece.local_lo, piece.length)))
    return shard(blocks, e.shape, e.tp.group)


def save_state(cfg: Config, model: nn.Module, optimizer, shard=sharded_tensor) -> dict:
    """What dcp.save writes, each logical tensor once: dp/cp rank 0 of every (pp, tp) writes
    its chunks' tensors, whole (DCP keeps one of the tp replicas) or, where tp-sharded, as
    ShardedTensors of the pieces it owns; the tied embedding's last-stage copy is not written.
    Expert weights sharded by parallel.ep are written by the ep ranks of dp block 0, cp rank 0.
    Under zero=1 every replica writes the optimizer moments of its own shard (HSDP: the first
    replica of each shard). `shard` makes a
    tensor's blocks into what is written (checkpoint_plan.py plans them without the exchange)."""
    if not distributed():
        return training_tensors(model, optimizer)
    c, sizes = coords(rank(), MeshSizes.of(cfg)), MeshSizes.of(cfg)
    writer = not (c["dp"] or c["cp"])  # else a replica of what dp/cp rank 0 writes
    experts = c["dp"] < sizes.ep and not c["cp"]  # an ep rank of the first dp block
    zero = optimizer is not None and optimizer.shards_state
    state, mains = {}, main_weights(optimizer)  # a collective under zero=1: every rank
    for e in training_entries(model, None if zero else optimizer, mains) if experts else ():
        if e.copy or not (experts if e.ep.size > 1 else writer):
            continue
        whole = e.ep.size == 1 and (e.spec.dim is None or e.tp.size == 1)
        state[e.key] = e.local if whole else _sharded(e, shard)
    if zero:
        state.update(optimizer_state(_chunks(model), optimizer, writer, shard))
    return state


def whole_weights(optimizer, write_back: bool = False):
    """Within: the parameters whole (ZeRO-1 and up gather them after the step or on use:
    the optimizer interface's full_weights); `write_back`: zero=3's shards take them back."""
    if optimizer is None:
        return contextlib.nullcontext()
    return optimizer.full_weights(write_back)


def save(
    cfg: Config, step: int, model: nn.Module, optimizer, train_state: dict | None = None
) -> str:
    """Write checkpoint `step` (with the loop's `train_state`) atomically and prune old ones;
    returns its directory. A write that fails (a full disk) raises SaveFailed on every rank,
    nothing saved before lost."""
    tmp, final = begin(cfg, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP warns when used without a group
        with whole_weights(optimizer):
            state = save_state(cfg, model, optimizer)
            failed = written(dcp.save, state, checkpoint_id=tmp, no_dist=not distributed())
    return complete(
        cfg, step, tmp, final, rng_states(model), payload_bytes(state), failed, train_state
    )


def begin(cfg: Config, step: int) -> tuple[str, str]:
    """(temporary, final) directory of checkpoint `step`; the temporary one made empty."""
    root = checkpoint_root(cfg)
    final, tmp = step_dir(root, step), step_dir(root, step) + ".tmp"
    line = None
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        failed = as_failure(0, written(os.makedirs, tmp, exist_ok=True))
        line = failed and given_up(tmp, final, [failed], 0, _newest(root))
    line = rank0_says(line)
    if line:
        raise SaveFailed(line)
    return tmp, final


def complete(
    cfg: Config,
    step: int,
    tmp: str,
    final: str,
    rng: dict,
    nbytes: int = 0,
    failed=None,
    train_state: dict | None = None,
) -> str:
    """After the tensors are written (on every rank; `failed`: the OSError that write raised):
    this rank's RNG states, every rank's files recorded, and rank 0 puts the checkpoint (with
    the loop's `train_state`) in place; or, where any rank's write failed, rank 0 removes
    `tmp` and all raise SaveFailed."""
    if failed is None:
        failed = written(save_file, rng, os.path.join(tmp, f"rng_rank{rank()}.pt"))
    # every rank's files, fsynced and checksummed by their writer, or what failed where
    files, failures, needed = gather_records(tmp, failed, nbytes + payload_bytes(rng))
    line = None
    if rank() == 0:
        if not failures:
            try:
                done = as_failure(0, written(_finish, cfg, step, tmp, final, files, train_state))
            except CheckpointError as e:  # rank 0 cannot see every rank's files
                line, done = str(e), None
            failures = [done] if done else []
        if failures:
            line = given_up(tmp, final, failures, needed, _newest(os.path.dirname(final)))
    line = rank0_says(line)  # every rank waits for rank 0's verdict
    if line:
        raise SaveFailed(line)
    return final


def _newest(root: str) -> str | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _finish(
    cfg: Config, step: int, tmp: str, final: str, files: dict, train_state: dict | None
) -> None:
    """Rank 0, once every rank's files are on disk: check it sees them all, write the loop's
    state, record them in meta.json (last), move the checkpoint into place and only then prune
    older ones."""
    lost = missing(tmp, files)
    if lost:
        raise CheckpointError(
            f"checkpoint '{final}' is incomplete: {lost} as seen from rank 0; checkpoints "
            "need a filesystem shared by all nodes: set checkpoint.dir to a path on one"
        )
    write_state(tmp, train_state, files)
    write_config(cfg, os.path.join(tmp, "config.yaml"))
    files["config.yaml"] = record(os.path.join(tmp, "config.yaml"))
    meta = {"format": FORMAT_VERSION, "step": step, "mesh": asdict(MeshSizes.of(cfg))}
    _write_json(os.path.join(tmp, "meta.json"), {**meta, "files": files})
    if os.path.exists(final):  # the same step saved again: the old copy goes only after
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)
    _prune(os.path.dirname(final), cfg.checkpoint.keep)


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


def check_shared_dir(cfg: Config) -> None:
    """At start-up: every rank sees the same checkpoint directory, else a one-line error."""
    if not distributed():
        return
    root = checkpoint_root(cfg)
    made = not os.path.isdir(root)
    os.makedirs(root, exist_ok=True)
    try:
        check_shared(root)
    except FilesError as e:
        raise CheckpointError(str(e)) from None
    finally:
        if made:  # left as it was: a run that never saves makes no directory
            with contextlib.suppress(OSError):  # another rank's rmdir may come first
                os.rmdir(root)


def resume_path(cfg: Config) -> str | None:
    """The checkpoint to resume from, verified (sizes and checksums of every file, the reading
    split over the ranks): `auto` takes the newest intact one and says which it skipped and
    why, `none` nothing, else the given path, which must verify."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        for path in reversed(found):
            reason = _unverified(path)
            if reason is None:
                return path
            if rank() == 0:
                print(f"checkpoint: skipping {path}: {reason}", flush=True)
        if found:
            raise CheckpointError(
                f"no intact checkpoint under '{checkpoint_root(cfg)}' ({len(found)} failed "
                "verification); set checkpoint.resume=none to start over"
            )
        return None
    if not os.path.isdir(resume):
        raise CheckpointError(
            f"checkpoint.resume='{resume}' not found; give an existing step_* dir, auto or none"
        )
    reason = _unverified(resume)
    if reason is not None:
        raise CheckpointError(
            f"checkpoint '{resume}' failed verification: {reason}; resume from another one "
            "with checkpoint.resume=PATH"
        )
    return resume


def _unverified(path: str) -> str | None:
    """Why `path` cannot be trusted (its meta.json, or a file of it), or None."""
    try:
        meta = read_meta(path)
    except CheckpointError:
        return "meta.json is corrupt or of an unknown format"
    return agreed_problem(path, meta.get("files", {}))


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
    if meta.get("format") not in READABLE:
        raise CheckpointError(
            f"checkpoint '{path}' has format {meta.get('format')!r}; this megapipe reads format "
            f"{FORMAT_VERSION}: resume with the version that wrote it"
        )
    return meta


def load(path: str, cfg: Config, model: nn.Module, optimizer) -> dict:
    """Restore model, optimizer and step from `path`, written under any mesh for the same model
    and global batch; returns its meta.json plus `bytes_read` by this rank and `train_state`.
    RNG states are restored where the mesh is the one that wrote them (a bitwise resume); on
    another mesh the ranks keep the streams seeded at start (dropout draws differ from an
    uninterrupted run)."""
    meta = read_meta(path)
    saved = _check_resumable(path, cfg)
    with whole_weights(optimizer, write_back=True):  # zero=3: the shards take the loaded values
        targets = read_targets(_chunks(model), optimizer)
        meta["bytes_read"] = read_blocks(path, targets, meta.get("files"))
        targets.finish()  # bf16 weights: rounded from the float32 main params just read
    same_mesh = MeshSizes(**meta["mesh"]) == MeshSizes.of(cfg) and (
        saved.parallel.vpp == cfg.parallel.vpp
    )
    if same_mesh:
        restore_rng(path, model)
    meta["resharded"] = not same_mesh
    meta["train_state"] = read_state(path)
    return meta


def _check_resumable(path: str, cfg: Config) -> Config:
    """The config that wrote `path`, if this run may continue it: the same model, tokenizer and
    global batch (the data position is the step count); any mesh, schedule or zero setting."""
    try:
        saved = load_config(os.path.join(path, "config.yaml"))
    except ConfigError as e:
        raise CheckpointError(f"checkpoint '{path}': {e}") from None
    pairs = [(f"model.{k}", v, getattr(cfg.model, k)) for k, v in asdict(saved.model).items()]
    pairs += [
        ("train.global_batch", saved.train.global_batch, cfg.train.global_batch),
        ("data.tokenizer", saved.data.tokenizer, cfg.data.tokenizer),
    ]
    for key, was, now in pairs:
        if was != now:
            raise CheckpointError(
                f"checkpoint '{path}' was written with {key}={was} but this run has {key}={now}; "
                f"resume with {key}={was} or start a new run.dir"
            )
    return saved


def load_for_inference(path: str):
    """(Config, GPT in eval mode) from a checkpoint dir, or the newest one under a run dir."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        found = complete_checkpoints(os.path.join(path, "checkpoints")) or complete_checkpoints(
            path
        )
        if not found:
            raise CheckpointError(f"no checkpoint found at '{path}'; pass a step_* directory")
        path = found[-1]
    meta = read_meta(path)
    try:
        cfg = load_config(os.path.join(path, "config.yaml"))
    except ConfigError as e:
        raise CheckpointError(f"checkpoint '{path}': {e}") from None
    model = GPT(cfg.model, seed=cfg.train.seed)
    tensors = {f"model.{name}": p.data for name, p in model.named_parameters()}
    tensors |= {f"model.{name}": buf for name, buf, _ in routing_biases(model)}
    load_tensors(path, tensors, meta.get("files"))
    return cfg, model.eval()
