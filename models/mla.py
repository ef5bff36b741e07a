"""Multi-head latent attention (MLA: DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1), model.arch deepseek_v3.

Keys and values come from a compressed latent: c = RMSNorm(x W_kv_a) of width kv_lora_rank,
up-projected per head to a key part without RoPE (qk_nope_head_dim) and a value (v_head_dim).
RoPE is decoupled: one rope key of qk_rope_head_dim per token, shared by every head, comes from
the same down projection; each head's query is [q_nope | RoPE(q_rope)] and its key
[k_nope | RoPE(k_rope)]. The query has its own low-rank path (x W_q_a, RMSNorm, W_q_b) when
model.q_lora_rank > 0, else one projection. The softmax scale is 1/sqrt(qk_nope + qk_rope)
(transformers' DeepseekV3Attention), times m(s, mscale_all_dim)² under YaRN (models/rope.py).
Weights hold the rope dims in rotate-half order; models/hf_deepseek.py permutes
transformers' interleaved order (rope_interleave) on the way in.

Under tp the heads split: the up projections (q_b or q, kv_b) are column-parallel by head and
the output projection row-parallel. The down projections (q_a, kv_a) stay whole on every tp
rank: they are small (d_model × (kv_lora_rank + qk_rope_head_dim)), and every head needs their
whole output, so splitting them would only add an all-gather. Their input is the rank's tokens
(its sequence chunk under sequence parallelism); the latent then enters the column region (f,
or SP's all-gather) inside the up projection, and the shared rope key by its own enter_column,
so their grads are whole on every rank, or under SP each rank's chunk's, summed over tp with
the other replicated parameters (parallel/tensor/grad_sync.py).

Under cp the value head dim may differ from the query/key one, which the ring's kernels do not
take (parallel/context/ring.py wants k and v of one shape): values are zero-padded to the key
width there and the pad cut from the output (its columns are exactly zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.models.attention import Attention, apply_rope
from megapipe.models.rope import Rope, softmax_gain
from megapipe.parallel.context.zigzag import NO_CP, CPInfo
from megapipe.parallel.recompute import maybe_checkpoint
from megapipe.parallel.tensor.layers import (
    REPLICATED,
    ColumnParallelLinear,
    ParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from megapipe.parallel.tensor.mappings import enter_column
from megapipe.parallel.tensor.random import replayable
from megapipe.parallel.tensor.sharding import NO_TP, TPInfo


class ReplicatedLinear(ParallelLinear):
    """y = x Wᵀ with W whole on every tp rank, on the rank's own tokens (no tp collective)."""

    def __init__(self, in_features: int, out_features: int, tp: TPInfo = NO_TP) -> None:
        super().__init__(tp)
        self.tp_splits = "none"  # no features: under SP its tokens (parallel/fp8.py Fp8.apply)
        self._add_param("weight", (out_features, in_features), REPLICATED, tp)
        self.register_parameter("bias", None)

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, None)


class MLA(Attention):
    """Latent attention with Attention's core (dense kernels, the cp variants, Seq1F1B's K/V
    carry, selective recompute); heads split over tp."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = NO_TP, selective=False, cp: CPInfo = NO_CP):
        torch.nn.Module.__init__(self)
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.head_dim = self.nope + self.rope  # the query/key width the scale is taken over
        self.dropout, self.selective, self.tp, self.cp = cfg.dropout, selective, tp, cp
        self._eager_core, self.window = None, 0  # attention_core takes a window: MLA has none
        self.rotary, self.kv_rank = Rope(cfg, self.rope), cfg.kv_lora_rank
        self.gain = softmax_gain(cfg)  # yarn's softmax scale on top of 1/sqrt(qk width)
        h, d, qk = cfg.n_heads, cfg.d_model, self.head_dim
        self.local_heads = self.local_kv_heads = h // tp.size
        if cfg.q_lora_rank:
            self.q_a = ReplicatedLinear(d, cfg.q_lora_rank, tp)
            self.q_norm = RMSNorm(cfg.q_lora_rank, 1e-6, tp)  # transformers' fixed eps
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, h * qk, False, tp, unit=qk)
        else:
            self.q_a = self.q_norm = None
            self.q_b = ColumnParallelLinear(d, h * qk, False, tp, unit=qk)
        self.kv_a = ReplicatedLinear(d, self.kv_rank + self.rope, tp)
        self.kv_norm = RMSNorm(self.kv_rank, 1e-6, tp)
        unit = self.nope + self.v_dim  # per head: [k_nope | v], transformers' kv_b_proj rows
        self.kv_b = ColumnParallelLinear(self.kv_rank, h * unit, False, tp, unit=unit)
        self.proj = RowParallelLinear(h * self.v_dim, d, False, tp, unit=self.v_dim)

    def linears(self) -> tuple[torch.nn.Module, ...]:
        down = () if self.q_a is None else (self.q_a,)
        return (*down, self.q_b, self.kv_a, self.kv_b, self.proj)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_a is None:
            return self.q_b(x)
        return self.q_b(self.q_norm(self.q_a(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segment=None, documents=None):
        """As Attention.forward: x (B, T[/tp], d) in, (B, T[/tp], d) out."""
        q = self._queries(x)  # (B, T, H/tp·(nope+rope)); SP's gather inside q_b
        B, T, _ = q.shape
        h, nope, rope, vd = self.local_heads, self.nope, self.rope, self.v_dim
        latent, k_rope = self.kv_a(x).split([self.kv_rank, rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent))  # (B, T, H/tp·(nope+v))
        k_rope = enter_column(k_rope, self.tp)  # (B, T, rope): every head's, grad summed
        q = q.view(B, T, h, nope + rope).transpose(1, 2)  # (B, H/tp, T, nope+rope)
        k_nope, v = kv.view(B, T, h, nope + vd).transpose(1, 2).split([nope, vd], dim=-1)
        cos, sin = self.rotary.tables(positions)
        q_rope = apply_rope(q[..., nope:], cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).expand(B, h, T, rope)
        q = torch.cat([q[..., :nope], q_rope], dim=-1)
        # the cores' 1/sqrt(qk width) times the gain: softmax((g·q)·k / sqrt(d)) is the
        # scaled softmax, on every kernel and cp variant alike (models/rope.softmax_gain)
        q = q * self.gain if self.gain != 1.0 else q
        k = torch.cat([k_nope, k_rope], dim=-1)  # (B, H/tp, T, nope+rope)
        # the ring (and flash-attn) want v shaped as k; config checks keep vd <= nope + rope there
        pad = nope + rope - vd if self.cp.size > 1 or q.is_cuda else 0
        v = F.pad(v, (0, pad)) if pad > 0 else v
        if segment is not None:  # Seq1F1B: prepend earlier segments' K/V
            k, v = segment.extend(self, k, v)
        p = self.dropout if self.training else 0.0
        core = self._core if self._eager_core is None else self._eager_core
        y = maybe_checkpoint(self.selective, replayable(core, self.tp), q, k, v, p, documents)
        y = y[..., :vd] if pad > 0 else y
        y = y.transpose(1, 2).reshape(B, T, h * vd)  # (B, T, H/tp·v)
        return self.proj(y)
