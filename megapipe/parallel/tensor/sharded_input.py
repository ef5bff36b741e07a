"""A sequence-parallel column linear keeps only this rank's sequence shard of its input for
backward and gathers it again there (Korthikanti et al. 2022, §4.2.2: the all-gathered input
Y is not stored; each rank keeps its Yˢ and backward repeats the all-gather for the weight
grad, as Megatron-LM's linear with sequence parallelism does).

Under SP the input a column linear saves is the all-gathered (B, T, in) tensor, tp times what
the rank's norm made. Keeping the shard saves (tp − 1)/tp of it for every column linear of a
layer (qkv and fc1, latent attention's q_b and kv_b, the shared experts' fc1) at the price of
one more all-gather of it per microbatch in backward. The values gathered again are the ones
the forward gathered (the same shards, in the same order), so forward and backward are
bitwise as if the gathered tensor had been kept. The tp ring (parallel.tp_overlap, overlap.py)
keeps the shard too and gathers it again before its backward ring; an FP8 linear on the ring
keeps its own piece of what the ring sends (parallel/fp8_overlap.py: under tensorwise its
one-byte payloads) and gathers that again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megapipe.distributed import collectives as C
from megapipe.parallel.tensor.mappings import SEQ_DIM
from megapipe.parallel.tensor.sharding import TPInfo


class ShardedInput:
    """What a column linear under SP saves of its gathered input (`pack`: this rank's
    sequence shard, a copy, so the gathered tensor is freed) and what its backward reads
    (`unpack`: the shards all-gathered again over tp, launched at once and waited for by the
    function returned, after the input grad's matmul)."""

    def __init__(self, tp: TPInfo) -> None:
        self.tp = tp

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[SEQ_DIM] // self.tp.size
        return x.narrow(SEQ_DIM, self.tp.rank * n, n).clone()

    def unpack(self, shard: torch.Tensor) -> Callable[[], torch.Tensor]:
        return C.all_gather_start(shard, SEQ_DIM, self.tp.group)


def sharded_input(tp: TPInfo) -> ShardedInput | None:
    """The ShardedInput of a column linear on `tp`: under SP (the plain path's autograd
    functions pack the gathered input, the ring's keeps the shard it holds), else None (the
    input is kept as it is)."""
    return ShardedInput(tp) if tp.sp else None
