"""Multi-token prediction (DeepSeek-V3 §2.2), model.mtp_layers D modules on the chunk that holds
the head (the last pipeline stage).

Module k (1..D) predicts the token k + 1 places ahead: h_k = block_k(W_k [RMSNorm(h_{k−1});
RMSNorm(Emb(t_{i+k}))]) with h_0 the main model's last hidden states (before its final norm),
then the SHARED output head on norm_k(h_k) against t_{i+k+1}. Inputs t_{i+k} and targets
t_{i+k+1} are the main targets (t_{i+1}) shifted by k − 1 and k, so the modules need no more
tokens than a sample's seq_len + 1: position i has an MTP-k target for i < T − k only. The
sequence keeps its length T through the blocks (the last k inputs repeat the last token;
causal attention keeps them out of the earlier positions) and the head takes the first T − k;
a MoE block's balance statistics count those k positions too.
The embedding is the main model's: on the last stage its copy, kept equal to stage 0's as the
tied table's is (pipeline/tied.py, models/gpt.GPT.shared_table).

The loss, in the LM loss's summed units, is mtp_loss_coef / D · Σ_k Σ_i CE_k,i (DeepSeek-V3
eq. 24-25: each depth's mean over T tokens, averaged over depths, times λ). It reaches backward
only: the step's reported loss stays the LM loss.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.parallel.tensor.cross_entropy import linear_cross_entropy
from megapipe.parallel.tensor.layers import RMSNorm
from megapipe.parallel.tensor.mappings import enter_column
from megapipe.parallel.tensor.sharding import NO_TP, TPInfo


class MTPModule(nn.Module):
    """One depth: the two norms, the 2d → d projection, a transformer block and its final norm.
    The projection is whole on every tp rank (its input is the rank's tokens, as a norm's)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module, proj: nn.Module, tp: TPInfo) -> None:
        super().__init__()
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps, tp)
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps, tp)
        self.proj, self.block = proj, block
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, tp)

    def forward(self, h, e, positions, documents=None) -> torch.Tensor:
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))
        return self.block(x, positions, None, documents)


class MTP(nn.Module):
    """The D modules and their loss (module docstring)."""

    def __init__(self, cfg: ModelConfig, modules: list[MTPModule], tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.depths = nn.ModuleList(modules)
        self.coef, self.tp, self.vocab_size = cfg.mtp_loss_coef, tp, cfg.vocab_size

    def loss(self, h, targets, embed, weight, positions, documents=None) -> torch.Tensor:
        """Σ over depths and positions of the MTP cross entropy times coef / D; `h` (B, T[/tp],
        d) the main hidden states, `targets` (B, T) the main targets, `embed` the token lookup,
        `weight` the head's (V/tp, d) vocabulary slice."""
        T = targets.shape[1]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        vocab_start = self.tp.rank * weight.shape[0]
        for k, module in enumerate(self.depths, start=1):
            ids = torch.cat([targets[:, k - 1 :], targets[:, -1:].expand(-1, k - 1)], dim=1)
            h = module(h, embed(ids), positions, documents)
            x = enter_column(module.norm(h), self.tp)[:, : T - k]  # (B, T − k, d)
            total = (
                total
                + linear_cross_entropy(
                    x, weight, targets[:, k:], vocab_start, self.vocab_size, self.tp
                ).float()
            )
        return total * (self.coef / len(self.depths))
