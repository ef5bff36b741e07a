"""Saves under faults: a checkpoint that cannot be written (a full disk, a quota, an I/O error).

A failed write must not cost what is already saved nor end in a traceback. Every phase of a
save that writes (the tensors through DCP, each rank's RNG file, rank 0's config and meta.json)
runs through `written`, which turns an OSError (DCP wraps its writers' errors in a
CheckpointException that every rank receives) into a value instead of an exception; the ranks
then exchange what failed where (train/checkpoint_files.gather_records) and rank 0's verdict,
so all of them stop, or all of them train on, at the same step. The half-written `step_N.tmp`
is removed (resume=auto never lists a `.tmp`), the previous checkpoint was never touched (older
ones are pruned only after a new one is in place), and the line names the directory, the bytes
the checkpoint needs (the tensors being saved, summed over the ranks) and the bytes free there.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megapipe.distributed.launch import distributed

FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left; disk quota exceeded
RECORD_BYTES = 2048  # per tensor: its torch.save zip records in a .distcp and its DCP record
Failure = tuple[int, int | None, str]  # (rank, errno, what the OS said)


def first_failure(e: BaseException) -> BaseException:
    """The error a DCP CheckpointException wraps (its first rank's), else `e` itself."""
    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e


def written(fn, *args: Any, **kwargs: Any) -> OSError | None:
    """Run the writing call `fn`; the OSError it (or, under DCP, any rank's writer) raised, or
    None. Other errors propagate: they are bugs, not faults of the disk."""
    try:
        fn(*args, **kwargs)
    except OSError as e:
        return e
    except CheckpointException as e:
        found = [as_os_error(exc) for exc, _ in e.failures.values()]
        found = [exc for exc in found if exc is not None]
        if not found:
            raise
        return found[0]
    return None


# torch's zip writer (torch.save into DCP's file streams) checks its position after each record;
# a write the OS cut short, which for a regular file means the device or the quota is full
# (POSIX write(2)), surfaces as this RuntimeError with no errno instead of the OSError
SHORT_WRITE = "unexpected pos"


def as_os_error(exc: BaseException) -> OSError | None:
    """A writer's error as the OSError of the disk's fault, or None for any other error."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError) and SHORT_WRITE in str(exc):
        return OSError(errno.ENOSPC, "No space left on device (a write was cut short)")
    return None


def save_file(obj: Any, path: str) -> None:
    """torch.save `obj` to `path` through Python's file API, so a full disk raises OSError
    (torch.save to a path writes from C++ and raises a RuntimeError that names no errno)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def payload_bytes(obj: Any) -> int:
    """What a save of `obj` writes, estimated: the bytes of its tensors (dicts, lists,
    ShardedTensors' local shards) plus RECORD_BYTES for each."""
    if isinstance(obj, torch.Tensor) and not hasattr(obj, "local_shards"):
        return obj.numel() * obj.element_size() + RECORD_BYTES
    if hasattr(obj, "local_shards"):
        return sum(payload_bytes(s.tensor) for s in obj.local_shards())
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def as_failure(rank: int, e: OSError | None) -> Failure | None:
    return None if e is None else (rank, e.errno, e.strerror or str(e))


def given_up(
    tmp: str, final: str, failures: list[Failure], needed: int, previous: str | None
) -> str:
    """Rank 0: remove the half-written `tmp` and say in one line why `final` was not saved
    (`previous`: the newest checkpoint, untouched)."""
    shutil.rmtree(tmp, ignore_errors=True)
    root = os.path.dirname(final)
    rank, code, said = failures[0]
    said = (f"rank {rank}: " if distributed() else "") + said[:1].lower() + said[1:]
    if code in FULL:
        try:
            free = f"{shutil.disk_usage(root).free:,}"
        except OSError:
            free = "unknown"
        need = f"needs about {needed:,} bytes, " if needed else ""
        said += f" ({need}{free} bytes free in '{root}'); free space or set checkpoint.dir "
        said += "to a larger disk"
    else:
        said += "; check that checkpoint.dir is writable"
    kept = f"; {previous} is intact" if previous else ""
    return f"checkpoint '{final}' could not be written: {said}{kept}"


def rank0_says(line: str | None) -> str | None:
    """Rank 0's `line` on every rank (a barrier as well)."""
    if not distributed():
        return line
    shared = [line]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
