"""Reading a checkpoint into any mesh: each rank asks DCP for exactly the logical blocks it holds.

A checkpoint stores every tensor under its logical name and shape, as the chunks its writers
held (train/checkpoint.py). A reader describes what it holds the same way, as blocks of the
logical tensor at offsets (a tp shard's pieces, ShardSpec; a zero=1 rank's owned flat ranges,
train/checkpoint_zero.py), each a view of the tensor it fills. DCP's resharding read
(`create_read_items_for_chunk_list`) then plans, per block, the overlapping saved chunks, and
the file reader copies each overlap straight into the view: no logical tensor is assembled
whole, whatever mesh wrote the checkpoint (Megatron-Core dist_checkpointing and torchtitan
reshard the same way). What a rank reads from disk is the saved chunks that overlap its blocks.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from megapipe._torch_compat import narrow_to_block
from megapipe.distributed.launch import distributed, rank
from megapipe.models.moe import routing_biases
from megapipe.parallel.expert.sharding import expert_offset
from megapipe.parallel.tensor.layers import sharded_params
from megapipe.parallel.tensor.sharding import ShardSpec, TPInfo
from megapipe.train.checkpoint_faults import first_failure
from megapipe.train.checkpoint_files import CheckpointError
from megapipe.train.checkpoint_metadata import Refused, SafeReader
from megapipe.train.checkpoint_zero import logical_pieces, main_weights, state_keys
from megapipe.train.rng import set_rng_states

Blocks = dict[str, list[tuple[list, torch.Tensor]]]  # key -> [(logical offsets, view)]


def tp_blocks(local: torch.Tensor, shape: tuple, spec: ShardSpec, tp: TPInfo, first=0) -> list:
    """The logical blocks a tp rank's local tensor holds (padding rows excluded, replicated
    pieces included: every holder needs them); `first`: the logical index of its dim 0 (an ep
    rank's first expert: experts are whole on every tp rank)."""
    if first:
        return [([first] + [0] * (len(shape) - 1), local)]
    if spec.dim is None or tp.size == 1:
        return [([0] * len(shape), local)]
    out = []
    for piece in spec.pieces(tp.size, tp.rank):
        if piece.length:
            offsets = [0] * len(shape)
            offsets[spec.dim] = piece.global_lo
            out.append((offsets, local.narrow(spec.dim, piece.local_lo, piece.length)))
    return out


class Targets:
    """What this rank reads: `blocks` of logical tensors, whole `scalars` (AdamW step counts),
    and `finish()` for what is set from them after the read."""

    def __init__(self) -> None:
        self.blocks: Blocks = {}
        self.scalars: dict[str, torch.Tensor] = {}
        self.after: list = []

    def add(self, key: str, blocks: list) -> None:
        self.blocks.setdefault(key, []).extend(blocks)

    def scalar(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The tensor `key` is read into (one per key: a second holder copies it after)."""
        if key not in self.scalars:
            self.scalars[key] = like
        elif self.scalars[key] is not like:
            self.after.append(lambda: like.copy_(self.scalars[key]))
        return self.scalars[key]

    def finish(self) -> None:
        with torch.no_grad():
            for fn in self.after:
                fn()


def read_targets(chunks: list[nn.Module], optimizer) -> Targets:
    """Every block of weights and optimizer state this rank holds, through the optimizer
    interface (parallel/data/optimizer_interface.py): AdamW's moments are blocks like their
    parameter's (zero=0, `param_state`) or the owned flat ranges (zero >= 1, `owned_state`).
    The last stage's tied copy reads the table. bf16 weights are read into their float32 main
    params, then rounded (`restore_main`)."""
    t, mains = Targets(), main_weights(optimizer, load=True)
    if mains:
        t.after.append(lambda: optimizer.restore_main(mains))
    zero = optimizer is not None and optimizer.shards_state
    for chunk in chunks:
        for name, param, shape, spec, tp in sharded_params(chunk):
            weight, first = mains.get(id(param), param.data), expert_offset(param)
            t.add(f"model.{name}", tp_blocks(weight, shape, spec, tp, first))
            if optimizer is None:
                continue
            if zero:
                _zero_state(t, name, param, shape, spec, tp, optimizer)
                continue
            for key, value in optimizer.param_state(param).items():
                if value.shape == param.shape:
                    t.add(f"optim.{name}.{key}", tp_blocks(value, shape, spec, tp, first))
                else:
                    t.scalar(f"optim.{name}.{key}", value)
        for name, buf, _ in routing_biases(chunk):  # replicated state, not a parameter
            t.add(f"model.{name}", [([0] * buf.dim(), buf)])
    return t


def _zero_state(t: Targets, name, param, shape, spec, tp, optimizer) -> None:
    owned = optimizer.owned_state(param)
    keys, counted = state_keys(owned)
    if counted:
        step = t.scalar(f"optim.{name}.step", torch.zeros((), dtype=torch.float32))
        t.after.append(lambda: optimizer.set_step_count(step))
    if owned is None:
        return
    slot, state = owned
    for key in keys:
        local = tuple(param.shape)
        t.add(
            f"optim.{name}.{key}",
            logical_pieces(
                state[key], local, slot.lo, slot.hi, spec, tp, True, expert_offset(param)
            ),
        )


class BlockLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner for the scalars, plus a resharding read of every block."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__()
        self.blocks = blocks

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, blocks in self.blocks.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if saved is None:
                raise KeyError(f"the checkpoint has no tensor {key}")
            chunks = [ChunkStorageMetadata(torch.Size(o), b.shape) for o, b in blocks]
            items += create_read_items_for_chunk_list(key, saved, chunks)
        self.plan = LoadPlan(items, plan.storage_data, plan.planner_data)
        return self.plan

    def load_bytes(self, read_item, value) -> None:
        """Never reached (check_records refuses bytes entries); torch's would unpickle them."""
        raise Refused(f"{read_item.dest_index.fqn} is a pickled object: refused")

    def lookup_tensor(self, index) -> torch.Tensor:
        if index.fqn in self.blocks:
            return self.blocks[index.fqn][index.index][1]
        return super().lookup_tensor(index)


class CountingReader(SafeReader):
    """SafeReader (no code runs from .metadata or the data files) that reads each saved chunk
    once however many of this rank's blocks overlap it (torch's reads it once per block: a
    fused q|k|v matrix three times), and adds up the bytes it reads (`bytes_read`)."""

    bytes_read = 0

    def read_data(self, plan: LoadPlan, planner):
        wanted: dict = {}  # saved chunk -> the reads that copy from it
        for item in plan.items:
            wanted.setdefault(item.storage_index, []).append(item)
        infos = {index: self.storage_data[index] for index in wanted}
        self.bytes_read += sum(info.length for info in infos.values())
        by_file: dict = {}
        for index, info in infos.items():
            by_file.setdefault(info.relative_path, []).append(index)
        for relative, indexes in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative), "rb") as stream:
                for index in sorted(indexes, key=lambda i: infos[i].offset):
                    saved = _tensor(self._slice_file(stream, infos[index]).read(), relative)
                    for item in wanted[index]:
                        _copy_into(planner, item, saved)
        done: Future = Future()
        done.set_result(None)
        return done


