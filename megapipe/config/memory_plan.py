"""The one memory model: per (pp, tp) rank weights, grads, AdamW state and activations, before
any job runs. The dry run (train/meta_memory.py), the planner's bounds (perf/bounds.py) and the
performance model (perf/memory_cache.py) all call these functions; none keeps terms of its own.

For each (pp, tp) coordinate (dp and cp replicas hold the same): weights and optimizer state by
train.params_dtype and parallel.zero (config/states.py: float32 4 + 4 + 8 B/param, bf16
weights 2 + 4 + 12, each kind sharded over dp·cp from its ZeRO level on), the grads as held
while activations peak (full-size local grads at every level: the reduction runs in the last
microbatch's backward) and while that reduction runs (send buffers, shards), zero=3's gathered
blocks, and the activations of one microbatch through the rank's chunks
(config/memory_terms.py's terms per block: what our ops save for backward, after Korthikanti et
al. 2022's structure) times the most microbatches the configured schedule keeps in flight on
the rank, replayed from the timeline of its action list (plan/simulate.py; a vpp chunk weighs
what it holds, a Seq1F1B segment its token share, and under Zero Bubble's B/W split a
microbatch keeps from B to W only its linears' inputs and output grads).

Pure arithmetic: the parameters of a chunk come from the caller (`ChunkParams`: train/meta_memory.py
counts a meta-device GPT, perf/memory_cache.py caches the same counts) and so may the timeline (perf
times the same schedule from its cached Dag). tests/test_memory_model.py holds the plan to what
real steps save.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from megapipe.config.flops import head_grad_in_forward, held_expert_params, segment_bounds
from megapipe.config.fp8_weights import (
    cast_bytes,
    fp8_params,
    held_weight_bytes,
    step_cast_bytes,
    weight_casts,
)
from megapipe.config.grad_buckets import ChunkUnits, grads_at_once
from megapipe.config.memory_backward import (
    chunk_backward_bytes,
    chunk_first_backward_bytes,
    weight_grads_queued,
)
from megapipe.config.memory_head import head_transient_bytes
from megapipe.config.memory_terms import (
    embedding_terms,
    head_deferred,
    head_terms,
    layer_deferred,
    layer_deferred_params,
    layer_terms,
    rope_table_bytes,
    segments,
)
from megapipe.config.muon_terms import MuonMatrix, is_muon, muon_optimizer_bytes
from megapipe.config.pipeline_split import placement_of, rank_blocks, schedule_costs, schedule_of
from megapipe.config.schema import Config, layer_mode
from megapipe.config.states import (
    FLOAT32,
    GRAD_BYTES,
    block_grads_bytes,
    expert_layout,
    gathered_bytes,
    grads_bytes,
    largest_pair,
    local_grads_bytes,
    local_grads_transient,
    main_grad_bytes,
    optimizer_bytes,
    reduction_bytes,
    send_width,
    state_layout,
    step_gather_bytes,
    weights_bytes,
    widened_grads_bytes,
)
from megapipe.plan.actions import FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD
from megapipe.plan.simulate import simulate

# (blocks, tp_rank) -> parameters of the chunk holding `blocks` on that tp rank
ChunkParams = Callable[[range, int], int]
MuonMatrices = Callable[[range, int], list[MuonMatrix]]  # (blocks, tp_rank) -> Muon parameters
# per pp rank, its actions in the simulated order: (kind, chunk, segment, start, end)
Timeline = dict[int, list[tuple[str, int, int, float, float]]]


@dataclass(frozen=True)
class RankMemory:
    """Bytes on the rank at (pp_rank, tp_rank)."""

    pp_rank: int
    tp_rank: int
    params: int  # parameters held, over all the rank's chunks (a tied table's copy included)
    weights: float  # held between steps (zero=3: the shard)
    grads: float  # while activations peak: the full-size local grads (config/states.py)
    optimizer: float
    chunk_activations: tuple[float, ...]  # one microbatch through each local chunk
    # peak in-flight microbatches, in units of one through all the rank's chunks (under a B/W
    # split, what a microbatch keeps from B to W weighs its bytes: peak_inflight)
    inflight: float
    gathered: float = 0.0  # zero=3: two consecutive blocks gathered (config/states.py)
    # zero=3: the last backward's two blocks (a chunk's first two), still gathered while the
    # reduction it ends with runs
    gathered_reducing: float = 0.0
    reducing: float = 0.0  # grads while the last backward's reduction runs (reduction_bytes)
    step_grads: float = 0.0  # grads held over the optimizer step (zero>=2: the shard)
    step_gather: float = 0.0  # zero 1-2: the weights' all-gather after the step (states.py)
    # bf16 main grads: their float32 copy the optimizer steps, freed before the gather
    step_widened: float = 0.0
    # peak in flight once the grads exist (peak_inflight's with_grads; bf16 weights' main
    # grads exist all along: = inflight)
    inflight_with_grads: float = 0.0
    # the fused LM head's chunk transient (config/memory_head.py) on the rank holding the head
    # block, on top of the activations (and grads) live when the head runs; 0 elsewhere
    head_transient: float = 0.0
    # zero=3: the blocks gathered while the head runs (the head and the layer before it, whose
    # gather its backward prefetches), in place of the rank's largest pair
    gathered_head: float = 0.0
    host: float = 0.0  # recompute.mode=offload: saved activations in host memory at the peak
    # grads reduced every microbatch: the shard sums only while the head runs (each grad action
    # ends with its buckets sent, parallel/data/zero2.py; the fused head's own grads are in its
    # transient); None: `grads`
    grads_at_head: float | None = None
    # the largest working set of a layer's backward on top of the activation peak
    # (config/memory_backward.chunk_backward_bytes over the rank's chunks)
    backward: float = 0.0
    # the same in the step's first backward, where float32 grads are made: with the grads of
    # the chunk's later blocks, beside every microbatch in flight (chunk_first_backward_bytes)
    backward_first: float = 0.0
    # B/W split with float32 grads: what the B passes make before the first W (the head's and
    # the embedding's weights, biases, norm gains: all but the layers' deferred linears,
    # config/memory_terms.layer_deferred_params), and the peak in flight once they exist
    # (peak_inflight from the first B or BW on)
    grads_in_b: float = 0.0
    inflight_with_b_grads: float = 0.0
    # train.fp8's weight casts kept from a step's first forward to its last backward
    # (config/fp8_weights.step_cast_bytes)
    casts: float = 0.0
    # train.fp8_params: by how much holding the FP8 weights as their casts changes `weights`
    # and `step_gather` (config/fp8_weights.held_weight_bytes; both <= 0)
    held_casts: float = 0.0
    held_gather: float = 0.0
    # tensors kept from step to step that are not state: RoPE's shared cos, sin tables
    # (config/memory_terms.rope_table_bytes) on a rank holding a layer
    buffers: float = 0.0
    # grads reduced every microbatch: by how much `grads` beside every saved activation
    # overstates the most of both live at once, the backward having freed some by the time
    # the grads are made (config/grad_buckets.grads_at_once)
    freed_at_grads: float = 0.0

    @property
    def activations_per_microbatch(self) -> float:
        return sum(self.chunk_activations)

    @property
    def activations(self) -> float:
        """Peak activation bytes: one microbatch's times the peak in flight."""
        return self.activations_per_microbatch * self.inflight

    @property
    def weights_held(self) -> float:
        """The weights as held between steps: under train.fp8_params the FP8 ones as casts."""
        return self.weights + self.held_casts

    @property
    def states(self) -> float:
        return self.weights_held + self.gathered + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        """The largest of: the activation peak, with the grads where they exist by then (else
        the most live once they do); on the head's rank the same with the LM head's chunk
        transient added (and zero=3's blocks gathered at the head); and the end of the last
        backward (weights, the grads while reducing, optimizer state; activations freed), and
        the optimizer step's end (the step's grads and zero 1-2's weight all-gather). The
        transient is added to the activation peak: exact where the head runs at that peak (no
        pipeline; 1F1B's and GPipe's last stage, whose in-flight microbatches are all live at
        the head's F and B), an upper bound elsewhere; with `grads_at_head` in place of the
        grads."""
        live = self.activations_per_microbatch * self.inflight_with_grads
        with_grads = self.grads + live - self.freed_at_grads
        head_grads = with_grads if self.grads_at_head is None else self.grads_at_head + live
        with_b = self.grads_in_b + self.activations_per_microbatch * self.inflight_with_b_grads
        weights = self.weights_held
        held = weights + self.gathered + self.optimizer + self.casts + self.buffers
        reducing = held - self.gathered + self.gathered_reducing + self.reducing
        at_head = held - self.gathered + self.gathered_head + self.head_transient
        at_backward = held + self.backward  # a layer backward's working set (memory_backward)
        top = max(
            at_backward + max(self.activations, with_grads, with_b),
            at_head + max(self.activations, head_grads, with_b),
            held + self.backward_first + self.activations,
        )
        after = max(self.step_widened, self.step_gather + self.held_gather)  # step, then gather
        stepping = weights + self.optimizer + self.step_grads + after + self.buffers
        return max(top, reducing, stepping)


