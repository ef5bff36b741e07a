"""The mixture-of-experts MLP (docs/moe.md): a float32 router, token-choice top-k, stacked experts
computed through parallel/expert/dispatch.py, optional shared experts, a per-sequence capacity,
and the load-balancing and z losses.

Routing (Mixtral, Jiang et al. 2024; Switch, Fedus et al. 2021): logits = x W_rᵀ in float32,
p = softmax(logits), each token takes its top_k experts with weights p / Σ_top-k p (p itself
with model.norm_topk_prob=false, as transformers' Qwen3-MoE may). With
`moe_capacity_factor` cf > 0 each expert takes at most ceil(cf · T · top_k / E) rows of a
sequence of T tokens, the first ones in token order (a rule of the sequence alone: cp and
sequence-parallel ranks learn their tokens' places from the whole sequence's choices); a dropped
row contributes nothing (the token keeps its residual). Losses, per sequence (the sequence-wise
balance loss of DeepSeek-V3 §2.1.2; GShard's groups = sequences) because a pipeline runs
microbatch 0's backward before the last microbatch's forward, so no batch-wide statistic exists
in time: aux = E · Σ_e f_e · P_e (f_e: the share of the sequence's routed rows that chose e,
P_e: its mean router probability), z = mean over tokens of logsumexp(logits)² (ST-MoE, Zoph et
al. 2022). Both are averaged over the global batch as the LM loss is: the layer adds
coef · (T · aux + Σ_t z_t) in the LM loss's summed units to the backward through `attach_loss`
(an identity on the hidden states whose backward seeds the loss's grad, 1 / `loss_scale`), so
the reported LM loss stays the LM loss. Experts whole in every tp rank (docs/moe.md): the layer
works on the tokens the rank holds, like a norm.

Under Seq1F1B (Sun et al. 2024) a forward sees one segment of its sequences: it keeps the
segment's counts per expert (and its probability mass) in the segment store
(parallel/autograd/segment_kv.py), starts the capacity after the earlier segments' counts, and
makes the balance loss's grad in backward, when every segment's counts are known, so routing,
drops and losses are the whole sequence's (docs/moe.md, "Under Seq1F1B").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.config.flops import expert_ffn
from megapipe.config.schema import gated
from megapipe.distributed import collectives as C
from megapipe.models.activations import gelu_tanh, swiglu
from megapipe.models.routing import make_routing
from megapipe.parallel.autograd.grouped_linear import grouped_linear, stacked_weight_grad
from megapipe.parallel.autograd.weight_grad import accumulate
from megapipe.parallel.context.zigzag import NO_CP, CPInfo
from megapipe.parallel.expert.dispatch import combine, dispatch
from megapipe.parallel.expert.sharding import NO_EP, EPInfo, mark_experts
from megapipe.parallel.fp8_experts import deferred_weight_grad as fp8_deferred_weight_grad
from megapipe.parallel.fp8_experts import fp8_grouped_linear
from megapipe.parallel.tensor.layers import REPLICATED, ShardedModule
from megapipe.parallel.tensor.sharding import NO_TP, TPInfo


class Router(ShardedModule):
    """The gate: a d → E linear held and computed in float32 whatever the weights' dtype."""

    keep_float32 = True  # parallel/precision.Precision.hold leaves it in float32

    def __init__(self, d: int, n_experts: int, tp: TPInfo) -> None:
        super().__init__(tp)
        self._add_param("weight", (n_experts, d), REPLICATED, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float())


