"""Context parallelism: ring attention over the cp group, with zigzag sharding for causal masks.

Each cp rank holds a slice of every sequence: q, k, v of shape (B, H, T/cp, hd). Key/value
blocks travel around the ring, each rank attending its queries to one block per step; the next
transfer is started before the current block is computed, so communication hides behind compute
(Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3; the ring idea is from Li et al.
2021, "Sequence Parallelism", arXiv 2105.13120). Partial results merge by log-sum-exp (online
softmax, Milakov & Gimelshein 2018), so a rank holds O(s/cp) attention state, never O(s).
The backward runs the ring again: dK/dV accumulators travel with the blocks and arrive home
after cp steps; each block's probabilities are recomputed from the saved log-sum-exp.

Document masking (`documents`, the whole row's document ids (B, T), which every cp rank holds):
each block also hides the keys of other documents than the query's, comparing the query chunk's
ids with the key block's; the block kernel is then the masked reference one. A query row that
sees no key of a block gets lse −inf there, and the merge gives that block weight 0 (no NaN).

Causal load balance (zigzag): the sequence is cut into 2·cp chunks and rank r holds chunks r and
2cp−1−r, so every rank computes the same number of unmasked scores (Brandon et al. 2023,
"Striped Attention", balance by permutation; this chunk pairing is the one of Llama 3's context
parallelism, Dubey et al. 2024, §3.3.2). Per (q chunk a, kv chunk b): b < a full, b = a causal
diagonal, b > a skipped.

Document-aware balance (`layout`, balance.py): the row is cut into more chunks, dealt to the
ranks by their attention work under document masking, and (q chunk, kv chunk) tiles with no
visible pair are skipped, so the worst rank's work comes within a few percent of the mean.

Sliding window (`window`, window.py): tiles wholly outside every query's window are skipped
too, tiles across its edge run masked; positions are the row's, so any layout masks alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.parallel.context.balance import ChunkLayout, positional_layout, take
from megapipe.parallel.context.documents import visible_keys
from megapipe.parallel.context.kernels import KERNELS, BlockKernel, RingTile, pick_kernel, plan_step
from megapipe.parallel.context.window import TileMasks, and_tiles, in_window, window_tiles

KV_TAG, DKV_TAG = 0, 1  # gloo matches p2p by tag; kv and dkv transfers overlap in backward


@dataclass
class RingStats:
    """What one rank's ring attention did: work (balance test) and per-step timings (bench).

    Timings are host wall-clock; on CUDA the device is synchronised at each mark, which
    serialises the overlap: collect them for benchmarks only.
    """

    blocks: int = 0  # (q chunk, kv chunk) pairs attended in forward
    scores: int = 0  # unmasked q·k scores computed in forward (forward FLOPs = 4·hd·scores)
    calls: int = 0  # kernel calls in forward
    steps: list = field(default_factory=list)  # (pass, step, compute_s, wait_s) per ring step

    def count(self, block: RingTile, chunk: int) -> None:
        nq, nk = block.q1 - block.q0, block.k1 - block.k0
        self.calls += 1
        if block.causal:  # ascending ids on both sides: the pairs with b <= a
            self.blocks += nq * (nq + 1) // 2
            self.scores += nq * chunk * (nq * chunk + 1) // 2
        else:
            self.blocks += nq * nk
            self.scores += nq * nk * chunk * chunk

    def seconds(self, pass_: str, what: str) -> float:
        """Total "compute" or "wait" seconds of the "fwd" or "bwd" pass."""
        col = {"compute": 2, "wait": 3}[what]
        return sum(s[col] for s in self.steps if s[0] == pass_)


# ---------------------------------------------------------------- the ring


class RingComm:
    """Neighbours of this rank on the cp ring: send to rank+1, receive from rank−1."""

    def __init__(self, group, stats: RingStats | None, device: torch.device) -> None:
        self.group, self.stats, self.device = group, stats, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors, tag: int):
        """Send tensors on and receive the previous rank's into fresh buffers (non-blocking)."""
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in recv]
        return dist.batch_isend_irecv(ops), recv, tensors  # sent tensors live until the wait

    def wait(self, pending) -> list[torch.Tensor]:
        works, recv, _ = pending
        for w in works:
            w.wait()
        return recv

    def now(self) -> float:
        if self.stats is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def record(self, pass_: str, step: int, t0: float, t1: float) -> None:
        if self.stats is not None:
            self.stats.steps.append((pass_, step, t1 - t0, self.now() - t1))


