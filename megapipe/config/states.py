"""Bytes of model state per parameter: weights, grads and optimizer state, by train.params_dtype
and parallel.zero, over the d = dp·cp replicas a parameter lives on (the one memory model's
state half; config/memory_terms.py holds the activations').

ZeRO (Rajbhandari et al. 2020, §5.1-5.3) shards over the d replicas the optimizer state
(zero=1, P_os: Megatron's distributed optimizer), also the reduced grads (zero=2, P_os+g), also
the weights (zero=3, P_os+g+p, as FSDP / torchtitan's FSDP2). Per parameter:

  params_dtype   weight  grad (main grad)  optimizer                       zero0  zero1 (d=4)
  float32        4       4                 moments 8                        16     4+4+8/d  10
  bfloat16       2       4 (float32)       main param 4 + moments 8 = 12    18     2+4+12/d  9

(train.main_grads_dtype=bfloat16 makes the main grad 2 bytes while it is whole, zero 0-1;
zero>=2's shards stay float32 sums. Megatron-Core's mixed-precision layout: bf16 weights,
float32 main grads accumulated in place,
float32 main params and AdamW moments in the distributed optimizer, written back to bf16 after
each step: 6 + 12/d.) zero=2 divides the grad too, zero=3 the weight as well: bf16 at d=4 gives
2 + 16/4 = 6 and 18/4 = 4.5. With d = 1 there is nothing to shard: any zero level holds the
whole state, as zero=0 does. A sharded piece is the rank's shard of each flat bucket, padded to a
multiple of d (ceil(n/d) per rank; the padding, < d elements per bucket, is left out).

HSDP (parallel.dp_shard = S < dp, distributed/mesh.py) shards over a shard group of S·cp
ranks, not dp·cp, and its dp/S replicas each hold the same shards: d = S·cp (`replicas`), and
a routed expert's d = S/ep · cp.

Under expert parallelism (parallel.ep > 1) a routed expert lives on its expert-replica group,
dp/ep · cp ranks (parallel/data/zero.py shards its buckets there), so its sharded kinds divide
by that instead of d (`expert_layout`; each function's `experts`: how many of the parameters
are routed experts', config/flops.held_expert_params).

These are the state *held over the optimizer step*. Around it the code holds more, at two
moments the memory plan (config/memory_plan.py) takes the larger of:

- while activations peak (a microbatch's forward done, its backward starting): every level's
  backward makes full-size local grads, 4 B/param, that the microbatches accumulate into (the
  reduction, all-reduce or reduce-scatter, runs once, in the last microbatch's backward:
  parallel/data/reducer.py, zero2.py), so the grads there are `local_grads_bytes`, not the
  shard (float32 grads once the rank's first backward made them: memory_plan.peak_inflight's
  with_grads; bf16 main grads are allocated with the model); zero=3 also holds gathered
  blocks (`gathered_bytes`): in forward the running block and the next one, prefetched
  (parallel/data/zero3.py `_pre_forward`), in backward the running block and the one before
  it; the largest such pair of consecutive blocks of a chunk, in the weights' dtype.
- while the last backward's reduction runs (`reduction_bytes`): the local grads (float32
  weights' go into the send buffer at zero>=1, under a float32 reduction at zero=1, dropped
  as copied: ShardedGradReducer._copy_in; the bucket being copied is held twice for that
  moment, `packing_bytes`, at most when the last bucket is; bf16 weights' main grads are kept),
  each bucket's send buffer in parallel.grad_reduce_dtype at zero>=1 (a copy, except where the
  main grads are sent in place: bf16 weights' all-reduce at zero=0, and their float32
  reduce-scatter at zero=1) and, zero>=1, its reduce-scattered shard; all held until the
  reducer's finish().

Reducing every microbatch (`reduces_per_microbatch`: zero=3, or grad_reduce=microbatch) no
full-size grads are kept: each bucket's local grads go when it is sent, into the rank's float32
shard sum; at both moments the grads are the shard plus the grads made and not yet sent and
the send buffers of at most IN_FLIGHT buckets (`block_grads_bytes` of config/grad_buckets
.grads_at_once, from the buckets as the reducer lays them out; while reducing, their received
1/d shards too).
zero=2 under bf16 weights keeps its whole main-grad buffer.

- after the optimizer step, at zero 1-2 (`step_gather_bytes`): the grads of the step (whole at
  zero=1, the shard at zero=2), and the weights' all-gather buffers, launched for every bucket
  at once (a second copy of the weights, plus the shard).

Left out: the bucket padding (< d elements per bucket), zero=3's third
block under full recompute (a layer's recomputed forward prefetches the next block while its
backward holds the previous one), what activations are still live at the reduction (the
head's kept grad buffers: 2.6% of the measured peak at zero=1 on dp2), a bucket's overshoot
past `replica_bucket_mb` (it closes after the parameter that fills it; a table larger than a
bucket is one) at the last backward's reduction, and, reducing every microbatch, the bucket
being copied beside its send buffer (at most a bucket).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megapipe.config.schema import Config

FLOAT32 = 4  # float32 elements: main grads, main params, AdamW moments, the residual stream
PARAM_BYTES = {"float32": 4, "bfloat16": 2}  # a weight, by train.params_dtype
GRAD_BYTES = FLOAT32  # grads (main grads under bf16 weights) are float32 whatever the weights
DEFAULT_BUCKET_MB = 25.0  # dp buckets' floor (parallel/data/reducer.py): DDP's bucket_cap_mb
# Parameters per bucket per replica above the floor: Megatron-Core's DistributedDataParallelConfig
# bucket_size default max(40M, 1M · dp) parameters ("larger DP sizes need larger buckets to
# ensure collectives do not become latency-bound"): a ring's 2(n−1) steps each pay the link's
# latency, so at dp = 512 a 25 MB bucket spends more on latency than on bytes.
BUCKET_PARAMS_PER_REPLICA = 1e6
# per-microbatch reductions in flight at once (parallel/data/zero2.py): FSDP2's reduce-scatter
# overlaps the next block's backward by one (its reduce_scatter_state holds the previous one)
IN_FLIGHT = 2
ADAM_BYTES = 2 * FLOAT32  # AdamW's exp_avg and exp_avg_sq
MAIN_PARAM_BYTES = FLOAT32  # the optimizer's float32 copy of a weight held in bf16


def compute_bytes(cfg) -> int:
    """Bytes of an element the matmuls read and write: bf16 under autocast, else float32."""
    return 2 if cfg.train.dtype == "bfloat16" else FLOAT32


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


@functools.lru_cache(maxsize=256)  # the planner's memory model asks it millions of times
def layout(params_dtype: str, zero: int, d: int, main_grads: str = "float32") -> StateLayout:
    """The state layout of `params_dtype` weights at ZeRO level `zero` over `d` replicas, bf16
    weights' main grads in `main_grads` (train.main_grads_dtype): held whole at zero 0-1; the
    shards zero>=2 keeps are float32 sums whatever the main grads."""
    weight = PARAM_BYTES[params_dtype]
    optimizer = ADAM_BYTES + (MAIN_PARAM_BYTES if weight != FLOAT32 else 0)
    level = zero if d > 1 else 0
    grad = PARAM_BYTES[main_grads] if weight != FLOAT32 and level <= 1 else GRAD_BYTES
    return StateLayout(weight, grad, optimizer, d, level)


def main_grad_bytes(cfg: Config) -> int:
    """Bytes of a full-size local (main) grad element: float32, or 2 under bf16 weights with
    train.main_grads_dtype=bfloat16 (parallel/precision.MainGrads)."""
    if cfg.train.params_dtype == "float32":
        return GRAD_BYTES
    return PARAM_BYTES[cfg.train.main_grads_dtype]


def widened_grads_bytes(n_params: float, cfg: Config, experts: float = 0) -> float:
    """bf16 main grads at zero 0-1: the float32 copy of the grads the optimizer steps, made
    for the step alone (precision.widened): whole at zero=0, the owned 1/d at zero=1;
    else 0."""
    s = state_layout(cfg)
    if main_grad_bytes(cfg) == GRAD_BYTES or s.zero >= 2:
        return 0.0
    e = expert_layout(cfg)
    shards = s.optimizer_shards
    return _bytes(n_params - experts, FLOAT32, shards) + (
        _bytes(experts, FLOAT32, e.optimizer_shards) if experts else 0
    )


def shard_dp(cfg: Config) -> int:
    """The dp ranks of one shard group: parallel.dp_shard (HSDP), dp where it is 0."""
    return cfg.parallel.dp_shard or cfg.parallel.dp


def replicas(cfg: Config) -> int:
    """The ranks a parameter's state can be sharded over (d): its shard group, dp × cp, or
    under HSDP dp_shard × cp."""
    return shard_dp(cfg) * cfg.parallel.cp


def shard_copies(cfg: Config) -> int:
    """HSDP's replicas of each shard, dp / dp_shard, which all-reduce it (1: none)."""
    return cfg.parallel.dp // shard_dp(cfg)


