"""The raw collectives under the tp mappings, with fallbacks where a backend lacks one.

Every function takes its process group explicitly. `dist.all_gather` (list form) exists on all
backends; reduce-scatter is missing from gloo before torch 2.12, so it falls back to all-reduce +
slice (same result, tp× the traffic). `all_to_all` (even splits, list form) runs on gloo as on
NCCL (checked on torch 2.13). `COUNTER`, when set, records every call's payload: the
benchmarks and tests count bytes per layer with it (docs/benchmarks/2026-11-26-tp-dp-cpu.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_NATIVE_REDUCE_SCATTER: dict[str, bool] = {}  # backend name -> reduce_scatter works
COUNTER: list | None = None  # when a list, (op, bytes) is appended for every call


def count(op: str, t: torch.Tensor) -> None:
    if COUNTER is not None:
        COUNTER.append((op, t.numel() * t.element_size()))


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place sum (or `op`) of `x` over `group`; returns `x`."""
    count("all_reduce", x)
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenation along `dim` of every rank's `x` (ranks in group order)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    out = torch.cat(parts, dim=dim)
    count("all_gather", out)
    return out


def all_gather_start(x: torch.Tensor, dim: int, group) -> Callable[[], torch.Tensor]:
    """all_gather launched now, asynchronously; the function returned waits for it and gives
    the concatenation, so the caller computes in between (Megatron-LM's SP linear gathers its
    input again beside the input grad's matmul)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, x, group=group, async_op=True)

    def gathered() -> torch.Tensor:
        work.wait()
        out = torch.cat(parts, dim=dim)
        count("all_gather", out)
        return out

    return gathered


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Chunk r of `x` along `scatter_dim` goes to rank r; the chunks received, in rank order,
    are concatenated along `gather_dim` (Ulysses' exchange: sequence shards <-> head shards)."""
    size = dist.get_world_size(group)
    send = [c.contiguous() for c in x.chunk(size, dim=scatter_dim)]
    recv = [torch.empty_like(c) for c in send]
    count("all_to_all", x)
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=gather_dim)


def reduce_scatter(x: torch.Tensor, dim: int, group, fallback: bool = False) -> torch.Tensor:
    """This rank's chunk along `dim` of the sum of every rank's `x`.

    Uses all-reduce + slice on backends without reduce_scatter (or with `fallback`).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    count("reduce_scatter", x)
    backend = str(dist.get_backend(group))
    if not fallback and _NATIVE_REDUCE_SCATTER.get(backend, True):
        chunks = [c.contiguous() for c in x.chunk(size, dim=dim)]
        out = torch.empty_like(chunks[rank])
        try:
            dist.reduce_scatter(out, chunks, group=group)
            _NATIVE_REDUCE_SCATTER[backend] = True
            return out
        except RuntimeError:  # every rank of the group fails alike, so nobody is left waiting
            _NATIVE_REDUCE_SCATTER[backend] = False
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(size, dim=dim)[rank].contiguous()
