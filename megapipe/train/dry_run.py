"""`train.py --dry-run`: the mesh, the pipeline partition, per-rank parameter counts and memory
(the one memory model, config/memory_plan.py, through train/meta_memory.py), no training; with
`--json` the same numbers as one JSON object (`as_json`).

Needs no process group. Each (pp, tp) coordinate builds its chunks on the meta device from the
partition training uses (config/pipeline_split.py `rank_blocks`: the schedule's placement, vpp
chunks,
parallel.balance) with a `TPInfo(tp, rank)` (ShardSpec gives the local sizes). Its memory is
weights, grads and optimizer state by train.params_dtype and parallel.zero (config/states.py;
zero=3 adds its gathered blocks to the weights; the grads as held while activations peak, the
full-size local ones, also held over the step and while the last backward's reduction runs)
plus the activations our model saves for one
microbatch times the microbatches the configured schedule keeps in flight on the rank, from
running that schedule through the planner's simulator: a pipeline rank's activation memory is
its stash of microbatches that went forward but not yet backward (Narayanan et al. 2021 §2.2;
Qi et al. 2023 §3), and under a B/W split what W still needs.
"""

from __future__ import annotations

from megapipe.config import Config
from megapipe.config.flops import flops_per_token
from megapipe.config.fp8_weights import fp8_summary
from megapipe.config.memory_moe import moe_summary
from megapipe.config.memory_plan import RankMemory
from megapipe.config.memory_terms import attention_path, layer_deferred
from megapipe.config.pipeline_split import describe_partition, rank_blocks, schedule_costs
from megapipe.config.states import expert_layout, state_layout
from megapipe.parallel.fp8 import describe as describe_fp8
from megapipe.parallel.precision import Precision
from megapipe.plan.partition import stage_text
from megapipe.plan.schedules import SCHEDULES
from megapipe.plan.simulate import Costs
from megapipe.train.meta_memory import (
    count_params,
    local_memory,
    memory_plan,
    model_params,
    rank_chunks,
)

DEVICE = "cuda"  # the dry run plans a training job: its activations are CUDA's kernels'


def rank_params(cfg: Config, pp_rank: int, tp_rank: int) -> tuple[int, int]:
    """(parameters held, layers held) by the rank at (pp_rank, tp_rank), over all its chunks."""
    chunks = rank_chunks(cfg, pp_rank, tp_rank)
    return count_params(chunks), sum(len(c.layers) for c in chunks)


def as_json(cfg: Config, device: str = DEVICE) -> dict:
    """`--dry-run --json`: the model's parameters, per (pp, tp) rank its parameters and bytes of
    weights (zero=3: its shard plus the two consecutive blocks gathered at most at once), grads
    while activations peak (full-size local grads; reducing every microbatch, as zero=3 does,
    the shard plus two blocks), grads held over the optimizer step (`grads_step_bytes`:
    zero>=2 the shard) and while the last backward's reduction runs
    (`grads_reducing_bytes`: local grads kept, send buffers, shards), optimizer state,
    activations at the peak in flight, the LM head's chunk transient on the ranks holding the
    head (`head_transient_bytes`, config/memory_head.py; 0 elsewhere), the largest working set
    of a layer's backward (`backward_bytes`, config/memory_backward.py), the activations that
    recompute.mode=offload keeps in host memory (`host_bytes`), and the peak: the larger
    of the two moments, weights + grads + optimizer + activations + the larger transient, or
    weights + grads_reducing + optimizer; and the largest peak. `device`: whose kernels' saved
    tensors (tests measure CPU runs); the head's chunks are sized by this machine's CUDA device
    where it has one (train/meta_memory.local_memory), else 256 rows."""
    plan = memory_plan(cfg, device, memory=local_memory(device))
    ranks = [
        {
            "pp": r.pp_rank,
            "tp": r.tp_rank,
            "params": r.params,
            "weights_bytes": int(r.weights_held + r.gathered),
            "grads_bytes": int(r.grads),
            "grads_step_bytes": int(r.step_grads),
            "grads_reducing_bytes": int(r.reducing),
            "optimizer_bytes": int(r.optimizer),
            "activations_bytes": int(r.activations),
            "head_transient_bytes": int(r.head_transient),
            "backward_bytes": int(r.backward),  # a layer backward's working set
            "peak_bytes": int(r.peak),
            "host_bytes": int(r.host),  # recompute.mode=offload's activations in host memory
        }
        for r in plan.ranks
    ]
    out = {"params": model_params(cfg), "ranks": ranks, "max_peak_bytes": int(plan.max)}
    if cfg.model.n_experts:  # config/memory_moe.moe_summary
        out["moe"] = moe_summary(cfg)
    return out


