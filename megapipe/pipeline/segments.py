"""Seq1F1B's sequence segments at run time: the K/V of earlier segments, kept per layer.

Seq1F1B (Sun et al. 2024, "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for LLM
Training", §3) cuts each microbatch's sequence into k segments [s_i, e_i) and pipelines the
(microbatch, segment) units. Under causal attention the queries of segment i (global positions
[s_i, e_i)) see the keys [0, e_i): their own and those of every earlier segment of the same
microbatch. So each attention layer keeps, per (microbatch, chunk), the K/V (after RoPE) that
each segment's forward produced, for the segments after it.

Gradients through the kept K/V (the schedule runs segment backwards k−1..0, seq1f1b.py):
  - forward of segment j keeps its k_j, v_j (in j's autograd graph) with detached leaf copies
    that require grad;
  - forward of segment i > j attends over cat(leaves of segments < i, own k_i), so the
    backward of i accumulates dK_j, dV_j into the leaves' .grad;
  - backward of segment j is one autograd.backward over the roots [out_j, k_j, v_j of every
    layer] with [grad_out_j, leaf grads]: what later segments sent into j's K/V flows through
    j's own graph, and the parameter grads sum to those of one full-sequence backward.
The scope entered around a backward makes a full-recompute rerun of the layer read the same
leaves and keep nothing. The active scope is process state, not a context variable, as in
weight_grad.py: autograd may run backward on another thread. Under sequence parallelism a
segment is a multiple of tp tokens, split over tp like a whole sequence; segments under cp (ring
attention) are refused by the config checks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megapipe.pipeline.outputs import backward_from

_active: list = [None]  # the _Scope of the segment forward/backward now running, or None


def active_scope() -> _Scope | None:
    """What Attention.forward reads: None outside a Seq1F1B segment (the unsegmented path)."""
    return _active[0]


@dataclass
class _Kept:
    """One layer's K/V of one segment: graph tensors (backward roots) and leaves (read later)."""

    k: torch.Tensor  # (B, Hkv/tp, n_j, hd)
    v: torch.Tensor
    k_leaf: torch.Tensor
    v_leaf: torch.Tensor


@dataclass
class _Scope:
    store: SegmentKV
    segment: int
    keep: bool  # forward: keep this segment's K/V; backward (recompute): only read

    def extend(self, layer: object, k: torch.Tensor, v: torch.Tensor):
        """(B, Hkv, n_i, hd) K/V of this segment -> (B, Hkv, e_i, hd) with earlier segments'."""
        kept = self.store.layers.setdefault(layer, {})
        if self.keep:
            kept[self.segment] = _Kept(k, v, _leaf(k), _leaf(v))
        earlier = [kept[j] for j in range(self.segment)]
        if not earlier:
            return k, v
        return (torch.cat([e.k_leaf for e in earlier] + [k], dim=2),
                torch.cat([e.v_leaf for e in earlier] + [v], dim=2))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


class SegmentKV:
    """The kept K/V of one (microbatch, chunk): {attention layer: {segment: _Kept}}."""

    def __init__(self) -> None:
        self.layers: dict[object, dict[int, _Kept]] = {}

    @contextlib.contextmanager
    def scope(self, segment: int, keep: bool):
        """Within: attention layers extend their K/V with this store's earlier segments."""
        previous, _active[0] = _active[0], _Scope(self, segment, keep)
        try:
            yield
        finally:
            _active[0] = previous

    def backward(self, segment: int, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Backward of `segment` from its output and its K/V (the grads later segments left)."""
        roots, grads = [out], [grad]
        for kept in self.layers.values():
            e = kept.pop(segment)
            for t, leaf in ((e.k, e.k_leaf), (e.v, e.v_leaf)):
                if leaf.grad is not None:  # None for the last segment: nothing read it
                    roots.append(t)
                    grads.append(leaf.grad)
        with self.scope(segment, keep=False):
            backward_from(roots, grads)

    @property
    def empty(self) -> bool:
        return not any(self.layers.values())


def segment_bounds(cfg) -> list[tuple[int, int]]:
    """[(s_i, e_i)] of the config's Seq1F1B segments: FLOP-balanced (Seq1F1B §3.3), lengths a
    multiple of tp under sequence parallelism; [(0, T)] when unsegmented."""
    from megapipe.metrics import matmul_params
    from megapipe.pipeline.seq1f1b import balanced_segments

    m, p = cfg.model, cfg.parallel
    if p.schedule != "seq1f1b" or p.seq_segments == 1:
        return [(0, m.seq_len)]
    granularity = p.tp if p.sequence_parallel else 1
    split = balanced_segments(m.seq_len, p.seq_segments, matmul_params(cfg), m.n_layers,
                              m.d_model, granularity)
    ends = [sum(split.lengths[: i + 1]) for i in range(len(split.lengths))]
    return list(zip([0, *ends[:-1]], ends))
