"""Cross entropy over logits split along the vocabulary, never gathered (Megatron §3).

Shoeybi et al. 2019, §3: each tp rank holds the logits of its vocab slice; the loss needs only
three all-reduces of per-token scalars (max, sum of exp, target logit) instead of gathering the
(B·T, V) logits. Padding columns (a vocab that tp does not divide) are masked to -inf.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.distributed import collectives as C
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


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, tp: TPInfo
) -> torch.Tensor:
    """Sum over tokens of −log softmax(logits)[target]; logits (B, T, V/tp), targets (B, T)."""
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    if tp.size == 1:
        return F.cross_entropy(flat.float(), flat_targets, reduction="sum")
    return _VocabParallelCrossEntropy.apply(flat, flat_targets, vocab_start, vocab_size, tp)