@dataclass(frozen=True)
class MemoryPlan:
    """Every (pp, tp) rank's memory, pp-major; the largest peak and where it is."""

    ranks: tuple[RankMemory, ...]
    device: str  # the kernels the activations were worked out for: "cuda" or "cpu"

    @property
    def max(self) -> float:
        return max(r.peak for r in self.ranks)

    @property
    def argmax(self) -> tuple[int, int]:
        """(pp_rank, tp_rank) of the largest peak (the first such rank on a tie)."""
        top = max(self.ranks, key=lambda r: r.peak)
        return top.pp_rank, top.tp_rank

    def rank(self, pp_rank: int, tp_rank: int = 0) -> RankMemory:
        return next(r for r in self.ranks if (r.pp_rank, r.tp_rank) == (pp_rank, tp_rank))


def memory_plan(
    cfg: Config,
    device: str,
    chunk_params: ChunkParams,
    timeline: Timeline | None = None,
    memory: float | None = None,
    matrices: MuonMatrices | None = None,
    units: ChunkUnits | None = None,
) -> MemoryPlan:
    """Per (pp, tp) rank: weights, grads, optimizer state, activations per microbatch, peak
    in-flight microbatches and the peak (RankMemory), for a job running on `device`, with
    `chunk_params` counting a chunk's parameters, the schedule's `timeline` (default:
    unit_timeline) and `memory` bytes of device memory (the LM head's chunk size,
    config/memory_terms.head_chunk_rows: None, 256 rows). `matrices` lists a chunk's Muon
    parameters (train.optimizer=muon: its state, config/muon_terms.py), `units` a chunk's
    weight units (config/grad_buckets.py; default: each block one parameter)."""
    p = cfg.parallel
    inflight = peak_inflight(cfg, device, timeline)
    with_grads = peak_inflight(cfg, device, timeline, GRADS_MADE)
    with_b = peak_inflight(cfg, device, timeline, B_GRADS_MADE)
    ranks = []

    def saved(block: int) -> float:
        return chunk_activations(cfg, range(block, block + 1), device)

    for pp_rank in range(p.pp):
        held = rank_blocks(cfg, pp_rank)
        acts = tuple(chunk_activations(cfg, b, device) for b in held)
        head = rank_head_transient(cfg, held, device, memory)
        back = max(chunk_backward_bytes(cfg, b, device) for b in held)
        flight = (inflight[pp_rank], with_grads[pp_rank], with_b[pp_rank])
        for tp_rank in range(p.tp):
            r = complete_rank(
                cfg, (pp_rank, tp_rank), held, chunk_params,
                (units or blocks_as_units(chunk_params), saved),
                (acts, flight, head, back), device,
            )  # fmt: skip
            if matrices is not None and is_muon(cfg):
                mine = [m for b in held for m in matrices(b, tp_rank)]
                experts = sum(held_expert_params(cfg, b) for b in held)
                r = replace(r, optimizer=muon_optimizer_bytes(r.params, mine, cfg, experts))
            ranks.append(r)
    return MemoryPlan(tuple(ranks), device)