class Experts(ShardedModule):
    """E FFNs as stacked weights with a leading expert dim (ep shards are slices of dim 0):
    `w_in` (E, f, d) or (E, 2f, d) as [gate | up] for llama, `w_out` (E, d, f); gpt2 also
    `in_bias` (E, f) and `out_bias` (E, d)."""

    def __init__(self, cfg: ModelConfig, ffn: int, tp: TPInfo, ep: EPInfo) -> None:
        super().__init__(tp)
        self.swiglu = gated(cfg.arch)
        e, d = cfg.n_experts, cfg.d_model
        fan = 2 * ffn if self.swiglu else ffn
        self.ep = ep
        self._add_experts("w_in", (e, fan, d))
        self._add_experts("w_out", (e, d, ffn))
        self.has_bias = not self.swiglu
        self.fp8_experts = None  # an Fp8Experts (parallel/fp8_experts.py) under train.fp8
        if self.has_bias:
            self._add_experts("in_bias", (e, fan))
            self._add_experts("out_bias", (e, d))

    def _add_experts(self, name: str, shape: tuple[int, ...]) -> None:
        """A stacked expert weight of logical `shape`, holding this ep rank's E/ep experts
        (parallel/expert/sharding.py), whole on every tp rank."""
        self._add_param(name, shape, REPLICATED, self.tp)
        local = (shape[0] // self.ep.size, *shape[1:])
        self.register_parameter(name, nn.Parameter(torch.empty(local)))
        mark_experts(self.ep, getattr(self, name))

    def forward(self, rows: torch.Tensor, counts: list[int], by_source=None) -> torch.Tensor:
        """Rows grouped by local expert (`counts`) through their expert's FFN; `by_source`
        (E/ep, ep): each expert's rows from each ep rank (dispatch), which FP8 casts apart."""
        in_bias = self.in_bias if self.has_bias else None
        out_bias = self.out_bias if self.has_bias else None
        matmul, groups = grouped_linear, counts
        if self.fp8_experts is not None:
            matmul = fp8_grouped_linear
            groups = counts if by_source is None else by_source.flatten().tolist()
        h = matmul(rows, self.w_in, in_bias, groups, self, "w_in", "in_bias")
        h = swiglu(h) if self.swiglu else gelu_tanh(h)
        return matmul(h, self.w_out, out_bias, groups, self, "w_out", "out_bias")

    @torch.no_grad()
    def deferred_weight_grad(self, name: str, *queued) -> None:
        """A Zero Bubble W action's share: the queued stacked weight grad (weight_grad.py),
        from (x, grad_out, counts), or under FP8 from (quantized operands, parts)."""
        if self.fp8_experts is not None:
            fp8_deferred_weight_grad(self, name, queued[0])
            return
        x, grad_out, counts = queued
        param = getattr(self, name)
        grad = stacked_weight_grad(param, x, grad_out, counts)
        if grad is not None:
            accumulate(param, grad)


class _AttachLoss(torch.autograd.Function):
    """Identity on x whose backward seeds the layer's losses in the LM loss's summed units,
    times `scale`: the z-loss (`z`, Σ over tokens) with z_coef, and the balance loss through
    `mass` (b, E), Σ over this part's tokens of the router probabilities, whose grad is
    aux_coef · E · f_e with f the whole sequences' shares (a Seq1F1B segment's from every
    segment's counts, `MoE.segment_share`, known by its backward). Hands `stats` to the sink
    (once per microbatch, also under recompute, whose forward runs twice)."""

    @staticmethod
    def forward(ctx, x, mass, z, share, scale, stats, moe, segment):
        if share is not None:  # unsegmented: f known now
            ctx.save_for_backward(share)
        ctx.scale, ctx.stats, ctx.moe, ctx.segment = scale, stats, moe, segment
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        moe, segment, stats = ctx.moe, ctx.segment, ctx.stats
        if segment is None:
            (share,) = ctx.saved_tensors
        else:
            share, own_mass = moe.segment_share(segment)
            aux = moe.n_experts * (share * own_mass).sum()  # this segment's part of T · aux
            stats = torch.cat([stats[:-2], aux.detach().reshape(1).to(stats), stats[-1:]])
        moe.stats.add(stats)
        moe.routing.count(stats[: moe.n_experts])  # aux-loss-free balancing's load
        grad_mass = share * (ctx.scale * moe.aux_coef * moe.n_experts)
        grad_z = torch.full((), ctx.scale * moe.z_coef, dtype=torch.float32, device=grad.device)
        return grad, grad_mass, grad_z, None, None, None, None, None


class StatsSink:
    """A MoE layer's statistics summed over a step's microbatches: routed rows per expert,
    dropped rows, T·aux and Σ z (the losses in the LM loss's summed units, before their coefs)."""

    def __init__(self, n_experts: int) -> None:
        self.size = n_experts + 3
        self.total = None  # on the stats' device: no host sync per microbatch

    def add(self, stats: torch.Tensor) -> None:
        if self.total is None:
            self.total = torch.zeros(self.size, dtype=torch.float64, device=stats.device)
        self.total += stats

    def take(self) -> torch.Tensor:
        """The sums since the last take (zeros when no backward ran)."""
        out = self.total if self.total is not None else torch.zeros(self.size, dtype=torch.float64)
        self.total = None
        return out


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a layer's MLP; input and output (B, n, d),
    n the tokens this rank holds (its cp slice, its tp chunk under sequence parallelism)."""

    def __init__(
        self,
        cfg: ModelConfig,
        d_ff: int,
        tp: TPInfo = NO_TP,
        cp: CPInfo = NO_CP,
        ep: EPInfo = NO_EP,
        shared: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.router = Router(cfg.d_model, cfg.n_experts, tp)
        self.routing = make_routing(cfg)  # softmax top-k, or DeepSeek-V3's (models/routing.py)
        self.experts = Experts(cfg, expert_ffn(cfg, d_ff), tp, ep)
        self.shared = shared  # an MLP of moe_shared_experts · ffn (models/gpt.py), or None
        self.tp, self.cp, self.ep = tp, cp, ep
        self.loss_scale = 1.0  # the LM loss's divisor (pipeline/stages.py sets it)
        self.stats = StatsSink(cfg.n_experts)
        self._eager = None

    def drop_counts(self) -> None:
        """Forget this step's statistics and load so far: post-validation's redo
        (train/post_validation.py) runs the step's forwards and backwards again and counts
        them afresh."""
        self.stats.take()
        self.routing.drop_load()

    def keep_eager(self) -> None:
        """Run outside compiled graphs (dispatch's sizes are data-dependent)."""
        self._eager = torch.compiler.disable(self._math)

    def forward(self, x: torch.Tensor, segment=None) -> torch.Tensor:
        """`segment`: a Seq1F1B SegmentScope (parallel/autograd/segment_kv.py) when x is one
        segment of its sequences, else None."""
        return (self._eager or self._math)(x, segment)

    def _math(self, x: torch.Tensor, segment=None) -> torch.Tensor:
        b, n, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.router(flat)  # (b·n, E) float32
        probs, top_i, gates = self.routing(logits)  # (b·n, E), (b·n, k), (b·n, k)
        chosen = torch.zeros_like(probs, dtype=torch.int32).scatter_(1, top_i, 1).view(b, n, -1)
        counts = self._sequence_sum(chosen.sum(1).double()).float()  # (b, E): the sequences'
        mass = probs.view(b, n, -1).sum(1)  # (b, E): this rank's part of T · P_e
        seq_len, carried = n * self._ranks_per_sequence(), None
        if segment is not None:  # Seq1F1B: the earlier segments' rows count first
            earlier = segment.carry(self, (counts, mass.detach()))
            seq_len, carried = segment.tokens, sum(c for c, _ in earlier) if earlier else None
        keep = self._kept(chosen, seq_len, carried)  # (b, n, E) int, or None: dropless
        rows_kept = None if keep is None else keep.view(b * n, -1).gather(1, top_i).bool()
        y = self._experts(flat, top_i, gates, rows_kept).view(b, n, d)
        if self.shared is not None:
            y = y + self.shared(x)
        z = torch.logsumexp(logits, -1).pow(2).sum()
        share = None if segment is not None else self._share(counts, seq_len)
        stats = self._stats(chosen, rows_kept, mass, share, z)
        args = (mass, z, share, 1.0 / self.loss_scale, stats, self, segment)
        return _AttachLoss.apply(y, *args)

    def _experts(self, flat, top_i, gates, rows_kept) -> torch.Tensor:
        """Σ over a token's kept choices of gate · expert(x): rows are (token, choice) pairs in
        token order, dispatched to their experts and combined back."""
        k = self.top_k
        token_of = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(k)
        expert_of, weight = top_i.reshape(-1), gates.reshape(-1)
        if rows_kept is not None:
            kept = rows_kept.reshape(-1)
            token_of, expert_of, weight = token_of[kept], expert_of[kept], weight[kept]
        grouped, counts, plan = dispatch(flat[token_of], expert_of, self.n_experts, self.ep)
        out = combine(self.experts(grouped, counts.tolist(), plan.by_source), plan, self.ep)
        out = out * weight.to(out.dtype).unsqueeze(-1)
        return torch.zeros_like(flat).index_add_(0, token_of, out.to(flat.dtype))

    def _ranks_per_sequence(self) -> int:
        return self.cp.size * (self.tp.size if self.tp.sp else 1)

    def _sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks holding parts of the same sequences (tp under SP, cp)."""
        if self.tp.sp:
            t = C.all_reduce(t, self.tp.group)
        if self.cp.size > 1:
            t = C.all_reduce(t, self.cp.group)
        return t

    def _positions(self, n: int, device) -> torch.Tensor:
        """The places (n,) of this rank's tokens in their sequence: cp's zigzag slice, then
        this tp rank's chunk of it under sequence parallelism."""
        per_cp = n * (self.tp.size if self.tp.sp else 1)
        pos = self.cp.positions(per_cp * self.cp.size, device)
        return pos.chunk(self.tp.size)[self.tp.rank] if self.tp.sp else pos

    def _kept(self, chosen: torch.Tensor, seq_len: int, carried=None) -> torch.Tensor | None:
        """(b, n, E): 1 where a token's choice of expert e is within e's capacity, the first
        ceil(cf · T · k / E) choices of e in the sequence's token order; None: dropless.
        `carried` (b, E): the choices of the sequences' earlier Seq1F1B segments, which come
        first (T: the whole sequence)."""
        if self.capacity_factor <= 0:
            return None
        capacity = math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)
        if carried is not None:
            capacity = capacity - carried.long().unsqueeze(1)  # (b, 1, E) places left
        if self._ranks_per_sequence() == 1:
            return chosen * (chosen.cumsum(1) <= capacity)
        pos = self._positions(chosen.shape[1], chosen.device)
        all_pos, all_chosen = pos, chosen
        for group in self._sequence_groups():
            all_pos = C.all_gather(all_pos, 0, group)
            all_chosen = C.all_gather(all_chosen, 1, group)
        whole = torch.zeros_like(all_chosen)
        whole[:, all_pos] = all_chosen  # the whole sequences' choices in token order
        place = whole.cumsum(1)[:, pos]
        return chosen * (place <= capacity)

    def _sequence_groups(self) -> list:
        groups = [self.tp.group] if self.tp.sp else []
        return groups + ([self.cp.group] if self.cp.size > 1 else [])

    def _share(self, counts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """f_e (b, E): the share of each sequence's T · k routed rows that chose e (before
        drops), from its whole counts; float32, not differentiated."""
        return (counts.double() / (seq_len * self.top_k)).float()

    def segment_share(self, segment) -> tuple[torch.Tensor, torch.Tensor]:
        """In a Seq1F1B segment's backward: f over the whole sequences (every segment's counts)
        and this segment's probability mass (b, E)."""
        records = segment.whole(self)
        counts = torch.stack([c for c, _ in records]).sum(0)
        return self._share(counts, segment.tokens), records[segment.segment][1]

    def _stats(self, chosen, rows_kept, mass, share, z) -> torch.Tensor:
        """This rank's stats row: routed rows per expert, dropped rows, T·aux (Σ over its
        sequences, its part; a Seq1F1B segment's is added in backward) and Σ z."""
        aux = 0.0 if share is None else self.n_experts * (share * mass.detach()).sum()
        dropped = 0 if rows_kept is None else rows_kept.numel() - rows_kept.sum()
        routed = chosen.sum((0, 1)).double()
        extra = [torch.as_tensor(v).double().to(routed.device) for v in (dropped, aux, z.detach())]
        return torch.cat([routed, torch.stack(extra)])


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """What the summed LM loss is divided by before backward, for `model`'s MoE layers' losses
    (pipeline/stages.py sets it from the config; tests that build a GPT by hand set it too)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.loss_scale = scale


def routing_biases(model: nn.Module):
    """(logical name, buffer, TPInfo) of every selection bias of `model` (DeepSeek-V3's routing,
    models/routing.py): state that checkpoints keep beside the parameters."""
    for name, module in model.named_modules():
        if isinstance(module, MoE) and hasattr(module.routing, "bias"):
            yield f"{name}.routing.bias", module.routing.bias, module.tp