def describe(cfg: Config) -> str:
    p, d = cfg.parallel, cfg.derived
    lines = [
        f"mesh: pp={p.pp} dp={p.dp} cp={p.cp} tp={p.tp} (world size {d.world_size}; "
        "rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank)"
        + (f"; ep={p.ep}: ep consecutive dp ranks exchange tokens" if p.ep > 1 else ""),
        f"schedule: {p.schedule}, vpp={p.vpp}, microbatches={p.microbatches}, "
        f"micro_batch_size={d.micro_batch_size}, sequence_parallel={p.sequence_parallel}",
    ]
    if p.pp > 1:
        lines.append(describe_partition(cfg))
    plan = memory_plan(cfg, DEVICE, memory=local_memory(DEVICE))
    lines += [_rank_line(cfg, r) for r in plan.ranks]
    top = plan.rank(*plan.argmax)
    lines.append(
        f"max peak ~{_size(plan.max)} on pp={top.pp_rank} tp={top.tp_rank} "
        f"(of {len(plan.ranks)} (pp, tp) ranks; dp and cp replicas hold the same)"
    )
    lines += _notes(cfg)
    if cfg.model.n_experts:
        moe = moe_summary(cfg)
        lines.append(
            f"mixture of experts: {moe['moe_layers']} MoE layers, {moe['expert_params']:,} "
            f"expert parameters ({'all' if p.ep == 1 else f'1/{p.ep}'} held per rank"
            f"{_expert_states(cfg)}), "
            f"{moe['active_params']:,} active matmul parameters "
            f"per token (6N), dispatch buffers ~{_size(moe['dispatch_bytes_per_layer'])} per "
            "MoE layer per microbatch (in the activations)"
        )
    lines.append(f"training FLOPs per token: {flops_per_token(cfg):.3e}")
    return "\n".join(lines)


def _expert_states(cfg: Config) -> str:
    """Under parallel.ep with ZeRO: the routed experts' state layout over their replicas."""
    if cfg.parallel.ep == 1 or not cfg.parallel.zero:
        return ""
    e = expert_layout(cfg)
    where = "over the expert replicas" if e.d > 1 else "whole: one rank holds each expert"
    return f"; their states {e.text()} {where}"