def complete_rank(
    cfg: Config,
    coord: tuple[int, int],
    held: list[range],
    chunk_params: ChunkParams,
    grads: tuple,
    stage: tuple,
    device: str,
) -> RankMemory:
    """The RankMemory of the rank at `coord` (pp, tp) holding the chunks `held`, counting a
    chunk's parameters with `chunk_params`; `grads`: (a chunk's weight units, a block's saved
    bytes) for grads_at_once; `stage`: what its tp ranks share, (activations per chunk for one
    microbatch, the microbatches in flight (peak, once the grads exist, once B's do), the LM
    head's transient, the largest backward working set). Every caller that plans a rank's
    memory (memory_plan, perf/bounds.Bounds.memory) builds it here."""
    tp_rank = coord[1]
    acts, flight, head, back = stage
    n = sum(chunk_params(b, tp_rank) for b in held)
    gathered = gathered_pair(cfg, held, tp_rank, chunk_params)
    pair = grads_at_once(cfg, held, tp_rank, *grads)
    experts = sum(held_expert_params(cfg, b) for b in held)
    at_head = (head, head_gathered(cfg, held, tp_rank, chunk_params) if head else 0.0)
    r = rank_memory(cfg, coord, n, gathered, acts, flight, experts, at_head, pair)
    r = with_b_grads(cfg, r, rank_deferred_params(cfg, held), flight[2])
    extra = rank_extras(cfg, held, tp_rank, chunk_params, device, flight[0])
    return replace(r, backward=back, **extra)


