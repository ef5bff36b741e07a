"""Memory per rank of a config, before any job runs: weights, grads, AdamW state and activations.

For each (pp, tp) coordinate (dp and cp replicas hold the same): float32 weights and grads
(4 B/param each: the model keeps float32 weights, bf16 is autocast only), AdamW's two moments
(8 B/param, or 8/R under the distributed optimizer, config/memory.py `optimizer_bytes`), and
the activations of one microbatch through the rank's chunks (config/memory.py's terms per
block: what our ops save for backward, after Korthikanti et al. 2022's structure) times the
most microbatches the configured schedule keeps in flight on the rank, from the timeline of its
action list in the planner's simulator (plan/simulate.py; a vpp chunk weighs what it holds, a
Seq1F1B segment its token share, and under Zero Bubble's B/W split a microbatch keeps from B to
W only its linears' inputs and output grads). Tools call `memory_plan`; `train.py --dry-run`
prints it. tests/test_memory_model.py runs real steps and holds each rank's live saved bytes
to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.config import Config
from megapipe.config.memory import (
    GRAD_BYTES,
    WEIGHT_BYTES,
    embedding_terms,
    head_deferred,
    head_terms,
    layer_deferred,
    layer_terms,
    optimizer_bytes,
    segments,
)
from megapipe.config.stages import placement_of, rank_blocks, schedule_costs, schedule_of
from megapipe.parallel.recompute import layer_mode
from megapipe.parallel.tensor.sharding import TPInfo
from megapipe.plan.actions import FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD
from megapipe.plan.simulate import simulate
from models.gpt import GPT


@dataclass(frozen=True)
class RankMemory:
    """Bytes on the rank at (pp_rank, tp_rank)."""

    pp_rank: int
    tp_rank: int
    params: int  # parameters held, over all the rank's chunks (a tied table's copy included)
    weights: float
    grads: float
    optimizer: float
    chunk_activations: tuple[float, ...]  # one microbatch through each local chunk
    # peak in-flight microbatches, in units of one through all the rank's chunks (under a B/W
    # split, what a microbatch keeps from B to W weighs its bytes: peak_inflight)
    inflight: float

    @property
    def activations_per_microbatch(self) -> float:
        return sum(self.chunk_activations)

    @property
    def activations(self) -> float:
        """Peak activation bytes: one microbatch's times the peak in flight."""
        return self.activations_per_microbatch * self.inflight

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.states + self.activations


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


def memory_plan(cfg: Config, device: str = "cuda") -> MemoryPlan:
    """Per (pp, tp) rank: weights, grads, optimizer state, activations per microbatch, peak
    in-flight microbatches and the peak (RankMemory), for a job running on `device`."""
    p = cfg.parallel
    inflight = peak_inflight(cfg, device)
    ranks = []
    for pp_rank in range(p.pp):
        acts = tuple(chunk_activations(cfg, b, device) for b in rank_blocks(cfg, pp_rank))
        for tp_rank in range(p.tp):
            n = count_params(rank_chunks(cfg, pp_rank, tp_rank))
            ranks.append(
                RankMemory(
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    params=n,
                    weights=n * WEIGHT_BYTES,
                    grads=n * GRAD_BYTES,
                    optimizer=optimizer_bytes(n, cfg),
                    chunk_activations=acts,
                    inflight=inflight[pp_rank],
                )
            )
    return MemoryPlan(tuple(ranks), device)


def chunk_activations(cfg: Config, blocks: range, device: str = "cuda") -> float:
    """Bytes one microbatch leaves saved for backward in the chunk holding `blocks` (over all
    its Seq1F1B segments)."""
    return sum(_segment_activations(cfg, blocks, device, i) for i in segments(cfg))


