"""GPT as an ordered list of blocks: [embedding, layer_0 … layer_{L-1}, final norm + LM head].

Block b of a model with L layers is: 0 the embedding, 1..L the transformer layers, L+1 the head.
`GPT(cfg, blocks=range(i, j))` builds any contiguous range, which is what a pipeline stage holds.
Parameter names are logical (`layers.5.mlp.fc1.weight`) whatever the range, and every parameter
is initialised from (seed, name), so the weights do not depend on how the model is split.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import Config, Derived, ModelConfig, RecomputeConfig
from megapipe.config.archs import arch_of
from megapipe.config.flops import expert_ffn, is_moe_layer
from megapipe.models.activations import gelu_tanh, relu2, swiglu
from megapipe.models.attention import Attention
from megapipe.models.init import init_parameters
from megapipe.models.mla import MLA, ReplicatedLinear
from megapipe.models.moe import MoE
from megapipe.models.mtp import MTP, MTPModule
from megapipe.parallel.context.zigzag import NO_CP, CPInfo
from megapipe.parallel.expert.sharding import NO_EP, EPInfo
from megapipe.parallel.precision import Precision
from megapipe.parallel.recompute import (
    ActivationOffload,
    layer_mode,
    maybe_checkpoint,
    selective_parts,
)
from megapipe.parallel.tensor.cross_entropy import HeadBuffers, linear_cross_entropy
from megapipe.parallel.tensor.layers import (
    ColumnParallelLinear,
    LayerNorm,
    LayerNorm1P,
    ReplicatedEmbedding,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megapipe.parallel.tensor.mappings import enter_column, gather_from_tp
from megapipe.parallel.tensor.random import replayable, sharded_rng
from megapipe.parallel.tensor.sharding import NO_TP, TPInfo
from megapipe.plan.schedules import SCHEDULES


def sp_rng(tp: TPInfo) -> contextlib.AbstractContextManager:
    """Dropout on the residual stream: one stream on every tp rank, except under SP, where each
    rank holds its own sequence chunk and draws from its tp-rank stream (Megatron)."""
    return sharded_rng(tp) if tp.sp else contextlib.nullcontext()


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "layernorm1p": LayerNorm1P}


def make_norm(cfg: ModelConfig, tp: TPInfo) -> nn.Module:
    """The arch's norm (config/archs.Arch.norm)."""
    return NORMS[arch_of(cfg.arch).norm](cfg.d_model, cfg.norm_eps, tp)


ACTIVATIONS = {"gelu": gelu_tanh, "swiglu": swiglu, "relu2": relu2}  # config/archs.Arch.mlp


class MLP(nn.Module):
    """GPT-2: fc2(gelu_tanh(fc1 x)). Llama: fc2(silu(gate x) · up x) with fc1 = [gate | up].
    Nemotron: fc2(relu(fc1 x)²)."""

    def __init__(self, cfg: ModelConfig, d_ff: int, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        arch = arch_of(cfg.arch)
        self.activation = ACTIVATIONS[arch.mlp]
        fc1_out = [d_ff, d_ff] if arch.gated else d_ff
        self.fc1 = ColumnParallelLinear(cfg.d_model, fc1_out, arch.biases, tp)
        self.fc2 = RowParallelLinear(d_ff, cfg.d_model, arch.biases, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, T, d_ff/tp) or (B, T, 2·d_ff/tp)
        return self.fc2(self.activation(h))

    def linears(self) -> tuple[nn.Module, ...]:
        return (self.fc1, self.fc2)


def make_mlp(cfg: ModelConfig, d: Derived, tp: TPInfo, cp: CPInfo, ep: EPInfo, index: int):
    """Layer `index`'s MLP: dense, or a mixture of experts (models/moe.py) on every
    `model.moe_every`-th layer, its shared experts one MLP of moe_shared_experts · ffn."""
    if not is_moe_layer(cfg, index):
        return MLP(cfg, d.d_ff, tp)
    ffn = expert_ffn(cfg, d.d_ff)
    shared = MLP(cfg, cfg.moe_shared_experts * ffn, tp) if cfg.moe_shared_experts else None
    return MoE(cfg, d.d_ff, tp, cp, ep, shared)


class Embedding(nn.Module):
    """Block 0: token embedding (+ learned positions for GPT-2), then dropout.

    `table_only` builds just the token table: a last pipeline stage with a tied head keeps its
    own copy under the same logical name (Megatron's shared word embeddings, synced by grads).
    """

    def __init__(self, cfg: ModelConfig, tp: TPInfo = NO_TP, table_only: bool = False) -> None:
        super().__init__()
        self.tok = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp)
        learned_pos = arch_of(cfg.arch).learned_positions and not table_only
        self.pos = ReplicatedEmbedding(cfg.seq_len, cfg.d_model, tp) if learned_pos else None
        self.drop = nn.Dropout(cfg.dropout)
        self.tp = tp

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, with_table: bool = False):
        """Hidden states (B, T, d); `with_table`: and the token table for a tied head in the
        same graph (VocabParallelEmbedding.lookup_with_table)."""
        table = None
        if with_table:
            h, table = self.tok.lookup_with_table(ids)
        else:
            h = self.tok(ids)  # (B, T, d), or (B, T/tp, d) with SP
        if self.pos is not None:
            if self.tp.sp:  # this rank's sequence chunk (Korthikanti et al. 2022, §4.2.2)
                positions = positions.chunk(self.tp.size, dim=-1)[self.tp.rank]
            h = h + self.pos(positions)
        with sp_rng(self.tp):
            h = self.drop(h)
        return (h, table) if with_table else h