def rank_extras(
    cfg: Config,
    held: list[range],
    tp_rank: int,
    chunk_params: ChunkParams,
    device: str,
    inflight: float,
) -> dict[str, float]:
    """A rank's RankMemory fields beyond rank_memory's, for the rank holding the chunks `held`
    at `tp_rank` with `inflight` microbatches at most: the offloaded activations in host
    memory, FP8's weight casts kept over the step, RoPE's shared tables and the first
    backward's working set. Every
    caller that completes a rank's memory (memory_plan, perf/bounds.Bounds.memory) asks here."""
    host = sum(chunk_host_activations(cfg, b, device) for b in held)
    blocks = [b for bs in held for b in bs]
    held_casts, held_gather = held_weight_bytes(cfg, blocks)
    return {
        "host": host * inflight,
        "casts": step_cast_bytes(cfg, blocks),
        "held_casts": held_casts,
        "held_gather": held_gather,
        "buffers": rope_table_bytes(cfg) if _attends(cfg, held) else 0.0,
        "backward_first": first_backward(cfg, held, tp_rank, chunk_params, device),
    }


def _attends(cfg: Config, held: list[range]) -> bool:
    """The chunks `held` run attention: a transformer layer, or the head's MTP depths."""
    m = cfg.model
    return any(1 <= b <= m.n_layers or (b == m.n_layers + 1 and m.mtp_layers) for bs in held
               for b in bs)  # fmt: skip


def rank_head_transient(
    cfg: Config, held: list[range], device: str, memory: float | None = None
) -> float:
    """config/memory_head.head_transient_bytes on a rank holding the chunks `held` where one
    of them holds the head block (n_layers + 1), else 0."""
    if not any(cfg.model.n_layers + 1 in blocks for blocks in held):
        return 0.0
    return head_transient_bytes(cfg, device, memory)


def head_gathered(cfg: Config, held: list[range], tp_rank: int, chunk_params: ChunkParams):
    """zero=3's gathered weights while the LM head runs on a rank holding the chunks `held`:
    the head block and the layer before it in its chunk (its backward prefetches that layer's
    gather); 0 at other levels."""
    last = cfg.model.n_layers + 1
    blocks = [range(max(b.start, last - 1), last + 1) for b in held if last in b]
    return rank_gathered(cfg, blocks, tp_rank, chunk_params)