def _merge(out, lse, blk_out, blk_lse) -> None:
    """Fold one block into the running (out, lse) of its rows, in place: online softmax. Rows
    that no key has reached yet (both lse −inf: document masking) keep weight 0, not NaN."""
    new = torch.logaddexp(lse, blk_lse)  # (B, H, Tq)
    safe = new.masked_fill(new == -math.inf, 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.add_(blk_out.to(out.dtype) * torch.exp(blk_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def _ring_forward(q, k, v, ring: RingComm, plans, chunk, kernel: BlockKernel, scale, masks=None):
    """Attend q to every kv block as it passes; returns out (acc dtype) and lse (B, H, T/cp)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, H, T/cp, hd)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)  # (B, H, T/cp)
    kv = [k, v]
    for step, blocks in enumerate(plans):
        t0 = ring.now()
        pending = ring.start(kv, KV_TAG) if step < len(plans) - 1 else None  # double buffer
        for b in blocks:
            qs, ks = b.slices(chunk)
            kern, hide = _tile_kernel(kernel, masks, step, b)
            o_b, l_b = kern.forward(
                q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], b.causal, scale, *hide
            )
            _merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
            if ring.stats is not None:
                ring.stats.count(b, chunk)
        t1 = ring.now()
        if pending is not None:
            kv = ring.wait(pending)
        ring.record("fwd", step, t0, t1)
    return out, lse


def _tile_kernel(kernel: BlockKernel, masks, step: int, tile: RingTile):
    """The kernel of one tile and its optional hide argument: a tile with keys hidden besides
    causality (window.TileMasks: documents, the window's edge) runs the masked reference one."""
    hide = None if masks is None else masks.hide(step, tile)
    return (kernel, ()) if hide is None else (KERNELS["reference"], (hide,))


def _ring_backward(dout, q, k, v, out, lse, ring: RingComm, plans, chunk, kernel, scale, masks):
    """Recompute each block's P from the saved lse; dK/dV ride the ring home (cp hops)."""
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)  # (B, H, T/cp, hd)
    kv, dkv_pending = [k, v], None
    for step, blocks in enumerate(plans):
        t0 = ring.now()
        kv_pending = ring.start(kv, KV_TAG) if step < len(plans) - 1 else None
        dkv = [torch.zeros(k.shape, dtype=lse.dtype, device=k.device) for _ in range(2)]
        for b in blocks:
            qs, ks = b.slices(chunk)
            rows = [t[:, :, qs] for t in (dout, q, out, lse)]  # (B, H, n·chunk, ...)
            cols = [t[:, :, ks] for t in kv]  # (B, Hkv, m·chunk, hd)
            kern, hide = _tile_kernel(kernel, masks, step, b)
            d_q, d_k, d_v = kern.backward(*rows[:2], *cols, *rows[2:], b.causal, scale, *hide)
            dq[:, :, qs] += d_q
            dkv[0][:, :, ks] += d_k
            dkv[1][:, :, ks] += d_v
        t1 = ring.now()
        if dkv_pending is not None:  # this block's accumulators from the ranks before us
            for d, r in zip(dkv, ring.wait(dkv_pending)):
                d += r
        dkv_pending = ring.start(dkv, DKV_TAG)  # overlaps the next step's compute
        if kv_pending is not None:
            kv = ring.wait(kv_pending)
        ring.record("bwd", step, t0, t1)
    t1 = ring.now()
    dk, dv = ring.wait(dkv_pending)  # our own block's dK/dV, home after cp hops
    ring.record("bwd", len(plans), t1, t1)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """kv ring + log-sum-exp merge fwd / kv ring + dK,dV ring home bwd (Liu et al. 2023)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, plans, chunk, kernel, scale, masks):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, ring, plans, chunk, kernel, scale, masks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # all O(T/cp): no rank holds O(T) state
        ctx.args = (ring, plans, chunk, kernel, scale, masks)  # masks: int64 ids, O(T) per row
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 6)


def _check_inputs(q, k, v, attn_mask) -> None:
    if attn_mask is not None:
        raise ValueError("ring_attention: attn_mask is not supported; use causal=True or False")
    if (
        q.dim() != 4
        or k.shape != v.shape
        or (q.shape[0], *q.shape[2:]) != (k.shape[0], *k.shape[2:])
    ):
        raise ValueError(
            f"ring_attention: want q (B, H, T, hd), k = v (B, Hkv, T, hd); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring_attention: {q.shape[1]} query heads not a multiple of {k.shape[1]} kv heads"
        )


def _check_ring(q, cp: int, zigzag: bool, dropout_p: float) -> None:
    if dropout_p > 0:
        raise ValueError(
            f"ring_attention: dropout_p={dropout_p} is not supported with cp={cp} "
            "(blockwise dropout would not match one process); set model.dropout=0"
        )
    if zigzag and q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: zigzag needs seq_len % (2·cp) == 0, got local "
            f"T/cp={q.shape[2]} (odd) with cp={cp}"
        )


def ring_attention(
    q,
    k,
    v,
    cp_group,
    causal: bool = True,
    zigzag: bool = True,
    scale=None,
    *,
    dropout_p: float = 0.0,
    attn_mask=None,
    kernel: str | None = None,
    stats: RingStats | None = None,
    documents: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
    window: int = 0,
) -> torch.Tensor:
    """This rank's queries (B, H, T/cp, hd) attended over the whole sequence: (B, H, T/cp, hd).

    q, k, v hold this cp rank's slice of the sequence (zigzag chunks r and 2cp−1−r when zigzag,
    else the r-th contiguous slice); k, v may have fewer heads (GQA). cp_group None or of size 1
    is `scaled_dot_product_attention` itself. kernel names a `kernels.KERNELS` entry
    (default: by device and dtype); stats, when given, collects work counts and timings.
    documents (B, T) int64: the whole row's document ids (not this rank's slice): each query
    also sees only keys of its own document (causal only; the masked reference kernel runs).
    layout (balance.document_layout of documents; causal, with documents): the chunks each
    rank holds instead of zigzag's, and the tiles to skip. window > 0 (causal only): each
    query sees itself and the window − 1 keys before it in the row (window.py); tiles wholly
    outside every window are skipped, tiles across its edge run masked.
    """
    _check_inputs(q, k, v, attn_mask)
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    if (documents is not None or window) and not causal:
        raise ValueError(
            "ring_attention: documents and window mask causal attention only; pass causal=True"
        )
    if cp == 1:
        return _one_rank(q, k, v, causal, scale, dropout_p, stats, documents, window)
    _check_ring(q, cp, zigzag and layout is None, dropout_p)
    if layout is not None and (documents is None or not causal):
        raise ValueError("ring_attention: a layout needs documents and causal=True")
    ring = RingComm(cp_group, stats, q.device)
    layout = positional_layout(cp, zigzag) if layout is None else layout
    src = [(ring.rank - s) % cp for s in range(cp)]  # step s holds the kv block of rank r − s
    held = [tuple(layout.ranks[r]) for r in src]
    chunk = q.shape[2] // len(held[0])
    visible = layout.visible
    if window:  # skip the tiles wholly outside every query's window, as those above the diagonal
        visible = and_tiles(visible, window_tiles(layout.n, chunk, window))
    plans = [plan_step(list(held[0]), list(kv), causal, visible) for kv in held]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    masks = None
    if documents is not None or window:  # ids of this rank's queries and of each step's kv block
        ids = None if documents is None else [take(documents, layout, r) for r in src]
        q_ids = None if ids is None else ids[0]
        masks = TileMasks(q.device, chunk, held[0], held, window, q_ids, ids)
    kern = pick_kernel(q, kernel)  # a masked tile runs the reference kernel (_tile_kernel)
    return _RingAttention.apply(q, k, v, ring, plans, chunk, kern, scale, masks)


def _one_rank(q, k, v, causal: bool, scale, dropout_p: float, stats, documents, window: int):
    """cp 1: `scaled_dot_product_attention`, with documents and the window as a boolean mask."""
    if stats is not None:
        stats.count(RingTile(0, 1, 0, 1, causal), q.shape[2])
    T, S = q.shape[2], k.shape[2]
    mask = None if documents is None else visible_keys(documents, T, S).unsqueeze(1)
    if window:  # (T, S): the queries are the last T of the S positions
        near = in_window(
            torch.arange(S - T, S, device=q.device), torch.arange(S, device=q.device), window
        )
        mask = near if mask is None else mask & near
    return F.scaled_dot_product_attention(
        q, k, v, mask, dropout_p, is_causal=causal and mask is None, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip
