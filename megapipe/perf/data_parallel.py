"""The step's data-parallel parts, priced per rank for perf/model.py and the planner's bounds
(perf/bounds.py): the dp × cp gradient reduction and the optimizer step with zero>=1's weight
all-gather, by parallel.zero and the runtime (perf/software.py, resolved for the config's
dtypes).

- zero=0: each chunk's grads all-reduced in buckets; zero>=1: reduce-scattered (Rajbhandari
  et al. 2020 §5; Megatron's distributed optimizer), launched during the chunk's last backward
  (perf/model._dp_end times when they end).
- zero>=2: a rank keeps only its shard of the reduced grads after the step's reduction; the
  earlier microbatches accumulate local grads (float32 .grad, or bf16 weights' float32 main
  grads) and the reduce-scatter runs once, in the last backward, as at zero=1
  (parallel/data/zero2.py; Megatron's distributed optimizer and DeepSpeed's ZeRO-2 under
  gradient accumulation): no more reductions than zero=1 (tests/test_perf_runtime.py pins it).
- zero=3: the weights are sharded too: each block's are all-gathered before its forward and
  again before its backward, every microbatch (the gathered copy is freed in between): 2·m
  all-gathers of the rank's weights in their dtype (bf16 under train.params_dtype=bfloat16),
  but one of the embedding's, whose backward reads no weight (config/comm_bytes
  .zero3_gathers), prefetched a block ahead, so they run beside the compute
  (`per_microbatch`); no weight all-gather after the step. Its grads are reduce-scattered
  every microbatch (config/states.reduces_per_microbatch; at zero=2 under
  parallel.grad_reduce=microbatch too): the grad actions' reductions before the last run
  beside the compute as well (`per_microbatch`). The reductions send `grad_bytes` per element
  at every level (megapipe: float32), 2 under parallel.grad_reduce_dtype=bfloat16
  (config/comm_bytes.reduce_width; the tied table's swap stays in `grad_bytes`). Under
  train.fp8 the FP8 linears' weights are gathered as 1-byte e4m3 payloads
  (parallel/data/zero3_fp8.py; config/fp8_weights.py), half a bf16 gather's bytes, and under
  rowwise with full recompute once more a microbatch (the forward's cast again inside the
  backward); their once-a-step amax all-reduces are a few bytes per scale (latency only, not
  priced; the linears' own, every microbatch, are: perf/fp8_costs.py).
- Expert parallelism (parallel.ep > 1): the routed experts' grads are reduced over their
  expert-replica group, the dp/ep · cp ranks holding the same experts (parallel/data/
  reducer.py; Megatron-Core's expert data-parallel group), on that group's link
  (comm.expert_replica_link), and zero>=1 shards their state over it (zero=3 gathers their
  weights there, per microbatch); the other weights over dp × cp as above. Each chunk's
  routed-expert parameters come from config/flops.held_expert_params.
- HSDP (parallel.dp_shard = S < dp): the reduce-scatters and weight gathers run inside the
  shard groups (S·cp ranks, the experts' S/ep · cp) on their links, and each rank's grad shard
  is then all-reduced over its dp/S replicas on the replicate groups' link (parallel/data/
  zero.py; FSDP's hybrid sharding, Zhao et al. 2023 §3.4): the two-level reduction.
- The optimizer: AdamW over the rank's parameters or its 1/(dp·cp) shard at the runtime's
  bytes per parameter, the global grad norm's tree all-reduce (latency only), and at zero 1
  and 2 the all-gather of the updated weights in their dtype, exposed unless the runtime
  overlaps it with the next forward (then only its first bucket is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.config import Config
from megapipe.config.comm_bytes import (
    fp8_gathers,
    grad_reduction_kind,
    grad_reductions,
    reduce_width,
    shares_table,
    tied_grad_bytes,
    zero3_gathers,
)
from megapipe.config.fp8_weights import FP8_BYTES, fp8_params, weight_casts, weight_granularity
from megapipe.config.pipeline_split import placement_of, rank_blocks, schedule_of
from megapipe.config.states import (
    expert_layout,
    expert_replicas,
    reduces_per_microbatch,
    replicas,
    shard_copies,
    shard_dp,
    state_layout,
)
from megapipe.perf.cluster import Cluster
from megapipe.perf.comm import expert_replica_link, group_link, hsdp_links, p2p_link, ring_time
from megapipe.perf.costs import CostModel
from megapipe.perf.software import Runtime, bucket_bytes, resolved_for
from megapipe.plan.actions import Placement


def layers_per_chunk(cfg: Config) -> int:
    """Transformer layers of one model chunk (at least 1): a per-block runtime's buckets."""
    p = cfg.parallel
    return max(1, cfg.model.n_layers // (placement_of(cfg).num_stages if p.pp > 1 else 1))


@dataclass
class DPPlan:
    chunk: list[list[float]]  # per rank, per local chunk: seconds of its reduction
    last_bucket: list[list[float]]
    total: list[float]  # per rank
    tied: float  # the tied embedding's all-reduce between the first and last stage
    # per rank: seconds of the collectives issued every microbatch besides the last one's
    # reduction (zero=3's weight gathers; reducing every microbatch, the earlier reductions)
    per_microbatch: list[float]


def dp_plan(cfg: Config, cluster: Cluster, runtime: Runtime, shape, held, grad_bytes,
            experts=None, embedding=0) -> DPPlan:  # fmt: skip
    """The reduction of each rank's chunks (`held`: per rank, per local chunk, parameters;
    `experts`: as many of them routed experts', reduced over the expert replicas;
    `embedding`: the embedding block's parameters, held by the first stage's rank)."""
    p, m = cfg.parallel, cfg.model
    rt = resolved_for(runtime, cfg)
    groups, replicate = reduction_groups(cfg, cluster, shape)
    blocks = layers_per_chunk(cfg)
    width = reduce_width(cfg, grad_bytes)  # parallel.grad_reduce_dtype's
    chunk, last = [], []
    for r, per_chunk in enumerate(held):
        times, lasts = [], []
        for c, params in enumerate(per_chunk):
            e = experts[r][c] if experts and p.ep > 1 else 0
            first = (r, c) == (0, 0)
            parts = [(params - e) * width, e * width]
            priced = [_reduce(cfg, rt, nb, n, link, blocks, first, width, replicate)
                      for nb, (n, link) in zip(parts, groups)]  # fmt: skip
            times.append(sum(t for t, _ in priced))
            lasts.append(max(lt for _, lt in priced))
        chunk.append(times)
        last.append(lasts)
    tied = 0.0
    place = placement_of(cfg) if p.pp > 1 else Placement(1, 1)
    last_rank = place.locate(place.num_stages - 1)[0]
    if shares_table(m) and last_rank != 0:
        tied = ring_time("all_reduce", tied_grad_bytes(cfg, grad_bytes), 2,
                         p2p_link(cluster, shape, 0, last_rank))  # fmt: skip
    every = _per_microbatch(cfg, rt, groups, held, experts, (place.locate(0)[0], embedding))
    # the schedule once for every rank (a pipeline reducing every microbatch counts its actions)
    schedule = schedule_of(cfg) if p.pp > 1 and reduces_per_microbatch(cfg) else None
    every = [
        t + _earlier_reductions(cfg, r, times, schedule)
        for r, (t, times) in enumerate(zip(every, chunk))
    ]
    return DPPlan(chunk, last, [sum(t) for t in chunk], tied, every)


def _earlier_reductions(cfg: Config, rank: int, times: list[float], schedule=None) -> float:
    """Reducing every microbatch (always at zero=3: config/states.reduces_per_microbatch), the
    reductions of the rank's grad actions before each chunk's last, each as long as the step's
    (`times`, HSDP's all-reduce across replicas included: an upper bound), beside the compute
    (config/comm_bytes.grad_reductions counts them)."""
    return sum((k - 1) * t for k, t in zip(grad_reductions(cfg, rank, schedule), times))


def reduction_groups(cfg: Config, cluster: Cluster, shape) -> tuple[list, tuple | None]:
    """([(ranks, link)] the grads are reduced over: dp × cp, and the routed experts' expert
    replicas; under HSDP the shard groups), and HSDP's (replicas, link) of the shards' all-reduce
    (None without)."""
    p = cfg.parallel
    copies = shard_copies(cfg)
    if copies > 1:
        shard, experts, across = hsdp_links(cluster, shape, shard_dp(cfg), p.ep)
        groups = [(replicas(cfg), shard)] + ([(expert_replicas(cfg), experts)] if p.ep > 1 else [])
        return groups, (copies, across)
    groups = [(p.dp * p.cp, group_link(cluster, shape, ("dp", "cp")))]
    if p.ep > 1:  # expert buckets: summed over the expert-replica group (reducer.py)
        groups.append((expert_replicas(cfg), expert_replica_link(cluster, shape, p.ep)))
    return groups, None


def _reduce(cfg: Config, rt: Runtime, nbytes: float, n: int, link, blocks: int, first: bool,
            grad_bytes, replicate=None) -> tuple[float, float]:  # fmt: skip
    """(seconds, its last bucket's) of one chunk's `nbytes` of grads reduced over `n` ranks,
    then (HSDP's `replicate`: (replicas, link)) its 1/n shard all-reduced across replicas."""
    kind = grad_reduction_kind(cfg.parallel.zero, n)
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    bucket = bucket_bytes(rt, n, grad_bytes)
    t = ring_time(kind, nbytes, n, link)
    across = 0.0
    if replicate is not None:
        across = ring_time("all_reduce", nbytes / n, replicate[0], replicate[1])
    size = nbytes / blocks if rt.dp_bucket_per_block else bucket
    bucketed = size and not (rt.dp_bucket_first_only and not first)
    if bucketed and nbytes > size and n > 1:
        t += (math.ceil(nbytes / size) - 1) * steps * link.latency
        last = ring_time(kind, size, n, link)
        if replicate is not None:
            last += ring_time("all_reduce", size / n, replicate[0], replicate[1])
        return t + across, last
    return t + across, t + across


def _per_microbatch(cfg: Config, rt: Runtime, groups, held, experts=None,
                    embedding=(0, 0)) -> list[float]:  # fmt: skip
    """Per rank, zero=3's weight all-gathers per microbatch (module docstring;
    config/comm_bytes.zero3_gathers): the routed experts' (`experts`, as `held`) over their
    expert replicas (`groups[1]`), the rest over dp × cp (`groups[0]`); `embedding`: (the
    rank holding it, its parameters), gathered once a microbatch in the first local chunk."""
    s = state_layout(cfg)
    twice, once = zero3_gathers(cfg, 1), zero3_gathers(cfg, 0)
    out = []
    for r, per_chunk in enumerate(held):
        t = 0.0
        if s.weight_shards > 1:
            for c, n in enumerate(per_chunk):
                e = experts[r][c] if experts and len(groups) > 1 else 0
                emb = embedding[1] if (r, c) == (embedding[0], 0) else 0
                blocks = rank_blocks(cfg, r)[c] if cfg.train.fp8 != "none" else range(0)
                f = fp8_params(cfg, blocks)  # gathered as 1-byte payloads
                parts = [(n - e - emb - f, groups[0], twice), (emb, groups[0], once)]
                parts += [(e, groups[1], twice)] if e else []
                t += sum(j * ring_time("all_gather", k * rt.param_bytes, d, link)
                         for k, (d, link), j in parts)  # fmt: skip
                again = sum(fp8_gathers(cfg, b) * fp8_params(cfg, [b]) for b in blocks)
                t += twice * ring_time("all_gather", f * FP8_BYTES, *groups[0])
                t += ring_time("all_gather", again * FP8_BYTES, *groups[0])
        out.append(t)
    return out


@dataclass
class OptPlan:
    per_rank: list[float]
    step: float
    gather: float


def _gathered_bytes(cfg: Config, rt: Runtime, rank: int, chunks) -> float:
    """Bytes of zero 1-2's weight gather after the step for the `chunks` (parameters each) of
    pp rank `rank`: in the gather's dtype, but train.fp8_params' FP8 weights as 1-byte casts
    (two under rowwise: parallel/data/fp8_params.py; config/comm_bytes._held_gather)."""
    total = sum(chunks) * rt.param_bytes
    if weight_casts(cfg) != "held":
        return total
    forms = 2 if weight_granularity(cfg) == "rowwise" else 1
    fp8 = sum(fp8_params(cfg, bs) for bs in rank_blocks(cfg, rank)[: len(chunks)])
    return total - fp8 * (rt.param_bytes - forms * FP8_BYTES)


def optimizer_plan(cfg: Config, cluster: Cluster, runtime: Runtime, cm: CostModel, shape, held,
                   experts=None):  # fmt: skip
    """The optimizer step after the reduction (module docstring): an OptPlan. `experts` (as
    `held`): the routed experts' parameters, whose state is sharded over the expert replicas."""
    p = cfg.parallel
    rt = resolved_for(runtime, cfg)
    n = replicas(cfg)  # the shard group (HSDP), else dp × cp
    s = state_layout(cfg)
    shards = s.optimizer_shards
    norm_group = cfg.derived.world_size if shards > 1 else p.pp * p.tp
    norm = (
        2 * math.ceil(math.log2(norm_group)) * cluster.network(1).latency if norm_group > 1 else 0
    )
    eshards = expert_layout(cfg).optimizer_shards
    own = [sum(es) if experts and p.ep > 1 else 0 for es in (experts or held)]
    per_rank = [cm.dev.mem(((sum(ps) - e) / shards + e / eshards) * rt.optimizer_bytes)
                for ps, e in zip(held, own)]  # fmt: skip
    gather = 0.0
    if shards > 1 and s.weight_shards == 1:  # zero=3 gathers per block instead (dp_plan)
        link = reduction_groups(cfg, cluster, shape)[0][0][1]
        bucket = bucket_bytes(rt, n, rt.param_bytes) if rt.param_gather_overlap else math.inf
        if rt.dp_bucket_first_only and rt.param_gather_overlap:
            # only the first stage's first chunk is bucketed; its first bucket is what the next
            # forward waits for (the other chunks gather behind it, and later stages' first
            # forwards wait for their inputs)
            held = [held[0][:1]]
        blocks = layers_per_chunk(cfg)
        first = [_gathered_bytes(cfg, rt, r, ps) for r, ps in enumerate(held)]
        if rt.dp_bucket_per_block and rt.param_gather_overlap:
            first = [b / blocks for b in first]  # the first block's gather, the rest behind it
        gather = max(ring_time("all_gather", min(b, bucket or b), n, link) for b in first)
    return OptPlan(per_rank, norm + max(per_rank), gather)