def eager_linears(split_weight_grads: bool, tp: int, main_grads: bool) -> bool:
    """Whether TransformerLayer.compile_math leaves the layer's linears eager (its docstring
    says why): weight grads deferred to a Zero Bubble W, tp > 1, or bf16 weights' main grads.
    Then the autocast cast of each linear's input stays in the eager linear, unfused."""
    return split_weight_grads or tp > 1 or main_grads


def split_weight_grads(cfg: Config) -> bool:
    """Whether the schedule defers the linears' weight grads to W actions (Zero Bubble)."""
    return cfg.parallel.pp > 1 and SCHEDULES[cfg.parallel.schedule].split_backward


def compiled_linears(cfg: Config) -> bool:
    """Whether train.compile compiles the layers' linears with their math (compile_math)."""
    main_grads = Precision.of(cfg.train).main_grads  # bf16 weights' float32 main grads
    eager = eager_linears(split_weight_grads(cfg), cfg.parallel.tp, main_grads)
    return cfg.train.compile and not eager


class TransformerLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm1 x), then + mlp(norm2 x)."""

    def __init__(
        self,
        cfg: ModelConfig,
        d: Derived,
        tp: TPInfo,
        recompute: str,
        cp: CPInfo = NO_CP,
        index: int = 0,
        ep: EPInfo = NO_EP,
        parts: frozenset[str] = frozenset({"core_attn"}),
    ) -> None:
        """`recompute`: this layer's mode (schema.layer_mode); `parts`: what "selective"
        reruns (recompute.modules: core_attn, mlp, layernorm)."""
        super().__init__()
        self.norm1 = make_norm(cfg, tp)
        selective = recompute == "selective" and "core_attn" in parts
        window = cfg.sliding_window if index >= cfg.max_window_layers else 0
        if cfg.arch == "deepseek_v3":  # multi-head latent attention
            self.attn = MLA(cfg, tp, selective, cp)
        else:
            self.attn = Attention(cfg, d.n_kv_heads, tp, selective, cp, window)
        self.norm2 = make_norm(cfg, tp)
        self.mlp = make_mlp(cfg, d, tp, cp, ep, index)
        self.drop = nn.Dropout(cfg.dropout)
        self.full_recompute = recompute == "full"
        # selective's mlp part: norm2 and the dense MLP rerun in backward from the residual
        # (their activations are d_ff wide: the largest a dense layer keeps)
        dense = not isinstance(self.mlp, MoE)
        self.mlp_recompute = recompute == "selective" and "mlp" in parts and dense
        # selective's layernorm part needs nothing here: every norm keeps its input alone and
        # reruns in its backward (parallel/autograd/rerun.py)
        self.offload = ActivationOffload(self) if recompute == "offload" else None
        self.tp = tp

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segment=None, documents=None):
        fn = replayable(self._forward, self.tp)
        with self.offload.hooks() if self.offload else contextlib.nullcontext():
            return maybe_checkpoint(self.full_recompute, fn, x, positions, segment, documents)

    def _forward(self, x: torch.Tensor, positions: torch.Tensor, segment, documents=None):
        h = self.attn(self.norm1(x), positions, segment, documents)
        x = x + self._dropout(h)  # (B, T[/tp], d)
        if isinstance(self.mlp, MoE):  # a Seq1F1B segment's routing reads earlier segments'
            return x + self._dropout(self.mlp(self.norm2(x), segment))
        if self.mlp_recompute:  # norm2 and the MLP rerun in backward from the residual
            return x + self._dropout(maybe_checkpoint(True, self._mlp, x))
        return x + self._dropout(self.mlp(self.norm2(x)))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm2(x))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        with sp_rng(self.tp):
            return self.drop(x)

    def compile_math(self, split_weight_grads: bool = False) -> None:
        """torch.compile this layer's math (`_forward`), one graph per layer kind; the full
        recompute checkpoint and the tp RNG replay around it stay eager, so they work as
        before. What cannot be traced runs eagerly between compiled pieces (a graph break):
        - the linears, when their weight grads may be deferred to a Zero Bubble W
          (`split_weight_grads`): parallel/autograd/weight_grad.py reads the B action's key
          when backward runs, which a compiled backward would fix at trace time; and under
          tp, where their f/g collectives sit; and with bf16 weights, whose weight and bias
          grads backward adds into float32 main grads (parallel/precision.py), a side effect
          a compiled backward would not keep;
        - the attention core under cp (ring attention's p2p) and tp (the dropout RNG tracker);
        - the residual dropout under sequence parallelism (the tracker again).
        Each is asked through a method of its own (`keep_eager`, `keep_core_eager`), never by
        rebinding its methods. Dropout draws from the same generator as eager: inductor's
        `fallback_random`, set for this compile only (no process-global config)."""
        main_grads = hasattr(self.attn.proj.weight, "main_grad")
        eager = eager_linears(split_weight_grads, self.tp.size, main_grads)
        if isinstance(self.mlp, MoE):  # dispatch's row counts are data-dependent
            self.mlp.keep_eager()
        elif eager:
            for linear in self.mlp.linears():
                linear.keep_eager()
        if eager:
            for linear in self.attn.linears():
                linear.keep_eager()
        if self.tp.size > 1 or self.attn.cp.size > 1:
            self.attn.keep_core_eager()
        if self.tp.sp:
            self._dropout = torch.compiler.disable(self._dropout)
        self._forward = torch.compile(self._forward, options={"fallback_random": True})


class Head(nn.Module):
    """Block L+1: final norm, LM head (the embedding matrix when tied) and the loss. The head's
    weight grad is done in backward (B), not deferred to a Zero Bubble W, or in forward where
    the builder sets `grad_in_forward` (one microbatch at a time at the head)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.norm = make_norm(cfg, tp)
        self.out = None
        self.tp, self.vocab_size = tp, cfg.vocab_size
        self.grad_in_forward = False  # set where one microbatch at a time passes the head
        self.head_buffers = HeadBuffers()  # what the fused head writes into
        if not cfg.tie_embeddings:
            self.out = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, False, tp, pad=True)

    def logits(self, h: torch.Tensor, tied_weight: torch.Tensor | None) -> torch.Tensor:
        """This rank's vocab slice of the logits, (B, T, V/tp) (padded when tp ∤ V)."""
        h = self.norm(h)  # (B, T/tp, d) with SP
        if self.out is not None:
            return self.out(h)
        return F.linear(enter_column(h, self.tp), tied_weight)

    def forward(self, h, targets=None, tied_weight=None) -> torch.Tensor:
        """Logits (B, T, V), or with targets the summed cross entropy over all tokens: the head
        matmul and the loss fused by chunks of tokens, so the whole (B·T, V/tp) logits never
        exist (parallel/tensor/cross_entropy.linear_cross_entropy)."""
        if targets is None:
            logits = self.logits(h, tied_weight)
            return gather_from_tp(logits, self.tp)[..., : self.vocab_size]
        weight = self.out.weight if self.out is not None else tied_weight  # (V/tp, d)
        x = enter_column(self.norm(h), self.tp)  # (B, T, d): f, or SP's all-gather
        vocab_start = self.tp.rank * weight.shape[0]
        return linear_cross_entropy(
            x, weight, targets, vocab_start, self.vocab_size, self.tp, None,
            self.grad_in_forward, self.head_buffers,
        )  # fmt: skip