def expert_replicas(cfg: Config) -> int:
    """The ranks a routed expert's state is sharded over: its expert-replica group, dp/ep · cp
    (parallel/data/zero.py shards expert buckets there; Megatron-Core's expert data-parallel
    group), under HSDP the part of it in one shard group, dp_shard/ep · cp."""
    p = cfg.parallel
    return shard_dp(cfg) // p.ep * p.cp


def state_layout(cfg: Config) -> StateLayout:
    t = cfg.train
    return layout(t.params_dtype, cfg.parallel.zero, replicas(cfg), t.main_grads_dtype)


def expert_layout(cfg: Config) -> StateLayout:
    """The routed experts' layout: as `state_layout`, over the expert replicas."""
    t = cfg.train
    return layout(t.params_dtype, cfg.parallel.zero, expert_replicas(cfg), t.main_grads_dtype)


def _bytes(n_params: float, per: int, shards: int) -> float:
    return per * (math.ceil(n_params / shards) if shards > 1 else n_params)


def _split(n_params: float, experts: float, cfg: Config, kind: str) -> float:
    """Bytes of state `kind` of `n_params`, `experts` of them routed experts' (sharded over
    the expert replicas) and the rest over dp × cp."""
    s, e = state_layout(cfg), expert_layout(cfg)
    shards = {"weight": "weight_shards", "grad": "grad_shards", "optimizer": "optimizer_shards"}
    dense = _bytes(n_params - experts, getattr(s, kind), getattr(s, shards[kind]))
    return dense + (_bytes(experts, getattr(e, kind), getattr(e, shards[kind])) if experts else 0)


