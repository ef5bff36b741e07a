"""Project one training step of a config onto a cluster: time, throughput, MFU, bubble, breakdown
and peak memory (docs/architecture.md, "Layers", perf).

A step, as our runtime runs it (docs/architecture.md, "One training step"):

1. The pipeline. Every action of the configured schedule (config/pipeline_split.schedule_of,
   placed by placement_of, the partition of config/pipeline_split.partition) costs what its
   chunk's blocks cost
   for that kind (perf/costs.py: F, B with the recompute, W, BW = B + W; a Seq1F1B segment its
   own shapes), and a message between ranks arrives one p2p transfer after its producer ends
   (perf/comm.py, on NVLink or the network by where the two pp ranks sit). The action lists are
   timed with plan/walk.py's semantics (plan/dag.py, the DAG plan/simulate.py times too,
   cached by perf/pipeline.py). pp = 1 runs the microbatches one after another (F, BW). A schedule
   built for costs (zb_v) under `schedule_costs=profile` is built from the projected costs, as
   the runtime rebuilds it from the measured ones. On a measured profile without tp, each
   message also arrives later by `step_skew` of the compute that sent it (host.py: sync_skew).
2. The dp × cp gradient reduction (perf/data_parallel.py, comm.ring_time on the replica
   group's link): all-reduce (zero=0) or reduce-scatter (zero>=1) of each chunk's grads, in
   buckets launched during the chunk's last backward (W or BW) and finishing no earlier than
   that backward's end plus one bucket, one chunk after another, whatever of it outlasts the
   rank's pipeline work being exposed; then the tied embedding's all-reduce between the first
   and last stage. A runtime without overlap (runtime.py) starts it when the rank's pipeline
   work ends. zero=3's weight gathers of every microbatch run beside the compute from the
   step's start (exposed only past it); zero=2 reduce-scatters once, as zero=1. Without a
   pipeline or tp, a measured profile's ranks also wait `step_skew` of the step's compute there.
3. The optimizer: the global grad norm (a tree all-reduce, latency only), AdamW over the
   rank's parameters (or its 1/(dp·cp) shard) at the runtime's bytes per parameter, and under
   zero 1 and 2 the all-gather of the updated weights in their dtype.

step_time = max over ranks of the end of 2, + 3. Model FLOPs are config/flops.flops_per_token
(6N + 12·L·d·T, as metrics.jsonl counts them: the full window, under data.document_mask too,
whose attention time is priced as the full causal window's); hardware FLOPs add the recompute's
forward (full: 2·N_layer + 4·d·T per recomputed layer and token; selective: 4·d·T), the count of
Narayanan et al. 2021 §5.1. The breakdown splits the step on the busiest pp rank: its compute
(GEMMs, attention, memory-bound kernels), exposed tp/sp and cp communication, the pipeline
bubble with p2p waits (makespan − its busy time), exposed dp communication, the optimizer. Peak
memory is the one memory model's (config/memory_plan.py, cached by perf/memory_cache.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from megapipe.config import Config
from megapipe.config.comm_bytes import p2p_message_bytes
from megapipe.config.flops import (
    attention_widths,
    flops_per_token,
    held_expert_params,
    matmul_params,
    mlp_rerun_params,
    segment_bounds,
)
from megapipe.config.pipeline_split import partition, placement_of
from megapipe.config.schema import layer_mode, reruns_core
from megapipe.perf.cluster import Cluster
from megapipe.perf.comm import group_link, p2p_link, p2p_time, ring_time
from megapipe.perf.cost_terms import CALIBRATION, Calibration, Work
from megapipe.perf.costs import CostModel
from megapipe.perf.data_parallel import DPPlan, dp_plan, optimizer_plan, reduction_groups
from megapipe.perf.memory_cache import chunk_params
from megapipe.perf.memory_cache import plan as memory_plan
from megapipe.perf.muon_costs import with_muon
from megapipe.perf.pipeline import config_dag
from megapipe.perf.software import MEGAPIPE, Runtime
from megapipe.plan.actions import FORWARD, FULL_BACKWARD, Action, Placement
from megapipe.plan.dag import KIND_INDEX, Dag, Timing, compile_schedule, run
from megapipe.plan.schedules import SCHEDULES

GIB = 2**30


@dataclass
class Projection:
    """One projected step (module docstring). Times in seconds."""

    step_time_s: float
    tflops_per_gpu: float
    hw_tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    breakdown: dict[str, float]
    peak_memory_gib: float | None
    memory_rank: tuple[int, int] | None  # (pp_rank, tp_rank) of the peak
    fits: bool | None  # peak within the GPU's memory
    world_size: int
    tokens_per_step: int
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_gib": self.peak_memory_gib,
            "memory_rank": list(self.memory_rank) if self.memory_rank else None,
            "fits": self.fits,
            "world_size": self.world_size,
            "tokens_per_step": self.tokens_per_step,
            "breakdown": self.breakdown,
            "detail": self.detail,
        }


def recompute_flops_per_token(cfg: Config) -> float:
    """Forward FLOPs per token the recompute adds: full reruns a layer (2·N_layer + 4·d·T),
    selective's core_attn the attention core (4·d·T; 2·(H·qk + H·v)·T under latent attention,
    its widths config/flops.attention_widths), its mlp a dense MLP (2·N_mlp), for each layer
    recompute.layers covers."""
    m = cfg.model
    layer_fwd = 2.0 * (matmul_params(cfg) - m.d_model * m.vocab_size) / m.n_layers
    attn_fwd = 2.0 * sum(attention_widths(m, cfg.derived)) * m.seq_len
    total = 0.0
    for i in range(m.n_layers):
        full = layer_mode(cfg.recompute, i) == "full"
        total += layer_fwd if full else 2.0 * mlp_rerun_params(cfg, i)
        total += attn_fwd if reruns_core(cfg.recompute, i) else 0.0
    return total


@functools.lru_cache(maxsize=64)
def _replica_dag(microbatches: int) -> Dag:
    """pp = 1 (train/replica.py): each microbatch's forward, then its backward."""
    actions = []
    for mb in range(microbatches):
        actions += [Action(FORWARD, mb), Action(FULL_BACKWARD, mb)]
    return compile_schedule({0: actions}, Placement(1, 1))