def build_mtp(cfg: ModelConfig, d: Derived, tp: TPInfo, recompute, cp: CPInfo, ep: EPInfo) -> MTP:
    """model.mtp_layers modules, each block the kind of layer n_layers + k − 1 (MoE past the
    dense first layers, as DeepSeek-V3's MTP layer)."""
    modules = []
    for k in range(cfg.mtp_layers):
        index = cfg.n_layers + k
        mode, parts = layer_mode(recompute, index), selective_parts(recompute, index)
        block = TransformerLayer(cfg, d, tp, mode, cp, index, ep, parts)
        proj = ReplicatedLinear(2 * cfg.d_model, cfg.d_model, tp)
        modules.append(MTPModule(cfg, block, proj, tp))
    return MTP(cfg, modules, tp, cp)


TIED_EMBEDDING = "embed.tok.weight"  # the token table the LM head reuses when tied


class GPT(nn.Module):
    """Blocks `blocks` of the model (all by default); parameter names are logical."""

    def __init__(
        self,
        cfg: ModelConfig,
        blocks: range | None = None,
        seed: int = 0,
        tp: TPInfo = NO_TP,
        recompute: RecomputeConfig | None = None,
        init: bool = True,
        cp: CPInfo = NO_CP,
        ep: EPInfo = NO_EP,
    ) -> None:
        super().__init__()
        self.cfg, self.cp = cfg, cp
        self._positions: tuple | None = None  # (length, device), this rank's default positions
        n_blocks = cfg.n_layers + 2
        self.blocks = blocks if blocks is not None else range(n_blocks)
        if not (0 <= self.blocks.start < self.blocks.stop <= n_blocks and self.blocks.step == 1):
            raise ValueError(f"blocks {self.blocks} is not a contiguous range of 0..{n_blocks}")
        recompute = recompute or RecomputeConfig()
        derived = Config(model=cfg).derived
        self.has_embedding = 0 in self.blocks
        self.head = Head(cfg, tp) if n_blocks - 1 in self.blocks else None
        self.embed = None
        shares_table = cfg.tie_embeddings or cfg.mtp_layers > 0  # the head's or MTP's lookup
        if self.has_embedding or (self.head is not None and shares_table):
            self.embed = Embedding(cfg, tp, table_only=not self.has_embedding)
        self.mtp = None  # multi-token prediction beside the head (models/mtp.py)
        if self.head is not None and cfg.mtp_layers:
            self.mtp = build_mtp(cfg, derived, tp, recompute, cp, ep)
        self.layers = nn.ModuleDict()  # keyed by global layer index: names stay logical
        for b in self.blocks:
            if 1 <= b <= cfg.n_layers:
                mode, parts = layer_mode(recompute, b - 1), selective_parts(recompute, b - 1)
                layer = TransformerLayer(cfg, derived, tp, mode, cp, b - 1, ep, parts)
                self.layers[str(b - 1)] = layer
        if init:  # False for shape-only models (dry run on the meta device)
            init_parameters(self, seed, cfg.n_layers)

    @property
    def tied_table(self) -> nn.Parameter | None:
        """The token table the head reuses, on a chunk with the embedding or a tied head."""
        if not self.cfg.tie_embeddings or self.embed is None:
            return None
        return self.embed.tok.weight

    @property
    def shared_table(self) -> nn.Parameter | None:
        """The token table that the last stage also reads (a tied head's, or MTP's lookups),
        whose copies pipeline/tied.py keeps equal."""
        if self.embed is None or not (self.cfg.tie_embeddings or self.cfg.mtp_layers):
            return None
        return self.embed.tok.weight

    @property
    def holds_tied_ends(self) -> bool:
        """The token lookup and the tied head in this one module: the lookup hands the head its
        table (parallel/autograd/tied_lookup.py), so the table's grad is made once, by the head
        (config/memory_terms.tied_lookup_with_head predicts it from the config)."""
        return self.has_embedding and self.head is not None and self.tied_table is not None

    def tied_copy_names(self) -> tuple[str, ...]:
        """Names of parameters that copy another stage's (the last stage's tied table): written
        once by checkpoints, counted once by the grad norm."""
        if self.embed is not None and not self.has_embedding:
            return (TIED_EMBEDDING,)
        return ()

    def default_positions(self, length: int, device) -> torch.Tensor:
        """This rank's positions of a `length`-token sequence (cp.positions), one tensor for
        every call at that length: RoPE's tables for it are then made once
        (models/rope.SharedTables), not per microbatch."""
        key = (length, torch.device(device))
        if self._positions is None or self._positions[0] != key:
            self._positions = (key, self.cp.positions(length, device))
        return self._positions[1]

    def forward(
        self, x: torch.Tensor, targets=None, positions=None, segment=None, documents=None
    ) -> torch.Tensor:
        """Token ids (B, T) or hidden states (B, T, d) in; hidden states, logits or loss out.

        Under cp, x is this rank's zigzag slice (B, T/cp[, d]) and positions default to its
        global positions; pipeline stages past the first pass the positions explicitly.
        `segment` (a Seq1F1B SegmentScope, or None) lets attention read earlier segments' K/V.
        Document masking (parallel/context/documents.py): `documents` (B, T) are the whole
        rows' document ids (before any cp slice) and `positions` (B, T/cp) each token's
        position in its document, this rank's slice of them."""
        if positions is None:
            positions = self.default_positions(x.shape[1] * self.cp.size, x.device)
        table = self.tied_table
        if self.holds_tied_ends:
            x, table = self.embed(x, positions, with_table=True)  # one grad for the table
        elif self.has_embedding:
            x = self.embed(x, positions)
        for layer in self.layers.values():
            x = layer(x, positions, segment, documents)
        if self.head is None:
            return x
        out = self.head(x, targets, table)
        if self.mtp is None or targets is None:
            return out
        weight = self.head.out.weight  # the shared head (mtp_layers refuses a tied one)
        extra = self.mtp(x, targets, self.embed.tok, weight, positions, documents, segment)
        return out + (extra - extra.detach())  # MTP's grads; the reported loss stays the LM's
