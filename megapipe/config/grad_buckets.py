"""The full-size grads a rank holds at once where they are reduced every microbatch
(config/states.local_grads_transient: zero=3, or zero=2 with float32 weights under
parallel.grad_reduce=microbatch), from its dp buckets as its reducer lays them out and
launches them. Pure arithmetic: each chunk's weight units and their parameters' elements come
from the caller (`ChunkUnits`: train/meta_memory.py on a meta-device chunk, perf/memory_cache.py
the same counts cached).

A chunk's reducer (parallel/data/reducer.py, zero2.py, zero3.py) packs its parameters in
backward order into buckets of replica_bucket_mb (config/states.bucket_runs): at zero=3 each
weight unit's own parameters apart (the embedding, each layer, the head; a parameter belongs to
the first unit in forward order that reads it), else across units. In a grad action, each
bucket is launched, in order, once the backward has made all its grads: its grads go into a
send buffer (a copy in the reduce dtype; zero=3's main grads are freed, float32 grads dropped)
and at most states.IN_FLIGHT reductions run at once, the oldest settled to launch another.
Each grad action ends with every bucket sent and settled, so nothing carries from one to the
next.

When unit k's backward starts, the rank holds:
- made: the grads of every bucket some unit from k on reads (zero=3 under bf16 weights
  allocates a bucket's main grads at the backward start of the first unit that reads it,
  `Zero3Reducer._grads_for`; float32 grads are made by autograd as the backward goes, at most
  as many) and that no unit before k completes: a bucket is launched after the backward of
  the first unit in forward order holding its parameters;
- in flight: the send buffers of the last IN_FLIGHT buckets launched before it;
- freed: the activations the microbatch in backward saved in the transformer layers after k,
  released by their backward (autograd frees a node's saved tensors once it has run; the head
  keeps its buffers for the next microbatch).
Float32 grads also weigh at k's end, its own grads made and its own activations freed
(_moments).
The plan adds the most grads (main-grad dtype) and send buffers (reduce dtype) to the grad
shards (config/states.block_grads_bytes); beside the activations it takes off what the
backward has freed at the moment where grads and saved activations weigh most together
(RankMemory.freed_at_grads): the activation peak and the grads' do not come at once, as the
grads grow while the backward frees what it read.
Left out: the MTP modules' reads of the shared table and head (their buckets counted from the
MTP's own backward), and a bucket's split where expert and dense weights or float32 routers
meet (parallel.ep's buckets hold one kind).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from megapipe.config.flops import head_grad_in_forward, segment_bounds
from megapipe.config.schema import Config
from megapipe.config.states import (
    FLOAT32,
    IN_FLIGHT,
    bucket_runs,
    local_grads_transient,
    main_grad_bytes,
    replica_bucket_mb,
    send_width,
    state_layout,
)

Unit = tuple[int, ...]  # a weight unit's own parameters' elements, in backward order


@dataclass(frozen=True)
class HeadWeight:
    """Where the LM head's matmul weight (its own, or the tied table) lies in a chunk's units:
    the unit holding it, its place in that unit's backward order, and the head's unit."""

    unit: int
    index: int
    head: int


# (blocks, tp_rank) -> the weight units of the chunk holding `blocks` on that tp rank, in
# forward order (pipeline/stages.weight_blocks), and its head's weight (None: no head)
ChunkUnits = Callable[[range, int], tuple[list[Unit], HeadWeight | None]]


@dataclass(frozen=True)
class GradBucket:
    """A dp bucket: its parameters, the last unit in forward order reading any of them (its
    backward makes their grads first) and the first holding any (its backward completes it);
    `made` of its parameters count as grads made (the rest is the head's activation:
    _head_grad_apart)."""

    params: int
    reader: int
    done: int
    made: int


def chunk_buckets(
    cfg: Config, units: Sequence[Unit], head: HeadWeight | None
) -> tuple[GradBucket, ...]:
    """The chunk's dp buckets in launch order (module docstring)."""
    p = cfg.parallel
    apart = _head_grad_apart(cfg)
    return _buckets(tuple(units), head, state_layout(cfg).zero >= 3, p.dp * p.cp, apart)