def _segment_activations(cfg: Config, blocks: range, device: str, segment: int | None) -> float:
    """The embedding's, each layer's at its recompute mode (recompute.layers leaves later
    layers at "none"), the head's, for one segment (None: the whole sequence). A chunk's input
    is saved by its first block (a layer's norm1)."""
    head = cfg.model.n_layers + 1
    total = 0.0
    for b in blocks:
        if b == 0:
            terms = embedding_terms(cfg, device, segment)
        elif b == head:
            terms = head_terms(cfg, device, segment)
        else:
            terms = layer_terms(cfg, layer_mode(cfg.recompute, b - 1), device, segment)
        total += sum(terms.values())
    return total


def chunk_deferred(cfg: Config, blocks: range, segment: int | None = None) -> float:
    """Bytes one microbatch (or segment) keeps in the chunk from its B to its W under a B/W
    split: the linears' inputs and output grads queued for the weight-grad matmuls."""
    head = cfg.model.n_layers + 1
    terms = [
        head_deferred(cfg, segment) if b == head else layer_deferred(cfg, segment)
        for b in blocks
        if b > 0
    ]
    return float(sum(sum(t.values()) for t in terms))


def peak_inflight(cfg: Config, device: str = "cuda") -> list[float]:
    """Per pp rank, the peak of its live activation bytes over the simulated schedule, in units
    of one microbatch through the rank's whole share: how many microbatches it holds at once.

    A microbatch's part on chunk c (its chunk_activations; under Seq1F1B each segment's own,
    the later ones reading the earlier segments' K/V) is live from the start of its F; a BW
    frees it; under a B/W split (Zero Bubble) B frees all but chunk_deferred, which W frees.
    The order is the rank's action list, timed by plan/simulate.py with the schedule's costs.
    E.g. 1F1B: pp−r on rank r (warm-up of pp−r−1 forwards, Narayanan et al. 2021 §2.2);
    GPipe: all m; ZB-H2 holds more than 1F1B to fill the bubble (Qi et al. 2023 §3), but only
    the deferred weight-grad inputs between B and W.
    """
    p = cfg.parallel
    if p.pp == 1:  # no pipeline: the microbatches run one after another
        return [1.0]
    timeline = simulate(schedule_of(cfg), schedule_costs(cfg), placement_of(cfg)).timeline
    peaks = []
    for rank in range(p.pp):
        chunks = rank_blocks(cfg, rank)
        size, kept = {}, {}  # (chunk, segment index) -> bytes
        for c, blocks in enumerate(chunks):
            for k, i in enumerate(segments(cfg)):
                size[c, k] = _segment_activations(cfg, blocks, device, i)
                kept[c, k] = chunk_deferred(cfg, blocks, i)
        unit = sum(size.values()) or 1.0  # one microbatch through the rank's whole share
        events = [
            _change(a.kind, start, end, size[a.chunk, a.seg] / unit, kept[a.chunk, a.seg] / unit)
            for r, a, start, end in timeline
            if r == rank
        ]
        live = peak = 0.0
        for _, delta in sorted(events):  # frees sort before allocations at equal times
            live += delta
            peak = max(peak, live)
        peaks.append(round(peak, 9))
    return peaks


def _change(kind: str, start: float, end: float, size: float, kept: float) -> tuple[float, float]:
    """(time, change of live activations) of one action: F allocates at its start; BW frees at
    its end; B frees all but what W needs (`kept`), W frees that."""
    if kind == FORWARD:
        return start, size
    if kind == INPUT_GRAD:
        return end, kept - size
    if kind == WEIGHT_GRAD:
        return end, -kept
    assert kind == FULL_BACKWARD, kind
    return end, -size


def rank_chunks(cfg: Config, pp_rank: int, tp_rank: int) -> list[GPT]:
    """The meta-device chunks of the rank at (pp_rank, tp_rank), in local chunk order."""
    tp = TPInfo(cfg.parallel.tp, tp_rank, None, cfg.parallel.sequence_parallel)
    with torch.device("meta"):
        return [
            GPT(cfg.model, blocks=blocks, seed=cfg.train.seed, tp=tp, init=False)
            for blocks in rank_blocks(cfg, pp_rank)
        ]


def count_params(chunks: list[GPT]) -> int:
    return sum(q.numel() for c in chunks for q in c.parameters())
