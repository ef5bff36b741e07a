"""One live run per run directory: a lock file holding the owner's host and pid.

Rank 0 takes `run.dir/.lock` before training and removes it at the end. A lock whose process is
gone (a killed run) is stale and taken over; a live one makes the second run fail with one line.
A lock from another host cannot be checked from here, so it counts as live: the message says to
delete the file if that run is gone.
"""

from __future__ import annotations

import os
import socket

LOCK_FILE = ".lock"


class RunDirBusy(RuntimeError):
    """Another live run holds the run directory; the message is one line."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _owner(path: str) -> tuple[str, int] | None:
    """(host, pid) written in the lock file, or None when it is unreadable."""
    try:
        with open(path) as f:
            host, pid = f.read().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def acquire(run_dir: str) -> str:
    """Take the lock of `run_dir` for this process; returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    mine = f"{socket.gethostname()} {os.getpid()}\n"
    try:  # O_EXCL: of two runs starting at once, one creates the file
        with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY), "w") as f:
            f.write(mine)
        return path
    except FileExistsError:
        pass
    owner = _owner(path)
    if owner is not None and owner[1] != os.getpid():
        host, pid = owner
        here = host == socket.gethostname()
        if not here or _alive(pid):
            raise RunDirBusy(
                f"run.dir '{run_dir}' is in use by the run of pid {pid} on {host}; wait for it "
                f"to finish or set another run.dir"
                + ("" if here else f" (if it is gone, delete {path})")
            )
    tmp = f"{path}.{os.getpid()}"  # a stale lock: take it over
    with open(tmp, "w") as f:
        f.write(mine)
    os.replace(tmp, path)
    return path


def release(path: str) -> None:
    """Remove the lock if this process still owns it."""
    if _owner(path) == (socket.gethostname(), os.getpid()):
        os.remove(path)