def weights_bytes(n_params: float, cfg: Config, experts: float = 0) -> float:
    """The weights a rank holding `n_params` keeps between steps (its shard under zero=3);
    `experts` of them routed experts' (config/flops.held_expert_params)."""
    return _split(n_params, experts, cfg, "weight")


def grads_bytes(n_params: float, cfg: Config, experts: float = 0) -> float:
    """The (main) grads kept over the step: whole, or the reduced shard under zero>=2."""
    return _split(n_params, experts, cfg, "grad")


def optimizer_bytes(n_params: float, cfg: Config, experts: float = 0) -> float:
    """AdamW's state (and the float32 main params under bf16 weights), whole or 1/d; the
    `experts` among them 1/(dp/ep · cp)."""
    return _split(n_params, experts, cfg, "optimizer")


def step_gather_bytes(n_params: float, cfg: Config, experts: float = 0) -> float:
    """zero 1-2's weight all-gather after the optimizer step (parallel/data/zero.py
    `gather_params`, zero2.py `_launch_gather`): every bucket's gathered flat and this rank's
    shard of it, in the weights' dtype, launched at once while the step's grads are still
    held; 0 without replicas and at zero 0 and 3 (zero=3 gathers a block at a time)."""
    s, e = state_layout(cfg), expert_layout(cfg)
    if s.zero not in (1, 2):
        return 0.0
    dense = n_params - experts
    return s.weight * (dense + _bytes(dense, 1, s.d) + experts + _bytes(experts, 1, e.d))


