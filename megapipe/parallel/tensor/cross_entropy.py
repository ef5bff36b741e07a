"""Cross entropy over logits split along the vocabulary, never gathered (Megatron §3), and the
fused, chunked LM head + cross entropy the model trains with.

Shoeybi et al. 2019, §3: each tp rank holds the logits of its vocab slice; the loss needs only
three all-reduces of per-token scalars (max, sum of exp, target logit) instead of gathering the
(B·T, V) logits. Padding columns (a vocab that tp does not divide) are masked to -inf.

`linear_cross_entropy` goes one step further: the head's matmul and the loss in one autograd
Function that never holds the logits of the whole microbatch. Forward walks the tokens in
chunks (config/memory_terms.head_chunk_rows: 256 tokens on the CPU; on a GPU as many as 1/128 of its
memory holds as float32 logits, so each chunk's weight grad added into the float32 grad stays
small beside its wgrad GEMM), keeping per token
only the log-sum-exp and the target's logit;
over a vocabulary split by tp, each chunk's row maxima are all-reduced (so every rank, and one
process, subtract the same maximum) and the sums of exp and the target logits once at the end.
It saves the head input, the targets and per token the row max and sum of exp, O(tokens·d),
instead of the float32 log-probabilities, O(tokens·V). Backward recomputes each chunk's logits
and turns them into softmax (exp(logit − max) / sum: the same max on every tp rank and in one
process, so only the sum's split rounds differently) − one-hot, then into the chunk's input
grad and its share of the weight grad (accumulated in float32): one more head matmul per step
for a transient of O(chunk·V). The weight grad is done in backward, never deferred to a Zero
Bubble W (it would need the logits a third time). Under bf16 weights each chunk's share goes
straight into the weight's main grad (precision.fused_weight_grad: Megatron's gradient
accumulation fusion for its output layer), with the loss's grad folded into the chunk's (rows, d)
input: no bf16 product, float32 grad or cast of the weight's size exists of its own (at the
head's height V/tp·d·6 bytes fewer into a bf16 main grad, V/tp·d·2 on CUDA into a float32 one,
whose float32-output product remains: config/memory_head.py).

`grad_in_forward=True` drops that extra matmul (the idea of Liger Kernel's fused linear cross
entropy, Hsu et al. 2024): the loss is the last op of the graph, so its grad w.r.t. the logits
is known in forward up to the scalar the caller's backward brings. Forward turns each chunk's
exp(logit − max) straight into softmax − one-hot (under tp the chunk's sum of exp is all-reduced
at once for it) and into the input grad and the float32 weight grad; backward only scales the
two. The price is memory held from F to B: the input grad (N·d) and a weight-sized grad
(V/tp·d float32) per microbatch in flight at the head instead of the head input, so the model
asks for it only where exactly one is in flight (config/memory_terms.head_grad_in_forward).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.config.memory_terms import head_chunk_rows
from megapipe.distributed import collectives as C
from megapipe.distributed.devices import memory as device_memory
from megapipe.parallel.autograd.kept_buffers import KeptBuffers, kept_or_new
from megapipe.parallel.precision import fused_weight_grad, main_grad_arrived
from megapipe.parallel.tensor.sharding import TPInfo


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy fwd (3 all-reduces of B·T scalars) / softmax − one-hot bwd (local)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, tp):
        ctx.dtype = logits.dtype
        logits = logits.float()  # (N, V/tp)
        n_local = logits.shape[-1]
        valid = min(max(vocab_size - vocab_start, 0), n_local)
        if valid < n_local:  # padding rows of the embedding: never a prediction
            logits = logits.clone()
            logits[:, valid:] = float("-inf")
        top = C.all_reduce(logits.max(dim=-1).values, tp.group, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        sum_exp = C.all_reduce(exp.sum(dim=-1), tp.group)
        local = targets - vocab_start
        inside = (local >= 0) & (local < valid)
        local = local.clamp(0, n_local - 1)
        picked = shifted.gather(1, local[:, None]).squeeze(1)
        target_logit = C.all_reduce(torch.where(inside, picked, 0.0), tp.group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, inside)
        return (sum_exp.log() - target_logit).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, local] -= inside.to(out.dtype)
        return (out * grad).to(ctx.dtype), None, None, None, None


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's (bf16 on the GPU path), else h's."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The logits' and sums' dtype: float32, or float64 where the operands are (the float64
    reference run that tests/parity.py bounds float32 round-off with)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, valid: int, buffer: torch.Tensor | None
) -> torch.Tensor:
    """float32 logits of one chunk, transposed: (V/tp, rows), W·hᵀ, written into `buffer`
    (float32 matmuls: one allocation for all chunks); padding rows (>= valid) at -inf.

    Vocabulary-major because every GEMM of the chunk is then a plain one: logits W·hᵀ, input
    grad Gᵀ·W, weight grad G·h, with no row stride of V (GPT-2's 50257) for the BLAS to pay
    for; on this CPU a chunk's forward and both grads ran ~20% faster than token-major at
    V = 50257 and the same at 8192."""
    rows = h.shape[0]
    if h.dtype == torch.float32 and buffer is not None:
        out = buffer[: weight.shape[0] * rows].view(weight.shape[0], rows)
        logits = torch.mm(weight, h.t(), out=out)
    else:
        logits = (weight @ h.t()).to(_acc_dtype(h.dtype))
    if valid < logits.shape[0]:
        logits[valid:] = float("-inf")
    return logits


_LOG2_E = math.log2(math.e)


def exp_shifted_(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """exp(logits − top) in place, for (V/tp, rows) logits and the rows' maxima `top`. On the
    CPU as 2^((logits − top)·log2 e): this build's float32 exp ran ~4× slower there than its
    exp2 (docs/benchmarks/2026-11-24-train-throughput-cpu.md). The product's rounding puts a
    relative error of about 1e-7·|logit − max| on a term (< 1e-6 within e^-6 of the row's largest,
    which carry its sum), where exp has 6e-8: far under the 1e-5 parity bound, and every mesh runs
    it alike."""
    logits.sub_(top[None])
    if logits.device.type != "cpu":
        return logits.exp_()
    return logits.mul_(_LOG2_E).exp2_()


def _buffer(
    h: torch.Tensor, rows: int, n_local: int, reuse: HeadBuffers | None
) -> torch.Tensor | None:
    """The chunks' float32 logits buffer, flat (each chunk views its first V/tp·rows floats as
    one contiguous (V/tp, rows) matrix; float32 matmuls write into it), or None; kept in
    `reuse` from call to call where given, on the CPU only: there a fresh buffer costs page
    faults, while CUDA's caching allocator hands the block back without them, and a chunk
    there may fill 1/128 of the device (config/memory_terms.head_chunk_rows), which a kept buffer
    would hold between steps where the memory model counts no logits."""
    if h.dtype != torch.float32:
        return None
    kept = None if reuse is None or h.device.type != "cpu" else reuse.logits
    return kept_or_new(kept, (min(rows, h.shape[0]) * n_local,), torch.float32, h.device)


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ_tokens lse(h Wᵀ) − (h Wᵀ)[target], by chunks of tokens (module docstring); with
    `early` the grads are made in forward (`_early_grads`) and backward only scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_start, vocab_size, tp, rows, early, reuse):
        dtype = _compute_dtype(h)
        n, n_local = h.shape[0], weight.shape[0]
        valid = min(max(vocab_size - vocab_start, 0), n_local)
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            local, inside = targets, None
            if tp.size > 1:
                local = targets - vocab_start
                inside = (local >= 0) & (local < valid)
                local = local.clamp(0, n_local - 1)
            acc = {"dtype": _acc_dtype(dtype), "device": h.device}
            top = torch.full((n,), float("-inf"), **acc)  # row max over the vocab
            sum_exp = torch.zeros(n, **acc)  # Σ exp(logit − top) over this slice
            picked = torch.zeros(n, **acc)  # the target's logit
            grads = _EarlyGrads(hc, weight, reuse) if early else None
            buffer = _buffer(hc, rows, n_local, reuse)
            for lo in range(0, n, rows):
                hi = min(lo + rows, n)
                if not valid:  # a tp slice of padding only: adds nothing, joins the max
                    C.all_reduce(top[lo:hi], tp.group, op=dist.ReduceOp.MAX)
                    if grads is not None:  # and the per-chunk sum the others reduce
                        C.all_reduce(sum_exp[lo:hi], tp.group)
                    continue
                logits = _chunk_logits(hc[lo:hi], wc, valid, buffer)  # (V/tp, rows)
                picked[lo:hi] = logits.gather(0, local[None, lo:hi]).squeeze(0)
                torch.amax(logits, dim=0, out=top[lo:hi])
                if tp.size > 1:  # the max over the whole vocabulary, as one process takes it
                    C.all_reduce(top[lo:hi], tp.group, op=dist.ReduceOp.MAX)
                sum_exp[lo:hi] = exp_shifted_(logits, top[lo:hi]).sum(dim=0)
                if grads is not None:
                    if tp.size > 1:  # the softmax needs the whole vocabulary's sum now
                        C.all_reduce(sum_exp[lo:hi], tp.group)
                    inside_c = None if inside is None else inside[lo:hi]
                    grads.add_chunk(lo, hi, logits, sum_exp, local, inside_c, wc)
                del logits
            del buffer
            if grads is not None:
                grads.finish()
            if tp.size > 1:
                if grads is None:
                    C.all_reduce(sum_exp, tp.group)
                picked = C.all_reduce(torch.where(inside, picked, 0.0), tp.group)
            lse = sum_exp.log().add_(top)
        if grads is not None:
            ctx.save_for_backward(grads.input_grad, grads.weight_grad)
        else:
            mask = () if inside is None else (inside,)
            ctx.save_for_backward(hc, weight, local, top, sum_exp, *mask)
        ctx.dtype, ctx.in_dtype, ctx.valid, ctx.rows = dtype, h.dtype, valid, rows
        ctx.early, ctx.weight_dtype, ctx.used, ctx.reuse = early, weight.dtype, False, reuse
        return (lse - picked).sum()

    @staticmethod
    def backward(ctx, grad):
        if ctx.early:  # scaled in place (no V·d copy), so a second backward is refused
            if ctx.used:
                raise RuntimeError(
                    "the fused LM head's grads were made in forward and are "
                    "spent: backward through it once (no retain_graph reuse)"
                )
            ctx.used = True
            grad_h, grad_w = ctx.saved_tensors
            grad_h, grad_w = grad_h.mul_(grad), grad_w.mul_(grad)
            return grad_h.to(ctx.in_dtype), grad_w.to(ctx.weight_dtype), *(None,) * 7
        hc, weight, local, top, sum_exp, *mask = ctx.saved_tensors
        inside = mask[0].to(top.dtype) if mask else None
        n, rows = hc.shape[0], ctx.rows
        wc = weight.to(ctx.dtype)
        main = main_grad_of(weight, ctx.dtype)
        grads = _EarlyGrads(hc, weight, into=main, scale=grad)
        buffer = _buffer(hc, rows, weight.shape[0], ctx.reuse)
        for lo in range(0, n if ctx.valid else 0, rows):
            hi = min(lo + rows, n)
            probs = _chunk_logits(hc[lo:hi], wc, ctx.valid, buffer)
            exp_shifted_(probs, top[lo:hi])
            inside_c = None if inside is None else inside[lo:hi]
            grads.add_chunk(lo, hi, probs, sum_exp, local, inside_c, wc)
            del probs
        grads.finish()
        grad_h = grads.input_grad.mul_(grad).to(ctx.in_dtype)
        if main is not None:  # the weight grad is in the main grad already
            main_grad_arrived(weight)
            return grad_h, None, *(None,) * 7
        return grad_h, grads.weight_grad.mul_(grad).to(weight.dtype), *(None,) * 7


def main_grad_of(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The main grad the backward adds the weight grad into: bf16 weights' (in low-precision
    compute, `_add_probs`' path); None: a float32 weight grad, returned."""
    main = getattr(weight, "main_grad", None)
    return main if dtype != torch.float32 else None