def _as_profiled(cfg: Config, stage_costs: list[list[list[Work]]]) -> Config:
    """A schedule built for costs under schedule_costs=profile (zb_v) is rebuilt by the runtime
    from the costs of its second step (pipeline/timeline.profile_costs: the mean per kind over
    the ranks): here from the projected ones, one microbatch through a rank's whole share,
    relative to the largest, to 3 digits (so similar configs share the cached schedule)."""
    p = cfg.parallel
    place = placement_of(cfg)
    means = [
        sum(stage_costs[place.stage(r, c)][kind][0].total for r in range(p.pp) for c in
            range(place.vpp)) / p.pp
        for kind in range(3)
    ]  # fmt: skip
    scale = max(means) or 1.0
    text = ",".join(f"{k}={max(x / scale, 1e-3):.3g}" for k, x in zip("FBW", means))
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, schedule_costs=text))


def project(
    cfg: Config,
    cluster: Cluster,
    runtime: Runtime = MEGAPIPE,
    cal: Calibration = CALIBRATION,
    memory: bool = True,
) -> Projection:
    """The projected step of `cfg` on `cluster` (module docstring). `memory=False` skips the
    memory plan (peak_memory_gib None), the one part that builds meta-device chunks."""
    p = cfg.parallel
    cm = CostModel(cfg, cluster, runtime, cal)
    shape = (p.pp, p.dp, p.cp, p.tp)
    pipelined = p.pp > 1
    place = placement_of(cfg) if pipelined else Placement(1, 1)
    stages = partition(cfg, place.num_stages) if pipelined else [range(0, cfg.model.n_layers + 2)]
    bounds = segment_bounds(cfg)
    stage_costs = _stage_costs(cm, stages, len(bounds))
    dag = _step_dag(cfg, stage_costs)
    # per-rank parameters (grads to reduce, optimizer state) per local chunk, tp rank 0
    held = [
        [chunk_params(cfg, stages[place.stage(r, c)], 0) for c in range(place.vpp)]
        for r in range(p.pp)
    ]
    experts = [
        [held_expert_params(cfg, stages[place.stage(r, c)]) for c in range(place.vpp)]
        for r in range(p.pp)
    ]
    if runtime.moe_expert_tp and p.tp > 1:  # the runtime holds 1/tp of each routed expert
        held = [[n - e + e // p.tp for n, e in zip(*pair)] for pair in zip(held, experts)]
        experts = [[e // p.tp for e in es] for es in experts]
    embedding = chunk_params(cfg, range(0, 1), 0)  # zero=3 gathers it once a microbatch
    dp = dp_plan(cfg, cluster, runtime, shape, held, runtime.grad_bytes or cm.c, experts,
                 embedding)  # fmt: skip
    opt = optimizer_plan(cfg, cluster, runtime, cm, shape, held, experts)
    chunks = [[stages[place.stage(r, c)] for c in range(place.vpp)] for r in range(p.pp)]
    shard_link = reduction_groups(cfg, cluster, shape)[0][0][1]
    opt = with_muon(opt, cfg, cm.dev, chunks, shard_link)  # train.optimizer=muon
    cost = _action_costs(cfg, dag, stage_costs, place, dp, opt)
    delay, extra = _messages(cfg, cluster, runtime, cm, shape, dag, bounds)
    skew = cluster.host.sync_skew(p.tp, cfg.derived.world_size) if cluster.host else 0.0
    if pipelined and skew:
        _skew_messages(dag, stage_costs, skew, delay)
    timing = run(dag, cost, delay, extra)
    busiest = max(range(p.pp), key=lambda r: timing.busy[r])
    parts = _rank_work(dag, stage_costs, busiest)
    if _updates_in_backward(cfg):
        dp_end, opt_time, gather = timing.makespan, 0.0, 0.0
    else:
        dp_end = _dp_end(dag, timing, dp, runtime, place)
        opt_time, gather = opt.step, opt.gather
    if not pipelined and skew:  # the step's one synchronisation: the gradient reduction
        dp_end += skew * parts.compute
    step = dp_end + opt_time + gather
    breakdown = _breakdown(cfg, dag, timing, busiest, parts, dp_end, opt_time + gather, dp, opt)
    return _projection(cfg, cluster, step, timing, breakdown, memory, {
        "runtime": runtime.name,
        "cluster": cluster.name,
        "busiest_pp_rank": busiest,
        "pipeline_makespan_s": timing.makespan,
        "actions": dag.size,
        "attention": cm.attention,
        "links": {
            "tp": cm.tp_link.name,
            "cp": cm.cp_link.name,
            "dp": group_link(cluster, shape, ("dp", "cp")).name,
            "pp": p2p_link(cluster, shape, 0, 1).name if pipelined else None,
        },
        "dp_comm_max_rank_s": max(dp.total),
        "dp_per_microbatch_max_rank_s": max(dp.per_microbatch),  # zero=3's, beside compute
    })  # fmt: skip


def _updates_in_backward(cfg: Config) -> bool:
    """PipeDream's asynchronous schedule: each stage's backward reduces and steps its own
    weights, so the step ends with the pipeline and no optimizer step follows it."""
    return cfg.parallel.schedule == "pipedream_async" and cfg.parallel.pp > 1


def _stage_costs(cm: CostModel, stages: list[range], n_segments: int) -> list[list[list[Work]]]:
    """Per global stage, per kind (F, B, W, BW), per segment: that action's Work."""
    seg_ids = [None] if n_segments == 1 else list(range(n_segments))
    stage_costs: list[list[list[Work]]] = []
    for blocks in stages:
        per_kind: list[list[Work]] = [[], [], [], []]
        for seg in seg_ids:
            c = cm.stage(blocks, seg)
            for kind, w in enumerate((c.F, c.B, c.W, c.B + c.W)):
                per_kind[kind].append(w)
        stage_costs.append(per_kind)
    return stage_costs


def _step_dag(cfg: Config, stage_costs: list[list[list[Work]]]) -> Dag:
    """The action DAG the runtime walks: the config's schedule (generated from the projected
    stage costs where the schedule takes profiled costs), or one replica's F/BW list."""
    p = cfg.parallel
    if p.pp == 1:
        return _replica_dag(p.microbatches)
    if "costs" in SCHEDULES[p.schedule].options and p.schedule_costs == "profile":
        return config_dag(_as_profiled(cfg, stage_costs))
    return config_dag(cfg)


def _action_costs(cfg: Config, dag: Dag, stage_costs, place: Placement, dp, opt) -> list[float]:
    """Seconds of each action of `dag`; under PipeDream's asynchronous schedule a backward
    also carries its rank's gradient reduction and optimizer step."""
    cost = [0.0] * (len(stage_costs) * 4 * dag.segments)
    for st, per_kind in enumerate(stage_costs):
        for kind in range(4):
            for k, w in enumerate(per_kind[kind]):
                cost[dag.key(st, kind, k)] = w.total
    if _updates_in_backward(cfg):
        for st in range(len(stage_costs)):
            rank = place.locate(st)[0]
            for k in range(dag.segments):
                cost[dag.key(st, KIND_INDEX[FULL_BACKWARD], k)] += (
                    dp.total[rank] + opt.per_rank[rank]
                )
    return cost


def _breakdown(cfg, dag: Dag, timing: Timing, busiest: int, parts: Work, dp_end: float,
               opt_time: float, dp, opt) -> dict[str, float]:  # fmt: skip
    """The step's seconds by what the busiest pipeline rank spends them on."""
    breakdown = {
        "compute_s": parts.compute,
        "tp_comm_s": parts.tp,
        "cp_comm_s": parts.cp,
        "ep_comm_s": parts.ep,
        "pipeline_bubble_p2p_s": timing.makespan - timing.busy[busiest],
        "dp_comm_s": dp_end - timing.makespan,
        "optimizer_s": opt_time,
    }
    if _updates_in_backward(cfg):  # the updates inside the backwards
        backwards = sum(1 for r, k in zip(dag.rank, dag.kind) if r == busiest and k == 3)
        breakdown["dp_comm_s"] = backwards * dp.total[busiest]
        breakdown["optimizer_s"] = backwards * opt.per_rank[busiest]
    return breakdown


def _projection(cfg: Config, cluster: Cluster, step: float, timing: Timing, breakdown: dict,
                memory: bool, detail: dict) -> Projection:  # fmt: skip
    """The Projection of a `step`-second step: throughput, MFU and, with `memory`, the peak
    of the memory plan."""
    world = cfg.derived.world_size
    tokens = cfg.derived.tokens_per_step
    model_flops = tokens * flops_per_token(cfg)
    hw_flops = model_flops + tokens * recompute_flops_per_token(cfg)
    tflops = model_flops / step / world / 1e12
    detail["model_tflops_per_step"] = model_flops / 1e12
    detail["hw_tflops_per_step"] = hw_flops / 1e12
    peak = rank = fits = None
    if memory:
        mem = memory_plan(cfg, "cuda", cluster.hbm_bytes)
        peak, rank = mem.max / GIB, mem.argmax
        fits = mem.max <= cluster.hbm_bytes
    return Projection(
        step_time_s=step,
        tflops_per_gpu=tflops,
        hw_tflops_per_gpu=hw_flops / step / world / 1e12,
        mfu=tflops / cluster.peak_tflops,
        bubble_fraction=timing.bubble_fraction,
        breakdown=breakdown,
        peak_memory_gib=peak,
        memory_rank=rank,
        fits=fits,
        world_size=world,
        tokens_per_step=tokens,
        detail=detail,
    )


def _rank_work(dag: Dag, stage_costs, rank: int) -> Work:
    """The Work parts of all of `rank`'s actions."""
    total = Work()
    for index, count in dag.counts[rank].items():
        st, rest = divmod(index, 4 * dag.segments)
        kind, seg = divmod(rest, dag.segments)
        total = total + stage_costs[st][kind][seg] * count
    return total


def _skew_messages(dag: Dag, stage_costs, skew: float, late: list[float]) -> None:
    """Each message arrives later by `skew` of the compute of the actions that send it (their
    mean: one key carries a rank pair's messages of every microbatch and chunk): the receiver
    waits for it, the sender does not (`late`: the arrival delay per message key)."""
    sent: dict[int, list[float]] = {}
    for i, key in enumerate(dag.sends):
        if key >= 0:
            st, kind, seg = dag.stage[i], dag.kind[i], dag.seg[i]
            sent.setdefault(key, []).append(stage_costs[st][kind][seg].compute)
    for key, computes in sent.items():
        late[key] += skew * sum(computes) / len(computes)


def _messages(cfg, cluster, runtime, cm, shape, dag: Dag, bounds):
    """Per message key: the arrival delay and (blocking p2p) the sender's extra seconds."""
    p, m = cfg.parallel, cfg.model
    q_full = m.seq_len // p.cp
    delay = [0.0] * len(dag.messages)
    # a runtime that overlaps p2p under interleaving posts the sends and waits at first use
    blocking = runtime.p2p_blocking and not (runtime.p2p_overlap and place_vpp(cfg) > 1)
    extra = [0.0] * len(dag.messages) if blocking else None
    for key, (src, dst, seg, _grad) in enumerate(dag.messages):
        q = q_full if len(bounds) == 1 else bounds[seg][1] - bounds[seg][0]
        # config/comm_bytes.py's message: under SP each tp rank sends its sequence shard, and
        # Megatron-LM skips its scatter/gather (p2p_communication.py:
        # scatter_gather_tensors_in_pipeline and not sequence_parallel)
        nbytes = message_bytes(cfg, runtime, cm.c, q)
        sp = p.sequence_parallel and p.tp > 1
        link = p2p_link(cluster, shape, src, dst)
        if runtime.p2p_scatter_gather and p.tp > 1 and link.name == "network" and not sp:
            t = p2p_time(nbytes / p.tp, link) + ring_time("all_gather", nbytes, p.tp, cm.tp_link)
        else:
            t = p2p_time(nbytes, link)
        if extra is not None:
            extra[key] = t
        else:
            delay[key] = t
    return delay, extra


def message_bytes(cfg: Config, runtime: Runtime, c: int, tokens: int) -> float:
    """One pipeline message of `tokens` per sequence under `runtime` (its p2p element bytes,
    0: the compute dtype's `c`): config/comm_bytes.p2p_message_bytes, the code's own size."""
    return p2p_message_bytes(cfg, tokens, runtime.p2p_bytes or c)


def place_vpp(cfg: Config) -> int:
    """Chunks per pp rank of the configured placement (1 without a pipeline)."""
    return placement_of(cfg).vpp if cfg.parallel.pp > 1 else 1


def _dp_end(dag: Dag, timing: Timing, dp: DPPlan, runtime: Runtime, place: Placement) -> float:
    """When the last rank has its grads reduced (module docstring, 2)."""
    pp, vpp = place.pp, place.vpp
    rank_end = [0.0] * pp
    for r, i in enumerate(_last_actions(dag)):
        rank_end[r] = timing.end[i] if i >= 0 else 0.0
    last_rank = place.locate(place.num_stages - 1)[0]
    done = 0.0
    for r in range(pp):
        free = 0.0 if runtime.dp_overlap else rank_end[r]
        held = [
            (timing.start[dag.last_grad[r, c]], c) for c in range(vpp) if (r, c) in dag.last_grad
        ]
        for _, c in sorted(held):
            i = dag.last_grad[r, c]
            if runtime.dp_overlap:
                begin = max(free, timing.start[i])
                free = max(begin + dp.chunk[r][c], timing.end[i] + dp.last_bucket[r][c])
            else:
                free += dp.chunk[r][c]
        # zero=3's per-microbatch weight gathers run beside the compute from the step's start
        ready = max(rank_end[r], free, dp.per_microbatch[r] + dp.total[r])
        if r in (0, last_rank) and dp.tied:
            ready += dp.tied
        done = max(done, ready)
    return done


def _last_actions(dag: Dag) -> list[int]:
    """Index of each rank's last action (-1: none)."""
    last = [-1] * dag.pp
    for i in range(dag.size - 1, -1, -1):
        if last[dag.rank[i]] < 0:
            last[dag.rank[i]] = i
            if min(last) >= 0:
                break
    return last
