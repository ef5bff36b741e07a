"""Launch: the default process group, the mesh over it, rank 0, peer-lost detection, shutdown.

Under torchrun (or any launcher that sets WORLD_SIZE) the world size is checked against the mesh
before any collective runs; each group waits at most `parallel.timeout_s` for a peer, so a dead
or frozen rank brings the others down with one line instead of a hang. Under torchrun's agent
store every start of the workers (`--max-restarts`) gets a store namespace of its own
(distributed/rendezvous.py), so a restarted group never reads a dead one's addresses. `shutdown`
ends the groups before the process exits, so no rank leaves with communication threads running.
"""

from __future__ import annotations

import datetime
import os
import re

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.distributed.flight import ensure_buffer
from megapipe.distributed.mesh import MeshSizes, ParallelMesh, check_world_size, coords
from megapipe.distributed.progress import Progress
from megapipe.distributed.rendezvous import agent_store_in_use, attempt_store

PEER_LOST = (  # gloo (a pair closed by a timeout on either side); NCCL: DistError
    "Timed out",
    "Connection reset",
    "Connection closed",
    "timeout caused pair closure",
)


def init_distributed(cfg: Config) -> ParallelMesh | None:
    """Under torchrun: check the world size, init the default group, build the mesh.

    One process without torchrun and a 1-rank mesh: None (the plain single-process path).
    """
    sizes, timeout_s = MeshSizes.of(cfg), cfg.parallel.timeout_s
    if dist.is_available() and dist.is_initialized():  # e.g. the test workers
        check_world_size(sizes, dist.get_world_size())
        return ParallelMesh(sizes, "cuda" if torch.cuda.is_available() else "cpu", timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(sizes, world)
    if world == 1:
        return None
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        ensure_buffer()  # every multi-rank run records its collectives (distributed/flight.py)
        timeout = datetime.timedelta(seconds=timeout_s)  # a dead rank: error, not a hang
        backend = "nccl" if cuda else "gloo"
        if agent_store_in_use():  # torchrun's store outlives a restart: a namespace per start
            rank = int(os.environ["RANK"])
            store = attempt_store(rank, world, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timeout)  # fmt: skip
        else:
            dist.init_process_group(backend, timeout=timeout)
    progress = Progress(dist.get_rank(), world, coords(dist.get_rank(), sizes), timeout_s)
    return ParallelMesh(sizes, "cuda" if cuda else "cpu", timeout_s, progress)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def launched_rank() -> int:
    """This process's rank as the launcher set it (RANK; 0 without one), group or no group yet."""
    return int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    """The rank that writes run-level files (config, metrics, meta.json)."""
    return rank() == 0


def barrier() -> None:
    if distributed():
        dist.barrier()


def peer_lost(e: RuntimeError) -> str | None:
    """The cause, in one line, when a collective or p2p wait failed on a dead or stuck peer."""
    line = (str(e).strip() or type(e).__name__).splitlines()[0]
    if not (isinstance(e, dist.DistError) or any(w in line for w in PEER_LOST)):
        return None
    return re.sub(r"^\[[^\]]*\] ", "", line).split(". ")[0]  # gloo prefixes its source path


def shutdown(wait: bool = True) -> None:
    """Destroy the process groups, if any; with `wait`, after a barrier on the default group.

    The barrier (bounded by the group's timeout, parallel.timeout_s) is where the ranks agree they
    are done: gloo runs it only after this rank's earlier work on the group, and the pipeline's
    sends were already waited at the end of each step (pipeline/p2p.StageLinks.flush). Exiting
    with a live group lets the interpreter tear its threads down in any order, which can abort
    the process ("terminate called without an active exception") after a successful run.
    After an error pass wait=False: a peer may be dead or still busy, so a barrier could only
    hold this rank until the timeout. A failed barrier raises, after the groups are destroyed.
    """
    if not distributed():
        return
    try:
        if wait and dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])  # no guessing of the device
        elif wait:
            dist.barrier()
    finally:
        dist.destroy_process_group()