@functools.lru_cache(maxsize=4096)
def _buckets(
    units: tuple[Unit, ...], head: HeadWeight | None, per_unit: bool, replicas: int, apart: bool
) -> tuple[GradBucket, ...]:
    """chunk_buckets of what it reads (a search asks for the same chunks many times)."""
    limit = replica_bucket_mb(replicas) * 2**20
    last = len(units) - 1
    # (elements, unit, is the head's weight) in backward order
    order = [(n, k, head is not None and (k, i) == (head.unit, head.index))
             for k in range(last, -1, -1) for i, n in enumerate(units[k])]  # fmt: skip
    ends = list(accumulate(len(units[k]) for k in range(last, -1, -1)))
    # zero=3: each unit's own buckets; else the chunk's together
    runs = [range(e - len(units[last - i]), e) for i, e in enumerate(ends)]
    runs = runs if per_unit else [range(len(order))]
    out = []
    for run in runs:
        items = [order[i] for i in run]
        for r in bucket_runs([n for n, _, _ in items], limit):
            part = items[r.start : r.stop]
            params = sum(n for n, _, _ in part)
            reader = max(head.head if is_head else k for _, k, is_head in part)
            kept = sum(n for n, _, is_head in part if is_head and apart)
            out.append(GradBucket(params, reader, min(k for _, k, _ in part), params - kept))
    return tuple(out)


def is_layer(cfg: Config, block: int) -> bool:
    """Block `block` is a transformer layer (not the embedding, the head or MTP's)."""
    return 1 <= block <= cfg.model.n_layers


def _head_grad_apart(cfg: Config) -> bool:
    """The head's weight grad is counted with its activations (which grads_at_once does not
    take as freed), not as a grad made (`GradBucket.made`): where the fused head makes it in
    forward (config/memory_terms.head_terms keeps it) and float32 weights take that tensor as
    their grad. Under bf16 weights it is added into a main grad of its own at the head's
    backward."""
    return head_grad_in_forward(cfg) and state_layout(cfg).weight == FLOAT32


def grads_at_once(
    cfg: Config,
    held: list[range],
    tp_rank: int,
    units: ChunkUnits,
    activations: Callable[[int], float] | None = None,
) -> tuple[float, float, float]:
    """(made, in flight, freed): the parameters whose grads the rank holding `held` keeps at
    most at once where grads are reduced every microbatch (module docstring), and the bytes by
    which the most grads beside every activation saved overstate the most they weigh beside
    the activations still saved at a unit's moment: what the backward has freed there (by
    `activations`: block -> one microbatch's saved bytes; the chunk's later transformer layers,
    the head keeping its buffers for the next microbatch; none under Seq1F1B, where a segment
    frees only its own); (0, 0, 0) elsewhere."""
    if not local_grads_transient(cfg):
        return 0.0, 0.0, 0.0
    grad, wire = main_grad_bytes(cfg), send_width(cfg)
    frees = activations is not None and len(segment_bounds(cfg)) == 1
    most, peak = (0.0, 0.0), 0.0  # the most grads; the most grads less what is freed
    for blocks in held:
        own, head = units(blocks, tp_rank)
        buckets = chunk_buckets(cfg, own, head)
        n = len(own)
        saved = [activations(b) if frees and is_layer(cfg, b) else 0.0 for b in blocks]
        padded = saved + [0.0] * (n + 1 - len(saved))
        tail = [*list(accumulate(reversed(padded)))[::-1], 0.0]  # tail[j]: units j on
        at, after = _spans(buckets, n)
        launched = 0  # buckets launched before unit k's backward: a prefix of launch order
        for k in range(n - 1, -1, -1):
            while launched < len(buckets) and buckets[launched].done > k:
                launched += 1
            flight = float(sum(b.params for b in buckets[max(0, launched - IN_FLIGHT) : launched]))
            for first, freed in _moments(cfg, k):
                made = at[k] if first == k else after[k]
                if grad * made + wire * flight > grad * most[0] + wire * most[1]:
                    most = (made, flight)
                peak = max(peak, grad * made + wire * flight - tail[freed])
    return most[0], most[1], grad * most[0] + wire * most[1] - peak


def _spans(buckets: Sequence[GradBucket], n: int) -> tuple[list[float], list[float]]:
    """Per unit k: the made parameters of the buckets not yet launched that some unit from k on
    reads (done <= k <= reader), and of those some unit after k reads (done <= k < reader)."""
    at, after = [0.0] * (n + 1), [0.0] * (n + 1)
    for b in buckets:
        at[b.done] += b.made
        at[b.reader + 1] -= b.made
        if b.reader > b.done:
            after[b.done] += b.made
            after[b.reader] -= b.made
    return list(accumulate(at))[:n], list(accumulate(after))[:n]


def _moments(cfg: Config, k: int) -> tuple[tuple[int, int], ...]:
    """The moments of unit k's backward where its grads weigh most, each as (the first unit
    whose reads count as made, the first unit whose activations are freed). bf16 weights at
    zero=3: its start, every bucket it reads allocated, its own activations still saved.
    Float32 grads, which autograd makes linear by linear as it frees what each read: its start
    (the grads of the units after it) and its end (its own too, its activations freed)."""
    if state_layout(cfg).zero >= 3 and state_layout(cfg).weight != FLOAT32:
        return ((k, k + 1),)
    return ((k + 1, k + 1), (k, k))
