"""Each rank's record of what it is doing, in `run.dir/progress/rank<R>`, for naming a stuck rank.

PyTorch's Flight Recorder keeps per-rank records of the last collectives so that a hang can be
located after the fact; Megatron's straggler detection compares ranks' timings. Here every rank
keeps one small fixed-size record in a memory-mapped file, written in place: an update is a
`struct.pack_into` into the mapping (no system call), so it costs about a microsecond
(docs/benchmarks/2026-11-26-progress-record-cpu.md). The record holds, written once, the rank, its
mesh coordinates, host, pid, `parallel.timeout_s` and a tag of the launch; and, updated as the rank
runs, the step, what it is doing (a pipeline action `F`/`B`/`W`/`BW` with its microbatch, the step
core's phases, a save), and what it waits for, if anything (`recv F` from a peer, an all-reduce over
a group). A thread of the rank writes a heartbeat into it once a second (and flushes the mapping, so
a reader on another node of a shared file system sees it): the thread stops when the process dies or
is frozen, not when it waits or computes, which is what tells a stopped rank from a slow or waiting
one (distributed/diagnosis.py reads the records).

The recorder rides on the mesh (`ParallelMesh.progress`), which is passed explicitly to
everything that communicates; `NO_PROGRESS` records nothing (one process, tests).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

MAGIC = b"MPPROG1\0"
BEAT_S = 1.0  # heartbeat period
# written once: magic, rank, world, pp, dp, cp, tp, pid, started, timeout_s, host, launch tag
HEADER = struct.Struct("<8s 7i d d 64s 64s")
BEAT = struct.Struct("<d")  # time.time() of the last heartbeat
DOING = struct.Struct("<d q 16s i i")  # since, step, what, microbatch, chunk
WAIT = struct.Struct("<d 16s i i 16s")  # since, what, peer rank, microbatch, group
EXIT = struct.Struct("<d")  # when the record was closed
AT_BEAT = 256
AT_DOING = AT_BEAT + BEAT.size
AT_WAIT = AT_DOING + DOING.size
AT_STATE = AT_WAIT + WAIT.size  # one byte: WORKING or WAITING
AT_EXIT = AT_STATE + 8  # 0.0 until the record is closed
SIZE = 512
WORKING, WAITING = 0, 1
assert HEADER.size <= AT_BEAT and AT_EXIT + EXIT.size <= SIZE


def launch_tag() -> str:
    """What tells this launch's records from an earlier one's in the same run.dir: torchrun's
    run id and restart count and the rendezvous address every rank of a launch shares."""
    e = os.environ
    return ":".join(
        e.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    )


def record_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "progress", f"rank{rank}")


class Progress:
    """This rank's record; `open` creates the file and starts the heartbeat, `close` marks it
    exited. Every update between is a write into the mapping."""

    def __init__(self, rank: int, world: int, coords: dict[str, int], timeout_s: float) -> None:
        self.rank, self.world, self.coords, self.timeout_s = rank, world, coords, timeout_s
        self.mm: mmap.mmap | None = None
        self._step, self._names, self._stop = -1, {}, threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, run_dir: str) -> None:
        """Create `run_dir/progress/rank<R>`, write the header, start the heartbeat."""
        path = record_path(run_dir, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # a new file renamed into place: a process still mapping the old one keeps its own
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self.mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        c, now = self.coords, time.time()
        HEADER.pack_into(
            self.mm, 0, MAGIC, self.rank, self.world, c["pp"], c["dp"], c["cp"], c["tp"],
            os.getpid(), now, self.timeout_s, _b(socket.gethostname()), _b(launch_tag()),
        )  # fmt: skip
        BEAT.pack_into(self.mm, AT_BEAT, now)
        self.doing("start")
        os.replace(tmp, path)
        self._thread = threading.Thread(target=self._beat, name="megapipe-progress", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        mm = self.mm
        while not self._stop.wait(BEAT_S):
            BEAT.pack_into(mm, AT_BEAT, time.time())
            mm.flush()  # once a second: readers on other nodes of a shared file system

    def _name(self, text: str) -> bytes:
        """`text` as bytes, encoded once per distinct text."""
        b = self._names.get(text)
        if b is None:
            b = self._names[text] = _b(text)
        return b

    def step(self, step: int) -> None:
        """Train step `step` begins (1: the first, as metrics.jsonl numbers them)."""
        self._step = step
        self.doing("step")

    def doing(self, what: str, microbatch: int = -1, chunk: int = -1) -> None:
        """This rank now works at `what` (a pipeline action, a phase of the step)."""
        if self.mm is not None:
            DOING.pack_into(
                self.mm, AT_DOING, time.time(), self._step, self._name(what), microbatch, chunk
            )
            self.mm[AT_STATE] = WORKING

    def wait(self, what: str, peer: int = -1, microbatch: int = -1, group: str = "") -> None:
        """This rank now waits for `what` (`recv F` from rank `peer`, `all_reduce` over
        `group`); `waited` ends the wait."""
        if self.mm is not None:
            WAIT.pack_into(
                self.mm, AT_WAIT, time.time(), self._name(what), peer, microbatch, self._name(group)
            )
            self.mm[AT_STATE] = WAITING

    def waited(self) -> None:
        if self.mm is not None:
            self.mm[AT_STATE] = WORKING

    def close(self) -> None:
        """Mark the record exited (where it was stays) and stop the heartbeat; the file stays
        for diagnose.py."""
        if self.mm is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        EXIT.pack_into(self.mm, AT_EXIT, time.time())
        self.mm.flush()
        self.mm.close()
        self.mm = None


class _NoProgress(Progress):
    """Records nothing: one process, or a mesh built without a run."""

    def __init__(self) -> None:
        super().__init__(0, 1, {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, 0.0)

    def open(self, run_dir: str) -> None:
        return None


NO_PROGRESS = _NoProgress()


@dataclass(frozen=True)
class Record:
    """One rank's record as read back from its file."""

    rank: int
    world: int
    coords: dict[str, int]
    pid: int
    started: float
    timeout_s: float
    host: str
    tag: str
    beat: float  # last heartbeat
    step: int
    doing: str
    doing_since: float
    microbatch: int
    chunk: int
    state: int  # WORKING, WAITING
    wait: str
    wait_since: float
    peer: int
    wait_microbatch: int
    group: str
    exited: float  # when the record was closed; 0.0: still open

    def where(self) -> str:
        """What the rank last did: `at recv F mb 5 from rank 0, step 3`, `in F mb 2, step 3`."""
        if self.state == WAITING:
            text = "at " + _label(self.wait, self.wait_microbatch, -1)
            if self.peer >= 0:
                word = {"recv": "from", "send": "to"}.get(self.wait.split(" ")[0], "with")
                text += f" {word} rank {self.peer}"
            text += f" over {self.group}" if self.group else ""
        else:
            text = "in " + _label(self.doing, self.microbatch, self.chunk)
        return text + (f", step {self.step}" if self.step >= 0 else "")

    def coords_text(self) -> str:
        return " ".join(f"{a}={v}" for a, v in self.coords.items())