def gathered_bytes(chunks: Iterable[Sequence[int]], cfg: Config) -> float:
    """zero=3's gathered weights at most at once on a rank: per chunk (`chunks`: each chunk's
    blocks' parameters on this tp rank, in forward order; a head counts the tied table it
    reads) the largest two consecutive blocks (a chunk of one block: that block), in the
    weights' dtype (module docstring); 0 below zero=3."""
    s = state_layout(cfg)
    if s.weight_shards == 1:
        return 0.0
    return float(s.weight * largest_pair(chunks))


def largest_pair(chunks: Iterable[Sequence[int]]) -> float:
    """The most parameters in two consecutive blocks of one chunk (`chunks`: each chunk's
    blocks' parameters, in forward order; a chunk of one block: that block)."""
    pairs = [
        max([a + b for a, b in zip(blocks, blocks[1:])] or list(blocks), default=0)
        for blocks in chunks
    ]
    return float(max(pairs, default=0))


def local_grads_bytes(n_params: float, cfg: Config) -> float:
    """The full-size (main) grads backward accumulates into over the microbatches, before the
    reduction: what every level holds while activations peak (module docstring)."""
    return main_grad_bytes(cfg) * n_params


def send_width(cfg: Config) -> int:
    """Bytes an element of a dp × cp reduction's send buffer: parallel.grad_reduce_dtype's
    from zero=1 on, else float32."""
    bf16 = state_layout(cfg).zero >= 1 and cfg.parallel.grad_reduce_dtype == "bfloat16"
    return 2 if bf16 else FLOAT32


def reduction_bytes(n_params: float, cfg: Config, experts: float = 0) -> float:
    """The grads while the last backward's dp × cp reduction runs (module docstring): the local
    grads kept, the float32 send buffers and the reduce-scattered shards (the `experts`' over
    the expert replicas); with no replicas (d = 1) only the local grads."""
    s, n = state_layout(cfg), n_params
    if s.d == 1:
        return local_grads_bytes(n, cfg)
    bf16, main, wire = s.weight != FLOAT32, main_grad_bytes(cfg), send_width(cfg)
    # zero=1 sends as they lie what it can (parallel/data/zero.py): bf16 weights' padded
    # main grads under a reduction in their dtype; float32 weights' grads, rebound to the
    # send buffer
    in_place = s.zero == 1 and bf16 and wire == main
    dropped = s.zero >= 1 and not bf16 and (s.zero >= 2 or wire == FLOAT32)
    send = 0.0 if in_place or (s.zero == 0 and bf16) else wire * n
    e = expert_layout(cfg).d
    held = wire if s.zero == 1 else GRAD_BYTES  # zero=1 writes its shard into the grads as is
    shard = _bytes(n - experts, held, s.d) + _bytes(experts, held, e)
    if dropped and n:  # at its largest as the last bucket is copied: the shards before it received
        packing = packing_bytes(n, cfg)
        return packing + send + shard * (1 - packing / (GRAD_BYTES * n))
    return local_grads_bytes(n, cfg) + send + (shard if s.zero >= 1 else 0.0)


