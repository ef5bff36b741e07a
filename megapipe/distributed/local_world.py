"""A gloo world of spawned processes on this machine: `spawn(world, fn, *args)` runs fn on each
rank and returns every rank's result. Used where a command needs a few local ranks without a
launcher (tools/plot_timeline.py, the benchmarks' harness) and for a free rendezvous port
(study/runner.py's local points)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on loopback now, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, opts: tuple, fn, args) -> None:
    threads, timeout_s = opts
    torch.set_num_threads(threads)  # the ranks share this machine's cores
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    torch.save(fn(*args), os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn(world: int, fn: Callable, *args, threads: int = 1, timeout_s: float = 300) -> list:
    """fn(*args) on each of `world` spawned gloo ranks of `threads` torch threads (WORLD_SIZE
    and RANK set as torchrun sets them); the per-rank results, rank 0 first. `fn` must be a
    module-level function (the spawned processes import it); `timeout_s` is the group's."""
    opts = (threads, timeout_s)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, free_port(), out, opts, fn, args), nprocs=world)
        # our own ranks wrote these files: any picklable result, not only tensors and plain data
        files = [os.path.join(out, f"rank{r}.pt") for r in range(world)]
        return [torch.load(f, weights_only=False) for f in files]
