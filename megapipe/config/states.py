"""Bytes of model state per parameter: weights, grads and optimizer state, by train.params_dtype
and parallel.zero, over the d = dp·cp replicas a parameter lives on (the one memory model's
state half; config/memory.py holds the activations').

ZeRO (Rajbhandari et al. 2020, §5.1-5.3) shards over the d replicas the optimizer state
(zero=1, P_os: Megatron's distributed optimizer), also the reduced grads (zero=2, P_os+g), also
the weights (zero=3, P_os+g+p, as FSDP / torchtitan's FSDP2). Per parameter:

  params_dtype   weight  grad (main grad)  optimizer                       zero0  zero1 (d=4)
  float32        4       4                 moments 8                        16     4+4+8/d  10
  bfloat16       2       4 (float32)       main param 4 + moments 8 = 12    18     2+4+12/d  9

(Megatron-Core's mixed-precision layout: bf16 weights, float32 main grads accumulated in place,
float32 main params and AdamW moments in the distributed optimizer, written back to bf16 after
each step: 6 + 12/d.) zero=2 divides the grad too, zero=3 the weight as well: bf16 at d=4 gives
2 + 16/4 = 6 and 18/4 = 4.5. With d = 1 there is nothing to shard: any zero level holds the
whole state, as zero=0 does. A sharded piece is the rank's shard of each flat bucket, padded to a
multiple of d (ceil(n/d) per rank; the padding, < d elements per bucket, is left out).

zero=3 also holds, while a block runs, that block's full (gathered) weights, and the next
block's, prefetched while it runs (parallel/data: one block gathered plus the next): twice the
rank's largest block in the weights' dtype (`gathered_bytes`). Grads of a bucket in flight
before their reduce-scatter, at zero>=2, are transient and left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from megapipe.config.schema import Config

FLOAT32 = 4  # float32 elements: main grads, main params, AdamW moments, the residual stream
PARAM_BYTES = {"float32": 4, "bfloat16": 2}  # a weight, by train.params_dtype
GRAD_BYTES = FLOAT32  # grads (main grads under bf16 weights) are float32 whatever the weights
ADAM_BYTES = 2 * FLOAT32  # AdamW's exp_avg and exp_avg_sq
MAIN_PARAM_BYTES = FLOAT32  # the optimizer's float32 copy of a weight held in bf16
PREFETCHED_BLOCKS = 2  # zero=3: the block running and the next one, gathered ahead


@dataclass(frozen=True)
class StateLayout:
    """Bytes per parameter of each kind of state, and how many ways each is split."""

    weight: int  # the weight itself, in train.params_dtype
    grad: int
    optimizer: int  # AdamW moments, plus the float32 main param under bf16 weights
    d: int  # the replicas (dp·cp) the sharded kinds split over
    zero: int  # the ZeRO level in effect: 0 where d = 1 (nothing to shard)

    @property
    def weight_shards(self) -> int:
        return self.d if self.zero >= 3 else 1

    @property
    def grad_shards(self) -> int:
        return self.d if self.zero >= 2 else 1

    @property
    def optimizer_shards(self) -> int:
        return self.d if self.zero >= 1 else 1

    @property
    def per_param(self) -> float:
        """Weights + grads + optimizer bytes per parameter (the issue's targets)."""
        return (
            self.weight / self.weight_shards
            + self.grad / self.grad_shards
            + self.optimizer / self.optimizer_shards
        )

    def text(self) -> str:
        """As the dry run prints it: '16 B/param', '4 + 4 + 8/d B/param, d=2', '18/d ...'."""
        terms = [(self.weight, self.weight_shards), (self.grad, self.grad_shards)]
        terms.append((self.optimizer, self.optimizer_shards))
        if self.zero == 0:
            return f"{sum(b for b, _ in terms)} B/param"
        whole = sum(b for b, n in terms if n == 1)
        split = sum(b for b, n in terms if n > 1)
        head = f"{whole} + " if whole else ""
        return f"{head}{split}/d B/param, d={self.d}"


def layout(params_dtype: str, zero: int, d: int) -> StateLayout:
    """The state layout of `params_dtype` weights at ZeRO level `zero` over `d` replicas."""
    weight = PARAM_BYTES[params_dtype]
    optimizer = ADAM_BYTES + (MAIN_PARAM_BYTES if weight != FLOAT32 else 0)
    return StateLayout(weight, GRAD_BYTES, optimizer, d, zero if d > 1 else 0)


def replicas(cfg: Config) -> int:
    """The ranks a parameter's state can be sharded over: dp × cp (d)."""
    return cfg.parallel.dp * cfg.parallel.cp


def state_layout(cfg: Config) -> StateLayout:
    return layout(cfg.train.params_dtype, cfg.parallel.zero, replicas(cfg))


def _bytes(n_params: float, per: int, shards: int) -> float:
    return per * (math.ceil(n_params / shards) if shards > 1 else n_params)


def weights_bytes(n_params: float, cfg: Config) -> float:
    """The weights a rank holding `n_params` keeps between steps (its shard under zero=3)."""
    s = state_layout(cfg)
    return _bytes(n_params, s.weight, s.weight_shards)


def grads_bytes(n_params: float, cfg: Config) -> float:
    """The (main) grads kept over the step: whole, or the reduced shard under zero>=2."""
    s = state_layout(cfg)
    return _bytes(n_params, s.grad, s.grad_shards)


def optimizer_bytes(n_params: float, cfg: Config) -> float:
    """AdamW's state (and the float32 main params under bf16 weights), whole or 1/d."""
    s = state_layout(cfg)
    return _bytes(n_params, s.optimizer, s.optimizer_shards)


def gathered_bytes(block_params: Iterable[int], cfg: Config) -> float:
    """zero=3's working set: the largest of the rank's blocks (`block_params`: each block's
    parameters on this tp rank), gathered whole, times PREFETCHED_BLOCKS; 0 below zero=3."""
    s = state_layout(cfg)
    if s.weight_shards == 1:
        return 0.0
    return PREFETCHED_BLOCKS * s.weight * max(block_params, default=0)


def state_bytes(n_params: float, cfg: Config, gathered: float = 0.0) -> float:
    """Weights, grads and optimizer state of a rank holding `n_params`, plus `gathered`."""
    return (
        weights_bytes(n_params, cfg)
        + grads_bytes(n_params, cfg)
        + optimizer_bytes(n_params, cfg)
        + gathered
    )
