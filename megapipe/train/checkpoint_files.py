"""The files of a checkpoint: what each rank wrote, proved on disk, recorded and verified.

A save is complete only when every rank's files are on disk: each rank fsyncs what it wrote and
reports (name, bytes, CRC-32 of the bytes read back); rank 0 checks it can see every reported
file at its size, then records them all in `meta.json`, written last. A resume re-reads them
(split over the ranks) and compares sizes and checksums, so a truncated file or flipped bytes
are found before any tensor is trusted. At start-up every rank proves it sees the same
checkpoint directory (node-local disks would scatter one checkpoint over several machines).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib

import torch
import torch.distributed as dist

from megapipe.distributed.launch import barrier, distributed, rank
from megapipe.train.checkpoint_faults import Failure, as_failure

BLOCK = 8 << 20  # bytes read at a time for a checksum
STATE_FILE = "train_state.json"  # the loop's own state (train/spikes.py), plain JSON data


class CheckpointError(RuntimeError):
    """A missing, corrupt or incompatible checkpoint; the message is one line."""


class SaveFailed(CheckpointError):
    """A checkpoint that could not be written (train/checkpoint_faults.py); one line."""


class FilesError(RuntimeError):
    """A problem with the checkpoint directory or its files, in one line."""


def record(path: str) -> dict:
    """{'bytes', 'crc32'} of the file at `path`, fsynced first so the bytes read are on disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": crc}


def own_files(directory: str, me: int) -> list[str]:
    """The files rank `me` wrote in `directory`: its DCP shard files and its RNG states."""
    names = sorted(os.listdir(directory))
    return [n for n in names if n.startswith(f"__{me}_") or n == f"rng_rank{me}.pt"]


def gather_records(
    directory: str, failed: OSError | None = None, nbytes: int = 0
) -> tuple[dict[str, dict], list[Failure], int]:
    """Every rank's {file: record} of what it wrote, on every rank (rank 0 adds DCP's
    .metadata, which the coordinator writes); with them the failures of the ranks whose
    writes (`failed`) or records raised an OSError, and the sum of the ranks' `nbytes`."""
    mine: dict[str, dict] = {}
    if failed is None:
        try:
            mine = {n: record(os.path.join(directory, n)) for n in own_files(directory, rank())}
            if rank() == 0 and os.path.exists(os.path.join(directory, ".metadata")):
                mine[".metadata"] = record(os.path.join(directory, ".metadata"))
        except OSError as e:
            failed = e
    parts = [(mine, as_failure(rank(), failed), nbytes)]
    if distributed():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (mine, as_failure(rank(), failed), nbytes))
    files = {name: rec for part, _, _ in parts for name, rec in part.items()}
    return files, [f for _, f, _ in parts if f is not None], sum(n for _, _, n in parts)


def missing(directory: str, files: dict[str, dict]) -> str | None:
    """The first recorded file this process cannot see at its recorded size, or None."""
    for name, rec in sorted(files.items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            return f"{name} is missing"
        if os.path.getsize(path) != rec["bytes"]:
            return f"{name} has {os.path.getsize(path)} bytes, {rec['bytes']} were written"
    return None


def problem(directory: str, files: dict[str, dict], part: int = 0, parts: int = 1) -> str | None:
    """What is wrong with this process's share (every `parts`-th file from `part`) of the
    recorded `files`: missing, another size, another checksum; None if intact."""
    names = sorted(files)[part::parts]
    share = {n: files[n] for n in names}
    found = missing(directory, share)
    if found:
        return found
    for name in names:
        if record(os.path.join(directory, name))["crc32"] != files[name]["crc32"]:
            return f"{name} does not match its checksum (corrupted on disk)"
    return None


def agreed_problem(directory: str, files: dict[str, dict]) -> str | None:
    """`problem` over all files, the reading split over the ranks; the same answer on all."""
    if not distributed():
        return problem(directory, files)
    world = dist.get_world_size()
    found = [None] * world
    dist.all_gather_object(found, problem(directory, files, rank(), world))
    return next((f for f in found if f), None)


def check_shared(root: str) -> None:
    """Every rank sees the same `root`: each writes a marker named by a nonce from rank 0, and
    each counts the markers; all fail alike (one line) unless every rank sees all of them."""
    if not distributed():
        return
    world = dist.get_world_size()
    nonce = [uuid.uuid4().hex if rank() == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    marks = os.path.join(root, f".ranks-{nonce[0]}")
    os.makedirs(marks, exist_ok=True)
    with open(os.path.join(marks, str(rank())), "w") as f:
        f.write(str(rank()))
    barrier()
    seen = torch.tensor([len(os.listdir(marks))], dtype=torch.int64)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    os.remove(os.path.join(marks, str(rank())))
    barrier()
    shutil.rmtree(marks, ignore_errors=True)  # each machine's copy, if they differ
    if int(seen) != world:
        raise FilesError(
            f"checkpoint.dir '{root}' is not the same directory on every rank (a rank sees "
            f"{int(seen)} of {world} markers); checkpoints need a filesystem shared by all "
            "nodes: set checkpoint.dir to a path on one"
        )


def write_state(directory: str, state: dict | None, files: dict[str, dict]) -> None:
    """Rank 0: the loop's `state` (the same on every rank; None: nothing) as `STATE_FILE` in
    `directory`, recorded in `files` for meta.json. JSON: a resume reads it as data, not code."""
    if state is None:
        return
    path = os.path.join(directory, STATE_FILE)
    with open(path, "w") as f:
        json.dump(state, f)
    files[STATE_FILE] = record(path)


def read_state(directory: str) -> dict | None:
    """The loop's state saved with the checkpoint in `directory` (verified with its other
    files before a resume), or None if it has none."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