class HeadBuffers:
    """What the fused head keeps from step to step (parallel/autograd/kept_buffers.py): the
    float32 weight grads made in forward and the chunk-logits buffer (`_buffer`), both on the
    CPU only, where fresh ones cost page faults.
    At GPT-2's 50257 × 768 a fresh weight grad was 37.7k page faults a step (154 MB) and the
    logits buffer 12.5k (51 MB).
    Two weight grads are kept: under grad accumulation the first is still the weight's .grad
    while the next microbatch's is made, which the memory model already counts (the
    parameter's grad and the head's weight grad in flight)."""

    def __init__(self) -> None:
        self.weight_grad = KeptBuffers(keep=2)
        self.logits = KeptBuffers(keep=1)


class _EarlyGrads:
    """The head's input grad (N, d) and float32 weight grad (V/tp, d) of Σ loss, built chunk by
    chunk from each chunk's exp(logit − max): softmax − one-hot, then one dgrad and one wgrad
    matmul. The first chunk writes the weight grad (no zero fill of V·d), later ones add."""

    def __init__(
        self,
        hc: torch.Tensor,
        weight: torch.Tensor,
        reuse: HeadBuffers | None = None,
        into: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        """`into`: a main grad each chunk's weight grad, times `scale` (the loss's grad), is
        added to, in place of a weight grad of its own (backward only)."""
        self.hc, self.into, self.scale = hc, into, scale
        self.input_grad = torch.empty_like(hc)  # every chunk writes its rows
        self.first = True
        if into is not None:
            self.weight_grad = None
            return
        # kept on the CPU only, as the logits buffer (_buffer): on a device a kept grad would
        # hold V/tp·d·4 bytes (two under grad accumulation) from step to step, while the
        # next step's forward runs, where the memory model counts none (found by --fake-ranks)
        cpu = weight.device.type == "cpu"
        kept = None if reuse is None or not cpu else reuse.weight_grad
        acc = _acc_dtype(hc.dtype)
        self.weight_grad = kept_or_new(kept, weight.shape, acc, weight.device)

    def add_chunk(self, lo, hi, exp, sum_exp, local, inside, wc) -> None:
        """Grads of the chunk's tokens from `exp` (V/tp, rows) float32, exp(logit − max)."""
        h_c, target = self.hc[lo:hi], local[lo:hi]
        hit = None if inside is None else inside.to(exp.dtype)  # the target in this slice
        if wc.dtype == exp.dtype:  # float32 (or the float64 reference)
            self._add_folded(exp, sum_exp[lo:hi].reciprocal()[:, None], target, hit, h_c, lo, wc)
        else:
            self._add_probs(exp.div_(sum_exp[None, lo:hi]), target, hit, h_c, lo, wc)
        self.first = False

    def _add_folded(self, e, scale, target, hit, h_c, lo, wc) -> None:
        """float32: (softmax − one-hot) is never formed over the vocabulary. The softmax's
        1/Σexp (`scale`, per token) is applied to the (rows, d) operand or product, and the
        one-hot's part is the targets' rows of W (input grad) and the tokens' h added at their
        targets' rows (weight grad): a pass over the chunk's V·rows logits saved (~1e-7·|W_t|
        of rounding where p_t → 1, which bf16's would make ~4e-3: there `_add_probs`)."""
        grad_in = self.input_grad[lo : lo + h_c.shape[0]]
        torch.mm(e.t(), wc, out=grad_in)
        onehot_in = wc.index_select(0, target)  # (rows, d)
        grad_in.mul_(scale).sub_(onehot_in if hit is None else onehot_in * hit[:, None])
        h_scaled = h_c * scale
        if self.first:
            torch.mm(e, h_scaled, out=self.weight_grad)
        else:
            self.weight_grad.addmm_(e, h_scaled)
        onehot_w = h_c if hit is None else h_c * hit[:, None]
        self.weight_grad.index_add_(0, target, onehot_w, alpha=-1.0)

    def _add_probs(self, probs, target, hit, h_c, lo, wc) -> None:
        """Low precision (bf16 on the GPU path): softmax − one-hot in float32, then the bf16
        matmuls, the weight grad summed over the chunks in float32."""
        at = torch.arange(probs.shape[1], device=probs.device)
        probs[target, at] -= 1.0 if hit is None else hit  # − one-hot
        g = probs.to(wc.dtype)  # the loss's grad is applied in backward
        torch.mm(g.t(), wc, out=self.input_grad[lo : lo + h_c.shape[0]])
        if self.into is not None:  # main += g · (h_c · scale), (V/tp, rows) · (rows, d)
            fused_weight_grad(self.into, g.t(), h_c * self.scale)
            return
        part = g @ h_c
        self.weight_grad.copy_(part) if self.first else self.weight_grad.add_(part)

    def finish(self) -> None:
        if self.first:  # no chunk (a tp slice of padding only): both grads are zero
            self.input_grad.zero_()
            if self.weight_grad is not None:
                self.weight_grad.zero_()


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    tp: TPInfo,
    rows: int | None = None,
    grad_in_forward: bool = False,
    reuse: HeadBuffers | None = None,
) -> torch.Tensor:
    """Σ over tokens of −log softmax(h Wᵀ)[target] without the whole (tokens, V/tp) logits: h
    (B, T, d) the head input on this rank (after f, or SP's all-gather), W (V/tp, d) this rank's
    vocabulary slice starting at `vocab_start` (rows past `vocab_size` are padding), targets
    (B, T); `rows` tokens per chunk (default config/memory_terms.head_chunk_rows: 256 on the CPU,
    on a
    GPU as many as 1/128 of its memory holds as float32 logits). `grad_in_forward`: make the
    input and weight grads in forward, each chunk's logits made once (module docstring); only
    where grad is being recorded; `reuse`: the buffers its weight grad and chunk logits are
    written into, kept from step to step (HeadBuffers), else fresh ones each call."""
    recording = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    early = grad_in_forward and recording
    flat, flat_targets = h.flatten(0, 1), targets.flatten()
    rows = rows or head_chunk_rows(
        weight.shape[0], h.device.type, flat.shape[0], device_memory(h.device)
    )
    return _LinearCrossEntropy.apply(
        flat, weight, flat_targets, vocab_start, vocab_size, tp, rows, early, reuse
    )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPInfo
) -> torch.Tensor:
    """Sum over tokens of −log softmax(logits)[target]; logits (B, T, V/tp), targets (B, T)."""
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    if tp.size == 1:
        return F.cross_entropy(flat.float(), flat_targets, reduction="sum")
    return _VocabParallelCrossEntropy.apply(flat, flat_targets, vocab_start, vocab_size, tp)