def bucket_runs(
    sizes: Sequence[int], limit_bytes: float, alone: Sequence[bool] = (), kinds: Sequence = ()
) -> list[range]:
    """Consecutive runs of items (`sizes`: each one's elements, as float32 grads) of about
    `limit_bytes` each, as dp buckets pack parameters (parallel/data/reducer.pack): a run
    closes with the item that fills it (a larger item overshoots it), an item marked in
    `alone` is a run of its own, and a new run starts where `kinds` changes."""
    out, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and kinds and kinds[i] != kinds[i - 1]:
            out.append(range(start, i))
            start, size = i, 0
        if alone and alone[i]:
            out += [range(start, i), range(i, i + 1)] if i > start else [range(i, i + 1)]
            start, size = i + 1, 0
            continue
        size += n * GRAD_BYTES
        if size >= limit_bytes:
            out.append(range(start, i + 1))
            start, size = i + 1, 0
    return out + [range(start, len(sizes))] if start < len(sizes) else out


def replica_bucket_mb(replicas: int) -> float:
    """MB of float32 grads per dp bucket over `replicas` ranks (dp · cp): DEFAULT_BUCKET_MB, or
    BUCKET_PARAMS_PER_REPLICA float32 grads per replica where that is more (dp · cp > 6)."""
    return max(DEFAULT_BUCKET_MB, BUCKET_PARAMS_PER_REPLICA * 4 * replicas / 2**20)


def packing_bytes(n_params: float, cfg: Config) -> float:
    """The grads of the bucket being copied into its send buffer, where they are dropped once
    copied (`reduction_bytes`' dropped case): both are live for that moment, so the reduction
    holds one bucket's grads more than its end state (parallel/data/zero.py `_copy_in`;
    FSDP2's reduce-scatter copy-in has the same moment). A bucket is replica_bucket_mb of
    float32 grads, at most the rank's grads; it closes after the parameter that fills it, so
    a parameter larger than the bucket overshoots it, and expert and dense weights' buckets
    are apart, smaller (left out: the module docstring)."""
    p = cfg.parallel
    return GRAD_BYTES * min(n_params, replica_bucket_mb(p.dp * p.cp) * 2**20 / GRAD_BYTES)


def reduces_per_microbatch(cfg: Config) -> bool:
    """parallel.grad_reduce resolved: each microbatch's backward reduce-scatters rather than
    the last one only (parallel/data/zero2.py); zero >= 2, and always at zero=3 (auto: a
    full-size grad is what ZeRO-3 exists not to hold; step there is refused, checks_runtime)."""
    p = cfg.parallel
    return p.zero >= 2 and (p.grad_reduce == "microbatch" or p.zero == 3)


def local_grads_transient(cfg: Config) -> bool:
    """No full-size local grads are kept (module docstring, per-microbatch reduction): with
    replicas, reducing every microbatch, and not zero=2's bf16 main-grad buffer (one buffer
    for the whole model, kept: only zero=3 has them per bucket, parallel/data/bucket_grads.py)."""
    s = state_layout(cfg)
    return s.d > 1 and reduces_per_microbatch(cfg) and (s.zero >= 3 or s.weight == FLOAT32)


def block_grads_bytes(at_once: tuple[float, float], d: int = 0, grad: int = GRAD_BYTES,
                      wire: int = FLOAT32) -> float:  # fmt: skip
    """Per-microbatch reduction's full-size grads at most at once (`at_once`: config/
    grad_buckets.grads_at_once's parameters): the (main) grads made and not yet sent, `grad`
    bytes an element (main_grad_bytes), and the send buffers of the reductions in flight,
    `wire` bytes (send_width); with `d` (while reducing), their received 1/d shards too
    (`bucket.shard`)."""
    made, flight = at_once
    return grad * made + wire * flight * (1 + (1 / d if d else 0))


def state_bytes(n_params: float, cfg: Config, gathered: float = 0.0, experts: float = 0) -> float:
    """Weights, grads and optimizer state of a rank holding `n_params` (`experts` of them routed
    experts'), plus `gathered`."""
    return (
        weights_bytes(n_params, cfg, experts)
        + grads_bytes(n_params, cfg, experts)
        + optimizer_bytes(n_params, cfg, experts)
        + gathered
    )