def rank_memory(
    cfg: Config,
    coord: tuple[int, int],
    n: int,
    gathered: tuple,
    acts: tuple,
    inflight: tuple,
    experts: int = 0,
    head: tuple[float, float] = (0.0, 0.0),
    pair: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> RankMemory:
    """The RankMemory of the rank at `coord` (pp, tp) holding `n` parameters, `gathered` zero=3
    bytes (at most at once; while the last backward reduces: its chunks' first blocks), `acts`
    per chunk for one microbatch and `inflight` microbatches at most (peak_inflight: in all, and
    once the grads exist); `experts` of the `n` are routed experts' (their state sharded over
    the expert replicas: config/states.expert_replicas); `head` the LM head's chunk transient
    where the rank holds it and zero=3's bytes gathered then (rank_head_transient,
    head_gathered); `pair` the parameters whose full-size grads are made and in flight at
    most at once when they are reduced every microbatch (config/grad_buckets.grads_at_once)."""
    persist = state_layout(cfg).weight != FLOAT32  # bf16 weights: main grads made at build
    if local_grads_transient(cfg):  # the shard sum, and a unit's grads and buckets in flight
        d = min(state_layout(cfg).d, expert_layout(cfg).d) if experts else state_layout(cfg).d
        grad, wire = main_grad_bytes(cfg), send_width(cfg)
        local = grads_bytes(n, cfg, experts) + block_grads_bytes(pair[:2], 0, grad, wire)
        reducing = grads_bytes(n, cfg, experts) + block_grads_bytes(pair[:2], d, grad, wire)
        persist = True  # some grads exist from the first backward on
    else:
        local, reducing = local_grads_bytes(n, cfg), reduction_bytes(n, cfg, experts)
    if weight_casts(cfg) == "held":  # FP8 weights' buckets, a layer's each, launch as that
        reducing += sum(acts)  # layer's last backward ends: the rest of it still live beside
    return RankMemory(
        pp_rank=coord[0],
        tp_rank=coord[1],
        params=n,
        weights=weights_bytes(n, cfg, experts),
        grads=local,
        optimizer=optimizer_bytes(n, cfg, experts),
        chunk_activations=acts,
        inflight=inflight[0],
        inflight_with_grads=inflight[0] if persist else inflight[1],
        gathered=gathered[0],
        gathered_reducing=gathered[1],
        reducing=reducing,
        step_grads=grads_bytes(n, cfg, experts),
        step_gather=step_gather_bytes(n, cfg, experts),
        step_widened=widened_grads_bytes(n, cfg, experts),
        head_transient=head[0],
        gathered_head=head[1],
        grads_at_head=grads_bytes(n, cfg, experts) if local_grads_transient(cfg) else None,
        freed_at_grads=pair[2],
    )


def first_backward(
    cfg: Config, held: list[range], tp_rank: int, chunk_params: ChunkParams, device: str
) -> float:
    """RankMemory.backward_first of the rank holding the chunks `held`: where its first
    backward makes float32 grads (float32 weights, reduced once a step, no B/W split, whose B
    makes only some: with_b_grads), else 0 (bf16 main grads exist all along: `grads`)."""
    made_in_backward = state_layout(cfg).weight == FLOAT32 and not local_grads_transient(cfg)
    if not made_in_backward or weight_grads_queued(cfg):
        return 0.0
    head = cfg.model.n_layers + 1  # its grads made in forward are the head terms' own
    head_counted = head_grad_in_forward(cfg)

    def grads(block: int) -> float:
        if block == head and head_counted:
            return 0.0
        return GRAD_BYTES * chunk_params(range(block, block + 1), tp_rank)

    return max(chunk_first_backward_bytes(cfg, b, device, grads) for b in held)


def rank_deferred_params(cfg: Config, held: list[range]) -> int:
    """The parameters of the layers in the chunks `held` whose grads W makes under a B/W split
    (config/memory_terms.layer_deferred_params; MTP's depths in the head's block left out)."""
    layers = range(1, cfg.model.n_layers + 1)
    return sum(layer_deferred_params(cfg, b - 1) for blocks in held for b in blocks if b in layers)


def with_b_grads(cfg: Config, r: RankMemory, deferred: int, inflight: float) -> RankMemory:
    """`r` with the grads a B/W split's B passes make before the first W (RankMemory
    .grads_in_b: all of `r`'s parameters but the `deferred` ones), live with `inflight`
    microbatches (peak_inflight from the first B or BW on): float32 grads made in backward
    only (bf16 weights' main grads exist all along; reduced every microbatch, a block's at a
    time: the grads term's own)."""
    persist = state_layout(cfg).weight != FLOAT32 or local_grads_transient(cfg)
    if not weight_grads_queued(cfg) or persist:
        return r
    made = local_grads_bytes(r.params - deferred, cfg)
    return replace(r, grads_in_b=made, inflight_with_b_grads=inflight)


def rank_gathered(cfg: Config, held: list[range], tp_rank: int, chunk_params: ChunkParams):
    """zero=3's gathered weights on a rank holding the chunks `held` (config/states
    .gathered_bytes of its blocks' parameters; 0 at other levels, without counting them);
    train.fp8's in one byte, with the casts of the shards kept (config/fp8_weights.py)."""
    s = state_layout(cfg)
    if s.weight_shards == 1:
        return 0.0
    blocks = [[chunk_params(range(b, b + 1), tp_rank) for b in chunk] for chunk in held]
    if cfg.train.fp8 == "none":
        return gathered_bytes(blocks, cfg)
    fp8 = [[fp8_params(cfg, [b]) for b in chunk] for chunk in held]
    held_bytes = [[(n - f) * s.weight + f for n, f in zip(*pair)] for pair in zip(blocks, fp8)]
    kept = cast_bytes(cfg, [b for chunk in held for b in chunk], s.weight_shards)
    return largest_pair(held_bytes) + kept


def blocks_as_units(chunk_params: ChunkParams) -> ChunkUnits:
    """Each block of a chunk as one weight unit of one parameter (config/grad_buckets.py),
    for callers that count parameters only: a bucket then holds whole blocks."""

    def units(blocks: range, tp_rank: int) -> tuple[list[tuple[int, ...]], None]:
        return [(chunk_params(range(b, b + 1), tp_rank),) for b in blocks], None

    return units


def gathered_pair(cfg: Config, held: list[range], tp_rank: int, chunk_params: ChunkParams):
    """zero=3's gathered weights (at most at once; while the last backward's reduction runs:
    the two blocks it ends with, the first two of the rank's first chunk, whose buckets are
    still being reduced) for rank_memory."""
    first = [range(held[0].start, min(held[0].start + 2, held[0].stop))] if held else []
    return (
        rank_gathered(cfg, held, tp_rank, chunk_params),
        rank_gathered(cfg, first, tp_rank, chunk_params),
    )


@dataclass(frozen=True)
class BlockBytesKey:
    """What block_activations and block_deferred read of a config besides the block, the
    device and the segment: the model, dtypes and recompute (a layer's mode: block_role), one
    rank's share of a microbatch (micro-batch size, tp, cp and its attention variant, sp), the
    Seq1F1B segments and whether a pipeline runs (config/memory_terms.head_grad_in_forward).
    Callers that cache bytes per block or run of blocks key them by it."""

    model: tuple
    dtype: str
    params_dtype: str  # bf16 weights: no autocast weight copies saved
    recompute: tuple
    micro_batch_size: int
    tp: int
    cp: int
    cp_comm: tuple[str, int]  # parallel.cp_comm, cp_a2a: what the attention saves (a2a, hybrid)
    sequence_parallel: bool
    segments: tuple[tuple[int, int], ...]
    pipeline: bool
    # FP8 (train.fp8, fp8_keep_bf16): what its linears and experts keep; under the tp ring
    # (parallel.tp_overlap) its column inputs as one-byte payloads (config/tp_widths)
    fp8: tuple[str, str, bool] = ("none", "", False)

    @staticmethod
    def of(cfg: Config) -> BlockBytesKey:
        p, t = cfg.parallel, cfg.train
        return BlockBytesKey(
            _values(cfg.model), t.dtype, t.params_dtype, _values(cfg.recompute),
            cfg.derived.micro_batch_size, p.tp, p.cp, (p.cp_comm, p.cp_a2a), p.sequence_parallel,
            tuple(segment_bounds(cfg)), p.pp > 1, (t.fp8, t.fp8_keep_bf16, p.tp_overlap),
        )  # fmt: skip


def _values(section: object) -> tuple:
    """A config section's field values in order (dataclasses.astuple deep-copies each: slow
    where the planner builds a key per stage)."""
    return tuple(vars(section).values())


def block_role(cfg: Config, block: int) -> str:
    """Which terms a block's bytes take: "embedding" (block 0), "head" (n_layers + 1), or a
    layer's recompute mode (recompute.layers leaves later layers at "none"); layers of one
    mode save alike."""
    if block == 0:
        return "embedding"
    if block == cfg.model.n_layers + 1:
        return "head"
    return layer_mode(cfg.recompute, block - 1)


def block_activations(cfg: Config, block: int, device: str, segment: int | None) -> float:
    """Bytes one microbatch (or Seq1F1B segment; None: the whole sequence) leaves saved in
    `block`, by its block_role: the embedding's, a layer's at its recompute mode, the head's.
    A chunk's input is saved by its first block (a layer's norm1)."""
    role = block_role(cfg, block)
    if role == "embedding":
        terms = embedding_terms(cfg, device, segment)
    elif role == "head":
        terms = head_terms(cfg, device, segment)
    else:
        terms = layer_terms(cfg, role, device, segment, block - 1)
    return sum(terms.values())


def segment_activations(cfg: Config, blocks: range, device: str, segment: int | None) -> float:
    """block_activations over `blocks`, for one segment (None: the whole sequence)."""
    total = 0.0
    for b in blocks:
        total += block_activations(cfg, b, device, segment)
    return total


def chunk_activations(cfg: Config, blocks: range, device: str = "cuda") -> float:
    """Bytes one microbatch leaves saved for backward in the chunk holding `blocks` (over all
    its Seq1F1B segments)."""
    return sum(segment_activations(cfg, blocks, device, i) for i in segments(cfg))


def chunk_host_activations(cfg: Config, blocks: range, device: str = "cuda") -> float:
    """Bytes one microbatch moves to host memory in the chunk holding `blocks`: what its
    offloaded layers (block_role "offload") would have saved on the device at mode "none"."""
    offloaded = [b for b in blocks if block_role(cfg, b) == "offload"]
    return sum(
        sum(layer_terms(cfg, "none", device, i, b - 1).values())
        for b in offloaded
        for i in segments(cfg)
    )


def block_deferred(cfg: Config, block: int, segment: int | None = None) -> float:
    """Bytes one microbatch (or segment) keeps in `block` from its B to its W under a B/W
    split, by its block_role (the embedding: none; any recompute mode alike)."""
    role = block_role(cfg, block)
    if role == "embedding":
        return 0
    if role == "head":
        return sum(head_deferred(cfg, segment).values())
    return sum(layer_deferred(cfg, segment, block - 1).values())


def chunk_deferred(cfg: Config, blocks: range, segment: int | None = None) -> float:
    """Bytes one microbatch (or segment) keeps in the chunk from its B to its W under a B/W
    split: the linears' inputs and output grads queued for the weight-grad matmuls."""
    return float(sum(block_deferred(cfg, b, segment) for b in blocks if b > 0))


def live_change(kind: str, size: float, kept: float) -> float:
    """How an action changes its rank's live activations: F allocates the microbatch's part
    (`size`); BW frees it; under a B/W split B frees all but what W needs (`kept`), W that."""
    if kind == FORWARD:
        return size
    if kind == INPUT_GRAD:
        return kept - size
    if kind == WEIGHT_GRAD:
        return -kept
    assert kind == FULL_BACKWARD, kind
    return -size


def rank_peak(
    events: Iterable[tuple[float, float]],
    after: float = -math.inf,
    at: set[float] | None = None,
) -> float:
    """The peak of the running sum of (time, change) events in time order, frees before
    allocations at equal times (F allocates at its start, the others free at their end);
    counted from time `after` on, and only at the times `at` where given (once all of that
    time's events are in: the live bytes while an action starting then runs)."""
    live = peak = 0.0
    ordered = sorted(events)
    for i, (time, delta) in enumerate(ordered):
        live += delta
        last_at_time = i + 1 == len(ordered) or ordered[i + 1][0] != time
        if time >= after and (at is None or (time in at and last_at_time)):
            peak = max(peak, live)
    return round(peak, 9)


def unit_timeline(cfg: Config) -> Timeline:
    """The configured schedule timed by plan/simulate.py with its schedule_costs, per rank."""
    out: Timeline = {r: [] for r in range(cfg.parallel.pp)}
    sim = simulate(schedule_of(cfg), schedule_costs(cfg), placement_of(cfg))
    for r, a, start, end in sim.timeline:
        out[r].append((a.kind, a.chunk, a.seg, start, end))
    return out


GRADS_MADE = (FULL_BACKWARD, WEIGHT_GRAD)  # every weight's grad exists once one ran
B_GRADS_MADE = (FULL_BACKWARD, INPUT_GRAD)  # a B/W split's B makes all but the deferred ones
# the actions whose moments the B grads' peak is taken at: the F, B or BW running (a layer's
# backward working set and the head's transient are theirs; a W's is its own weight grad)
B_GRADS_AT = (FORWARD, INPUT_GRAD, FULL_BACKWARD)


def peak_inflight(
    cfg: Config,
    device: str = "cuda",
    timeline: Timeline | None = None,
    grads_from: tuple[str, ...] = (),
) -> list:
    """Per pp rank, the peak of its live activation bytes over the schedule's `timeline`
    (default unit_timeline), in units of one microbatch through the rank's whole share: how
    many microbatches it holds at once.

    A microbatch's part on chunk c (under Seq1F1B each segment's own, the later ones reading
    the earlier segments' K/V) is live from the start of its F until live_change frees it.
    E.g. 1F1B: pp−r on rank r (warm-up of pp−r−1 forwards, Narayanan et al. 2021 §2.2);
    GPipe: all m; ZB-H2 holds more than 1F1B to fill the bubble (Qi et al. 2023 §3), but only
    the deferred weight-grad inputs between B and W.

    `grads_from`: the peak once the rank's first weight grads exist, from the end of its first
    action of those kinds on (GRADS_MADE: every weight's, from the first BW or W; float32
    weights' grads are made by the first backward and dropped after the step; B_GRADS_MADE:
    a B/W split's B grads, from the first B or BW, counted while an F, B or BW runs: the
    moments a backward's working set or the head's transient add to); 0 where nothing is
    live then. 1F1B's steady state holds as many as its warm-up;
    GPipe one fewer; without a pipeline one microbatch when there is a second.
    """
    p = cfg.parallel
    if p.pp == 1:  # no pipeline: the microbatches run one after another
        return [1.0 if p.microbatches > 1 or not grads_from else 0.0]
    timeline = unit_timeline(cfg) if timeline is None else timeline
    peaks = []
    for rank in range(p.pp):
        size, kept = {}, {}  # (chunk, segment index) -> bytes
        for c, blocks in enumerate(rank_blocks(cfg, rank)):
            for k, i in enumerate(segments(cfg)):
                size[c, k] = segment_activations(cfg, blocks, device, i)
                kept[c, k] = chunk_deferred(cfg, blocks, i)
        unit = sum(size.values()) or 1.0  # one microbatch through the rank's whole share
        grads = [end for kind, *_, end in timeline[rank] if kind in grads_from]
        at = None
        if grads_from == B_GRADS_MADE:
            at = {start for kind, *_, start, _ in timeline[rank] if kind in B_GRADS_AT}
        peaks.append(
            rank_peak(
                (
                    (
                        start if kind == FORWARD else end,
                        live_change(kind, size[c, k] / unit, kept[c, k] / unit),
                    )
                    for kind, c, k, start, end in timeline[rank]
                ),
                min(grads, default=math.inf) if grads_from else -math.inf,
                at,
            )
        )
    return peaks
