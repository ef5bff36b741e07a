"""Seq1F1B (Sun et al. 2024, "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for LLM
Training"): 1F1B over sequence segments, with FLOP-balanced segment lengths."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megapipe.plan.actions import FORWARD, FULL_BACKWARD, Action, Schedule, one_f_one_b_order


def seq1f1b(pp: int, microbatches: int, seq_segments: int) -> Schedule:
    """Seq1F1B §3.2: every (microbatch, segment) is a pipeline unit scheduled 1F1B-style.

    Forwards go segment 0..k−1 per microbatch; backwards go k−1..0, because segment i's K/V are
    read by later segments, whose backward must finish first (causal attention). The last rank
    must therefore see all k forwards of a microbatch before its first backward, so rank r warms
    up with (pp−r−1) + (k−1) segment forwards: peak memory (pp−r+k−1)/k microbatches.
    """
    k = seq_segments
    forwards = [Action(FORWARD, mb, 0, s) for mb in range(microbatches) for s in range(k)]
    backwards = [
        [Action(FULL_BACKWARD, mb, 0, s)] for mb in range(microbatches) for s in reversed(range(k))
    ]
    # warm-up: pp−r−1 as in 1F1B plus k−1 for the segments the first backward depends on
    return {r: one_f_one_b_order(forwards, backwards, (pp - r - 1) + (k - 1)) for r in range(pp)}


@dataclass(frozen=True)
class SegmentSplit:
    lengths: tuple[int, ...]
    flop_shares: tuple[float, ...]  # per segment, sums to 1: time scale for the simulator
    token_shares: tuple[float, ...]  # per segment, sums to 1: activation-memory scale


def segment_flops(lengths, params: float, layers: int, d_model: int) -> list[float]:
    """FLOPs(S_i) = 2·n_i·P + 2·L·n_i·(Σ_{j≤i} n_j)·d (Seq1F1B §3.3, after Hoffmann et al.)."""
    flops, prefix = [], 0
    for n in lengths:
        prefix += n
        flops.append(2 * n * params + 2 * layers * n * prefix * d_model)
    return flops


# Pure in its numbers and its result is frozen: the planner's bounds (perf/bounds.py) ask for
# the same splits thousands of times through config/memory_terms.
@functools.lru_cache(maxsize=4096)
def balanced_segments(
    seq_len: int, k: int, params: float, layers: int, d_model: int, granularity: int = 1
) -> SegmentSplit:
    """Integer segment lengths summing to ``seq_len`` with (nearly) equal FLOPs (Seq1F1B §3.3).

    Solve the continuous problem (equal FLOPs T per segment; each n_i is the positive root of
    2Ld·n² + (2P + 2Ld·N_{i−1})·n = T, bisection on T until Σ n_i = seq_len), then round the
    boundaries to multiples of ``granularity``.
    """
    if k < 1:
        raise ValueError(f"seq_segments must be >= 1, got {k}")
    if seq_len % granularity or seq_len < k * granularity:
        raise ValueError(
            f"seq_len {seq_len} must be a multiple of {granularity} and hold {k} segments"
        )
    a = 2.0 * layers * d_model

    def lengths_for(target: float) -> list[float]:
        out, prefix = [], 0.0
        for _ in range(k):
            b = 2.0 * params + a * prefix
            n = (2 * target / (b + (b * b + 4 * a * target) ** 0.5)) if target else 0.0
            out.append(n)
            prefix += n
        return out

    lo, hi = 0.0, float(sum(segment_flops([seq_len], params, layers, d_model)))
    for _ in range(200):  # bisection on the per-segment FLOPs target
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(lengths_for(mid)) < seq_len else (lo, mid)
    boundaries, prefix, previous = [], 0.0, 0
    for i, n in enumerate(lengths_for(hi)):
        prefix += n
        units = max(round(prefix / granularity), previous + 1)  # every segment non-empty
        units = min(units, seq_len // granularity - (k - 1 - i))
        boundaries.append(units * granularity)
        previous = units
    boundaries[-1] = seq_len
    lengths = tuple(b - a_ for a_, b in zip([0] + boundaries[:-1], boundaries))
    flops = segment_flops(lengths, params, layers, d_model)
    return SegmentSplit(
        lengths, tuple(f / sum(flops) for f in flops), tuple(n / seq_len for n in lengths)
    )
