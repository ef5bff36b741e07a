"""Multi-token prediction (DeepSeek-V3 §2.2), model.mtp_layers D modules on the chunk that holds
the head (the last pipeline stage).

Module k (1..D) predicts the token k + 1 places ahead: h_k = block_k(W_k [RMSNorm(h_{k−1});
RMSNorm(Emb(t_{i+k}))]) with h_0 the main model's last hidden states (before its final norm),
then the SHARED output head on norm_k(h_k) against t_{i+k+1}. Inputs t_{i+k} and targets
t_{i+k+1} are the main targets (t_{i+1}) shifted by k − 1 and k, so the modules need no more
tokens than a sample's seq_len + 1: position i has an MTP-k target for i < T − k only. The
sequence keeps its length T through the blocks (the last k inputs repeat the last token;
causal attention keeps them out of the earlier positions) and the head takes the positions
with a target (under cp, this rank's of them, the targets gathered over cp);
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
from megapipe.distributed import collectives as C
from megapipe.parallel.context.zigzag import NO_CP, CPInfo
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

    def forward(self, h, e, positions, documents=None, segment=None) -> torch.Tensor:
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))
        return self.block(x, positions, segment, documents)


class MTP(nn.Module):
    """The D modules and their loss (module docstring)."""

    def __init__(
        self, cfg: ModelConfig, modules: list[MTPModule], tp: TPInfo = NO_TP, cp: CPInfo = NO_CP
    ) -> None:
        super().__init__()
        self.depths = nn.ModuleList(modules)
        self.coef, self.tp, self.cp, self.vocab_size = cfg.mtp_loss_coef, tp, cp, cfg.vocab_size

    def forward(
        self, h, targets, embed, weight, positions, documents=None, segment=None
    ) -> torch.Tensor:
        """Σ over depths and positions of the MTP cross entropy times coef / D; `h` (B, T[/tp],
        d) the main hidden states, `targets` (B, T/cp) this rank's main targets, `embed` the
        token lookup, `weight` the head's (V/tp, d) vocabulary slice. Under Seq1F1B, h and
        targets are one segment's and `segment` its SegmentScope: each depth's block carries
        its own K/V across segments as the main layers do, and the inputs and targets past the
        segment's end come from the scope's whole rows (parallel/autograd/segment_kv.py)."""
        whole, places = self._whole(targets, documents, segment)  # (B, T), (n,)
        T, first = whole.shape[1], segment.start if segment is not None else 0
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        vocab_start = self.tp.rank * weight.shape[0]
        for k, module in enumerate(self.depths, start=1):
            ids = whole[:, (places + k - 1).clamp(max=T - 1)]  # t_{i+k}; the last repeated
            h = module(h, embed(ids), positions, documents, segment)
            # the positions with a token k + 1 ahead: without cp the first T − k (of a segment
            # from `first`), a slice (no data-dependent shape, so fake tensors
            # (train/fake_ranks.py) run it too); an empty slice keeps the block in the graph
            keep = places < T - k if self.cp.size > 1 else slice(0, max(T - k - first, 0))
            x = enter_column(module.norm(h), self.tp)[:, keep]  # (B, n, d)
            want = whole[:, places[keep] + k]  # t_{i+k+1}
            ce = linear_cross_entropy(x, weight, want, vocab_start, self.vocab_size, self.tp)
            total = total + ce.float()
        return total * (self.coef / len(self.depths))

    def _whole(self, targets, documents, segment) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sequences' targets and the places of this rank's tokens in them: a Seq1F1B
        segment's span of the scope's rows; under cp the rank's slice (zigzag, or the chunks of
        parallel.cp_balance=documents' layout, parallel/context/balance.py, as the loader cut
        them), the targets gathered over cp (the shifted ones lie on other cp ranks)."""
        if segment is not None:  # cp = 1 (config/checks.py refuses segments under cp)
            start = segment.start
            places = torch.arange(start, start + targets.shape[1], device=targets.device)
            return segment.targets, places
        T = targets.shape[1] * self.cp.size
        places = torch.arange(T, device=targets.device)
        places = self.cp.shard(places, 0, self.cp.layout(documents))  # (T/cp,)
        if self.cp.size == 1:
            return targets, places
        every = C.all_gather(targets, 1, self.cp.group)
        whole = torch.empty_like(every)
        whole[:, C.all_gather(places, 0, self.cp.group)] = every
        return whole, places