def _tensor(raw: bytes, relative: str) -> torch.Tensor:
    """A saved chunk, read with torch.load's weights-only unpickler: anything but a tensor in
    the data file `relative` is refused, never run."""
    try:
        saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        saved = None
    if not isinstance(saved, torch.Tensor):
        raise Refused(f"{relative} holds an object where its records place a tensor: refused")
    return saved


def _copy_into(planner, item, saved: torch.Tensor) -> None:
    """The part of a saved chunk that `item` reads, into the block it fills."""
    part = narrow_to_block(saved, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != part.size():
        raise ValueError(f"{item.storage_index.fqn}: {tuple(part.shape)} into {target.shape}")
    target.copy_(part)
    planner.commit_tensor(item, target)


def restore_rng(path: str, model) -> None:
    """This rank's RNG states from the checkpoint at `path`, read with torch.load's weights-only
    unpickler: tensors in dicts and lists only, so a pickled object planted in the file is
    refused and never run (checkpoints travel between people and sit on shared disks)."""
    rng_file = os.path.join(path, f"rng_rank{rank()}.pt")
    try:
        states = torch.load(rng_file, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint '{path}': {rng_file} holds objects other than RNG state tensors, "
            "which a resume never loads (they could run code); resume from another checkpoint"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"checkpoint '{path}': cannot read {rng_file} ({e})") from None
    try:
        set_rng_states(states, model)
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint '{path}': {rng_file} is not this run's RNG states ({e}); resume from "
            "another checkpoint"
        ) from None


def open_reader(path: str, recorded) -> CountingReader:
    """A reader of the checkpoint at `path`, its `.metadata` read and checked: one naming
    anything but DCP's records, or a file outside `recorded` (meta.json's records; None: a
    format-1 checkpoint, which has none), is refused in one line (checkpoint_metadata.py)."""
    try:
        return CountingReader(path, recorded)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError) as e:
        raise CheckpointError(
            f"checkpoint '{path}': {e} (a resume never runs code from a checkpoint); resume "
            "from another one with checkpoint.resume=PATH"
        ) from None


def read_blocks(path: str, targets, recorded=None) -> int:
    """Read `targets` from `path` (resharding); returns the bytes this rank read."""
    reader = open_reader(path, recorded)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                targets.scalars,
                storage_reader=reader,
                planner=BlockLoadPlanner(targets.blocks),
                no_dist=not distributed(),
            )
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise corrupt(path, e) from None
    return reader.bytes_read


def corrupt(path: str, e: BaseException) -> CheckpointError:
    e = first_failure(e)  # DCP's CheckpointException: the error of the first rank it lists
    if isinstance(e, Refused):
        return CheckpointError(
            f"checkpoint '{path}': {e} (a resume never runs code from a checkpoint); resume "
            "from another one with checkpoint.resume=PATH"
        )
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(
        f"checkpoint '{path}' is corrupt or does not match the model ({first_line[:200]}); "
        "resume from another one with checkpoint.resume=PATH"
    )


def load_tensors(path: str, tensors: dict, recorded=None) -> None:
    """Whole tensors by logical name from `path` (inference, export): read as a resume reads."""
    reader = open_reader(path, recorded)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=reader, no_dist=not distributed())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise corrupt(path, e) from None