def _label(what: str, microbatch: int, chunk: int) -> str:
    return (
        what
        + (f" mb {microbatch}" if microbatch >= 0 else "")
        + (f" chunk {chunk}" if chunk >= 0 else "")
    )


def _b(text: str) -> bytes:
    return text.encode("utf-8", "replace")


def _s(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def read_record(path: str) -> Record | None:
    """The record in `path`; None if it is missing, short or not a record."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SIZE)
    except OSError:
        return None
    if len(raw) < SIZE or raw[:8] != MAGIC:
        return None
    _, rank, world, pp, dp, cp, tp, pid, started, timeout_s, host, tag = HEADER.unpack_from(raw)
    (beat,) = BEAT.unpack_from(raw, AT_BEAT)
    since, step, doing, mb, chunk = DOING.unpack_from(raw, AT_DOING)
    wait_since, wait, peer, wait_mb, group = WAIT.unpack_from(raw, AT_WAIT)
    (exited,) = EXIT.unpack_from(raw, AT_EXIT)
    return Record(
        rank, world, {"pp": pp, "dp": dp, "cp": cp, "tp": tp}, pid, started, timeout_s,
        _s(host), _s(tag), beat, step, _s(doing), since, mb, chunk, raw[AT_STATE], _s(wait),
        wait_since, peer, wait_mb, _s(group), exited,
    )  # fmt: skip


def read_records(run_dir: str) -> dict[int, Record]:
    """{rank: record} of every `rank<R>` file under `run_dir/progress`."""
    folder = os.path.join(run_dir, "progress")
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith("rank") and name[4:].isdigit():
            record = read_record(os.path.join(folder, name))
            if record is not None:
                out[record.rank] = record
    return dict(sorted(out.items()))
