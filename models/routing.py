"""How a MoE layer turns router logits into each token's experts and gates (models/moe.py).

- `SoftmaxTopK` (Mixtral, Jiang et al. 2024; Qwen3-MoE): p = softmax(logits), the top_k of p,
  gates p / Σ_top-k p, or the top_k p as they are when norm_topk_prob is false.
- `SigmoidGroupTopK` (DeepSeek-V3 §2.1.2, model.arch deepseek_v3; transformers'
  DeepseekV3TopkRouter): s = sigmoid(logits); the experts fall in n_group groups, each scored by
  the sum of its best two s + b; a token picks its top_k experts within its topk_group best
  groups by s + b, with b the per-expert selection bias (`e_score_correction_bias`) that never
  enters the gates; gates = s of the chosen experts, divided by their sum when norm_topk_prob,
  times routed_scaling_factor. The balance loss's probabilities are s normalised over the
  experts (DeepSeek-V3 eq. 20).

The bias is aux-loss-free balancing's (DeepSeek-V3 §2.1.2): `update_bias` moves it by
rate · sign(mean load − load) after each optimizer step, from the load of the whole batch
(train/moe_balance.py sums it over the mesh first, so every rank takes the same step).
It is a float32 buffer, not a parameter: no gradient, no optimizer state.
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe.config import ModelConfig


class SoftmaxTopK(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm = cfg.top_k, cfg.norm_topk_prob

    def count(self, routed: torch.Tensor) -> None:
        """The load is not kept (no bias to balance)."""

    def drop_load(self) -> None:
        """Nothing kept to drop."""

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(probabilities (N, E) for the balance loss, chosen experts (N, k), gates (N, k))."""
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (N, k)
        return probs, top_i, top_p / top_p.sum(-1, keepdim=True) if self.norm else top_p


class SigmoidGroupTopK(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.top_k, cfg.n_group, cfg.topk_group
        self.scale, self.norm = cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.rate = cfg.moe_bias_update_rate
        self.register_buffer("bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        self.load = None  # this step's rows per expert on this rank, float64

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scores = logits.sigmoid()  # (N, E) float32
        choice = scores.detach() + self.bias
        n, e = choice.shape
        if self.n_group > 1:
            grouped = choice.view(n, self.n_group, e // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
            best = group_score.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(n, e)
            choice = choice.masked_fill(~keep, float("-inf"))
        top_i = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        gates = scores.gather(1, top_i)
        if self.norm:  # transformers' 1e-20 guard against an all-zero row
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(-1, keepdim=True)
        return probs, top_i, gates * self.scale

    def count(self, routed: torch.Tensor) -> None:
        """Add a microbatch's rows per expert (E,) to this step's load (models/moe.py)."""
        routed = routed.detach().to(torch.float64)
        self.load = routed if self.load is None else self.load + routed

    def drop_load(self) -> None:
        """Forget this step's load so far (post-validation's redo counts it again)."""
        self.load = None

    def take_load(self) -> torch.Tensor:
        """This step's load on this rank (zeros when no backward ran), and start the next."""
        load = self.load if self.load is not None else torch.zeros(self.bias.shape[0])
        self.load = None
        return load.to(torch.float64).cpu()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """bias += rate · sign(mean load − load): `load` (E,) the whole batch's rows per expert
        (the same on every rank)."""
        load = load.to(self.bias.device, torch.float64)
        self.bias += self.rate * torch.sign(load.mean() - load).float()


def make_routing(cfg: ModelConfig) -> nn.Module:
    return SigmoidGroupTopK(cfg) if cfg.arch == "deepseek_v3" else SoftmaxTopK(cfg)
