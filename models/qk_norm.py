"""Qwen3's QK-norm: an RMSNorm over head_dim on every query and key head, before RoPE.

transformers' Qwen3Attention (models/qwen3/modeling_qwen3.py) normalises each head of q and k
with a gain of size head_dim shared by all heads (`q_norm`, `k_norm`), which bounds the
attention logits (QK-norm, Dehghani et al. 2023, §3.1.1; Qwen3 technical report §2).

Under tp the heads are split, so each rank's gain grad sums over its own heads only: the
logical grad is the sum over the tp ranks (transformers' tp plan calls it
"replicated_with_grad_allreduce"). The gains are built with a TPInfo whose grads the house
already treats as partial over tp, a sequence-parallel one (parallel/tensor/grad_sync.py sums
those after backward, train/zero_grads.py under zero >= 2, and the grad norm counts them once),
so no other module learns of QK-norm. The forward does not read that TPInfo.
"""

from __future__ import annotations

import dataclasses

from megapipe.config import ModelConfig
from megapipe.parallel.tensor.layers import RMSNorm
from megapipe.parallel.tensor.sharding import TPInfo


def qk_norms(cfg: ModelConfig, head_dim: int, tp: TPInfo) -> tuple[RMSNorm | None, ...]:
    """(q_norm, k_norm) for model.arch=qwen3, (None, None) for the other archs."""
    if cfg.arch != "qwen3":
        return None, None
    partial = dataclasses.replace(tp, sequence_parallel=True)  # grads summed over tp
    return RMSNorm(head_dim, cfg.norm_eps, partial), RMSNorm(head_dim, cfg.norm_eps, partial)
