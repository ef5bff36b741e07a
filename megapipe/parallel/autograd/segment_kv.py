"""Seq1F1B's sequence segments at run time: the K/V of earlier segments, kept per layer.

Seq1F1B (Sun et al. 2024, "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for LLM
Training", §3) cuts each microbatch's sequence into k segments [s_i, e_i) and pipelines the
(microbatch, segment) units. Under causal attention the queries of segment i (global positions
[s_i, e_i)) see the keys [0, e_i): their own and those of every earlier segment of the same
microbatch. So each attention layer keeps, per (microbatch, chunk), the K/V (after RoPE) that
each segment's forward produced, for the segments after it.

Gradients through the kept K/V (the schedule runs segment backwards k−1..0, plan/seq1f1b.py):
  - forward of segment j keeps its k_j, v_j (in j's autograd graph) with detached leaf copies
    that require grad;
  - forward of segment i > j attends over cat(leaves of segments < i, own k_i), so the
    backward of i accumulates dK_j, dV_j into the leaves' .grad;
  - backward of segment j is one autograd.backward over the roots [out_j, k_j, v_j of every
    layer] with [grad_out_j, leaf grads]: what later segments sent into j's K/V flows through
    j's own graph, and the parameter grads sum to those of one full-sequence backward.
The runtime passes a segment's `SegmentScope` to the model's forward as an explicit argument
(`GPT.forward(..., segment=)`), which hands it to each attention layer: the model knows nothing
of pipelining. Before the segment's backward its scope stops keeping, so a full-recompute rerun
of a layer (which replays the forward with the same arguments) reads the same leaves and keeps
nothing. Under sequence parallelism a segment is a multiple of tp tokens, split over tp like a
whole sequence; segments under cp (ring attention) are refused by the config checks.

A layer whose forward depends on earlier tokens other than through K/V (a mixture of experts'
per-sequence capacity and balance loss, models/moe.py) keeps a small record per segment with
`SegmentScope.carry` (forward: the earlier segments' records; a recompute replays them) and
reads all of them in backward with `SegmentScope.whole`. Every segment's forward of a
microbatch precedes its first backward on every rank: a segment's backward needs the grad of
its output, which the last stage makes only after the microbatch's last segment has run
forward there (the schedule runs a microbatch's backwards from the last segment down,
plan/seq1f1b.py), and that forward follows this rank's. `whole` checks it.

A head that predicts further ahead than the next token (multi-token prediction, models/mtp.py)
reads targets past its segment's end: the store holds the microbatch's whole target rows and
each segment's start (`SegmentScope.start`, `SegmentScope.targets`), as the runtime cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.parallel.autograd.outputs import backward_from


@dataclass
class _Kept:
    """One layer's K/V of one segment: graph tensors (backward roots) and leaves (read later)."""

    k: torch.Tensor  # (B, Hkv/tp, n_j, hd)
    v: torch.Tensor
    k_leaf: torch.Tensor
    v_leaf: torch.Tensor


@dataclass
class SegmentScope:
    """What attention receives for one segment's forward: `extend` its K/V with the earlier
    segments' kept leaves."""

    store: SegmentKV
    segment: int
    keep: bool = True  # forward: keep this segment's K/V; from its backward on (recompute): read

    @property
    def tokens(self) -> int:
        """Tokens of each whole sequence the segments cut (all segments together)."""
        return self.store.tokens

    @property
    def start(self) -> int:
        """This segment's first position in its sequence."""
        return self.store.starts[self.segment]

    @property
    def targets(self) -> torch.Tensor | None:
        """The microbatch's whole target rows (b, T), not only this segment's (None: not kept)."""
        return self.store.targets

    def carry(self, layer: object, record: object) -> list:
        """`layer`'s records of this microbatch's earlier segments, in order; `record` is kept
        as this segment's (forward; a recompute replays with what the forward kept)."""
        records = self.store.records.setdefault(layer, {})
        if self.keep:
            records[self.segment] = record
        return [records[j] for j in range(self.segment)]

    def whole(self, layer: object) -> list:
        """`layer`'s records of every segment of the microbatch, in order (in backward)."""
        records = self.store.records.get(layer, {})
        if len(records) != self.store.count:
            raise RuntimeError(
                f"segment {self.segment}'s backward ran before all {self.store.count} segments "
                f"of its microbatch ran forward ({sorted(records)}); the schedule must run "
                "every segment's forward before the microbatch's first backward"
            )
        return [records[j] for j in range(self.store.count)]

    def extend(self, layer: object, k: torch.Tensor, v: torch.Tensor):
        """(B, Hkv, n_i, hd) K/V of this segment -> (B, Hkv, e_i, hd) with earlier segments'."""
        kept = self.store.layers.setdefault(layer, {})
        if self.keep:
            kept[self.segment] = _Kept(k, v, _leaf(k), _leaf(v))
        earlier = [kept[j] for j in range(self.segment)]
        if not earlier:
            return k, v
        return (
            torch.cat([e.k_leaf for e in earlier] + [k], dim=2),
            torch.cat([e.v_leaf for e in earlier] + [v], dim=2),
        )


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


class SegmentKV:
    """The kept K/V of one (microbatch, chunk): {attention layer: {segment: _Kept}}, and the
    other layers' per-segment records ({layer: {segment: record}}, `SegmentScope.carry`) of a
    microbatch cut into `count` segments of sequences of `tokens`, starting at `starts`, with
    the whole rows' `targets` (b, T) for a head that reads past a segment (models/mtp.py)."""

    def __init__(
        self,
        count: int = 1,
        tokens: int = 0,
        starts: tuple[int, ...] = (),
        targets: torch.Tensor | None = None,
    ) -> None:
        self.count, self.tokens, self.starts, self.targets = count, tokens, starts, targets
        self.layers: dict[object, dict[int, _Kept]] = {}
        self.records: dict[object, dict[int, object]] = {}
        self.scopes: dict[int, SegmentScope] = {}

    def scope(self, segment: int) -> SegmentScope:
        """The context to pass to the model's forward of `segment` (one per segment)."""
        scope = self.scopes[segment] = SegmentScope(self, segment)
        return scope

    def backward(self, segment: int, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Backward of `segment` from its output and its K/V (the grads later segments left)."""
        roots, grads = [out], [grad]
        for kept in self.layers.values():
            e = kept.pop(segment)
            for t, leaf in ((e.k, e.k_leaf), (e.v, e.v_leaf)):
                if leaf.grad is not None:  # None for the last segment: nothing read it
                    roots.append(t)
                    grads.append(leaf.grad)
        self.scopes.pop(segment).keep = False  # a recompute inside reads, keeps nothing
        backward_from(roots, grads)

    @property
    def empty(self) -> bool:
        return not any(self.layers.values())