def _notes(cfg: Config) -> list[str]:
    """How the per-rank memory lines were worked out, and what they leave out."""
    p = cfg.parallel
    if p.pp == 1:
        flight = "one microbatch at a time (no pipeline)"
    else:
        costs = "the given" if schedule_costs(cfg) != Costs() else "unit"
        flight = (
            f"the most microbatches {p.schedule} keeps in flight on it (simulated, {costs} costs)"
        )
    attention = {
        "fused": "a fused kernel keeping q, k, v, out and the log-sum-exp",
        "ring": "ring attention keeping q, k, v, out and the log-sum-exp",
        "a2a": "Ulysses' fused kernel keeping whole-sequence q, k, v at H/cp heads, out and lse",
        "hybrid": "a2a within cp_a2a ranks, then ring attention keeping q, k, v at H/cp_a2a heads, "
        "out and lse",
        "math": "the math fallback keeping the s² probabilities",
    }[attention_path(cfg, DEVICE)]
    if cfg.data.document_mask and (p.cp == 1 or p.cp_comm == "a2a"):  # memory_terms.py
        attention += ", plus the (b, 1, T, T) document mask (none with flash-attn varlen)"
    low = Precision.of(cfg.train).main_grads  # bf16 weights: float32 main params beside them
    weights = "bf16 weights 2" if low else "float32 weights 4"
    main = ", the float32 main params 4" if low else ""
    notes = [
        f"(memory per rank: {weights} B/parameter, float32 grads 4, AdamW's two float32 "
        f"moments 8{main}; parallel.zero shards over dp·cp the optimizer state (1), the grads "
        "too (2), the weights too (3, plus two consecutive blocks gathered: the running one and "
        "the prefetched one); grads at the peak are the full-size local ones the microbatches "
        "accumulate into (the reduction runs in the last backward; zero>=2 keeps only the shard "
        "after it); the peak is the largest of the activation peak, the last backward's "
        "reduction (local grads, send buffers and shards held at once) and, at zero 1-2, the "
        "optimizer step's end (its grads beside the weights' all-gather buffers); "
        "activations: what the model's "
        f"ops save for backward for one microbatch through the rank's chunks on {DEVICE} "
        f"(structure of Korthikanti et al. 2022; attention: {attention}), times {flight})",
        "(the LM head's chunk transient, on the ranks holding the head, is added to the "
        "activation peak: one chunk's logits and their casts, the chunk's grads and the "
        "head's input and weight grads, as the fused head + loss allocates them at its height; "
        "chunks sized by this machine's GPU memory, else 256 rows)",
    ]
    if p.pp > 1 and SCHEDULES[p.schedule].split_backward:
        notes.append(
            f"({p.schedule} splits backward: from B to W a microbatch keeps only its linears' "
            "inputs and output grads, queued for the weight-grad matmuls; the peak in flight "
            "weighs them by their bytes: a part of a microbatch, several under full recompute)"
        )
    if cfg.train.fp8 != "none":
        notes.append(f"({describe_fp8(cfg.train.fp8)})")
        blocks = [b for chunk in rank_blocks(cfg, 0) for b in chunk]
        split = p.pp > 1 and SCHEDULES[p.schedule].split_backward
        kept = layer_deferred(cfg, None, 0) if split else {}
        notes += fp8_summary(cfg, blocks, state_layout(cfg).weight_shards, kept)
    if p.schedule == "pipedream_async":
        notes.append(
            "(pipedream_async's weight snapshots, up to one per in-flight microbatch "
            "(PipeDream §3.3), are not counted)"
        )
    return notes


def _rank_line(cfg: Config, r: RankMemory) -> str:
    chunks = rank_chunks(cfg, r.pp_rank, r.tp_rank)
    layers = sum(len(c.layers) for c in chunks)
    held = " | ".join(stage_text(c.blocks, cfg.model.n_layers + 1) for c in chunks)
    return (
        f"pp={r.pp_rank} tp={r.tp_rank}: {r.params:,} parameters, {layers} layers "
        f"(chunks: {held}); weights {_size(r.weights_held + r.gathered)}, grads {_size(r.grads)}, "
        f"optimizer {_size(r.optimizer)} (zero={cfg.parallel.zero}; states {_layout(cfg)}), "
        f"activations ~{_size(r.activations_per_microbatch)} per microbatch, peak in flight "
        f"{_amount(r.inflight)} microbatches"
        + (f", LM head chunk transient ~{_size(r.head_transient)}" if r.head_transient else "")
        + f" -> peak ~{_size(r.peak)}"
        + (f"; offloaded to host ~{_size(r.host)}" if r.host else "")
    )


def _layout(cfg: Config) -> str:
    """The state bytes per parameter, noting a zero level with nothing to shard (dp·cp=1)."""
    alone = cfg.parallel.zero and state_layout(cfg).zero == 0
    return state_layout(cfg).text() + (", nothing to shard at dp·cp=1" if alone else "")


def _amount(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.2f} MiB"
