"""Causal self-attention with fused q|k|v, RoPE and grouped-query heads, split by head over tp."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.config.archs import arch_of, rotary_dims
from megapipe.distributed.devices import capability as device_capability
from megapipe.models.qk_norm import qk_norms
from megapipe.models.rope import Rope
from megapipe.parallel.context.documents import varlen_offsets, visible_keys
from megapipe.parallel.context.kernel_choice import attention_kernel_for
from megapipe.parallel.context.window import in_window
from megapipe.parallel.context.zigzag import NO_CP, CPInfo
from megapipe.parallel.recompute import maybe_checkpoint
from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from megapipe.parallel.tensor.random import replayable, sharded_rng
from megapipe.parallel.tensor.sharding import NO_TP, TPInfo

try:  # the flash-attn package (GPU extra); scaled_dot_product_attention otherwise
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:
    flash_attn_func = flash_attn_varlen_func = None

try:  # SDPA backends in an order of our choosing (torch >= 2.6: sdpa_kernel's set_priority)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    CUDNN_FIRST = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    SDPA_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters
except (ImportError, AttributeError):
    CUDNN_FIRST, SDPA_PRIORITY = [], False


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by position; pairs are (i, i + r/2) as in HF's rotate_half, over
    the first r = cos.shape[-1] dims (partial RoPE: the rest pass through, as transformers'
    Nemotron and GPT-NeoX)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:  # in x's memory layout, as the whole rotation's output: the core's
        out = torch.empty_like(x)  # output follows q's, and proj reads it without a copy
        out[..., :r] = apply_rope(x[..., :r], cos, sin)
        out[..., r:] = x[..., r:]
        return out
    half = r // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def _flash_ok(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def dense_kernel(q: torch.Tensor) -> str:
    """The kernel attention_core runs for q (kernel_choice.attention_kernel_for: cuDNN's on
    Hopper+, FlashAttention-2 before; the CPU's kernels on a CPU tensor)."""
    if not q.is_cuda:
        return "cpu"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    dtype = str(q.dtype).removeprefix("torch.")
    flash = flash_attn_func is not None
    return attention_kernel_for(
        "cuda", device_capability(index), dtype, flash_attn=flash, cudnn=SDPA_PRIORITY
    )


def attention_core(q, k, v, dropout_p: float, documents=None, window: int = 0) -> torch.Tensor:
    """Causal attention of (B, H, T, hd) queries over (B, Hkv, S, hd) keys/values, S >= T: the
    queries are the last T positions (S > T for a Seq1F1B segment after the first).
    `documents` (B, >= S) int64, the row's document ids (parallel/context/documents.py):
    also mask keys of other documents. The kernel is dense_kernel's: on Hopper+ SDPA with
    cuDNN's backend first (Transformer Engine's preference there; where cuDNN cannot take the
    inputs SDPA goes on down the list), else flash-attn's FA2 where installed, else SDPA.
    `window` > 0: sliding-window attention (Mistral 7B §2; transformers' sliding_window), each
    query sees itself and the window - 1 keys before it (a boolean mask; FA2's window_size);
    with `documents`, the window AND the same document (parallel/context/window.py)."""
    if documents is not None:
        return _document_core(q, k, v, dropout_p, documents, window)
    if window:
        return _window_core(q, k, v, dropout_p, window)
    kernel = dense_kernel(q)
    if kernel == "flash" and flash_attn_func is not None:
        out = flash_attn_func(  # (B, T, H, hd), GQA built in; causal is bottom-right aligned
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p, causal=True
        )
        return out.transpose(1, 2)
    T, S = q.shape[2], k.shape[2]
    mask = None if S == T else torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if kernel == "cudnn":
        with sdpa_kernel(CUDNN_FIRST, set_priority=True):
            return _sdpa(q, k, v, mask, dropout_p)
    return _sdpa(q, k, v, mask, dropout_p)


def _sdpa(q, k, v, mask, dropout_p: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=mask is None,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _window_core(q, k, v, dropout_p: float, window: int) -> torch.Tensor:
    """Causal sliding-window attention; the T queries are the last T of the S keys' positions."""
    T, S = q.shape[2], k.shape[2]
    if flash_attn_func is not None and _flash_ok(q):
        out = flash_attn_func(  # (B, T, H, hd); window_size=(left, right) keys around the query
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p, causal=True,
            window_size=(window - 1, 0),
        )  # fmt: skip
        return out.transpose(1, 2)
    return _sdpa(q, k, v, _window_mask(T, S, window, q.device), dropout_p)


def _window_mask(T: int, S: int, window: int, device) -> torch.Tensor:
    """(T, S) bool: the window of each of the last T of S positions (parallel/context/window.py)."""
    return in_window(torch.arange(S - T, S, device=device), torch.arange(S, device=device), window)


def _document_core(q, k, v, dropout_p: float, documents: torch.Tensor, window: int = 0):
    """Document-masked attention: on CUDA with flash-attn, its varlen kernel over the documents
    laid end to end (no mask exists; Dao 2023, FlashAttention-2's variable-length batches);
    else, and for a later Seq1F1B segment (S > T), SDPA with a dense (B, 1, T, S) boolean
    mask (same document, key not after query). `window` > 0: also within the window (the
    varlen kernel's window_size; a document's positions differ as the row's do)."""
    B, H, T, hd = q.shape
    if flash_attn_varlen_func is not None and _flash_ok(q) and k.shape[2] == T:
        cu, longest = varlen_offsets(documents[:, :T])

        def flat(x: torch.Tensor) -> torch.Tensor:  # (B, h, T, hd) -> (B·T, h, hd)
            return x.transpose(1, 2).reshape(B * T, x.shape[1], hd)

        sides = {"window_size": (window - 1, 0)} if window else {}  # keys left, right of a query
        out = flash_attn_varlen_func(
            flat(q), flat(k), flat(v), cu, cu, longest, longest, dropout_p, causal=True, **sides
        )  # (B·T, H, hd)
        return out.view(B, T, H, hd).transpose(1, 2)
    mask = visible_keys(documents, T, k.shape[2]).unsqueeze(1)  # (B, 1, T, S)
    if window:
        mask = mask & _window_mask(T, k.shape[2], window, q.device)
    if q.is_cuda and k.shape[1] != H:  # CUDA SDPA takes a mask with GQA only in its math
        g = H // k.shape[1]  # backend (s² probabilities): give the memory-efficient one H heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _sdpa(q, k, v, mask, dropout_p)


class Attention(nn.Module):
    """Heads split over tp; under cp the sequence is split too and the core is the cp variant's
    (ring attention or Ulysses)."""

    def __init__(
        self,
        cfg: ModelConfig,
        n_kv_heads: int,
        tp: TPInfo = NO_TP,
        selective=False,
        cp: CPInfo = NO_CP,
        window: int = 0,
    ):
        super().__init__()
        hd = cfg.head_dim or cfg.d_model // cfg.n_heads
        arch = arch_of(cfg.arch)
        bias = arch.biases
        self.head_dim, self.dropout, self.selective, self.tp = hd, cfg.dropout, selective, tp
        self.cp, self.window = cp, window  # window: sliding_window on this layer, or 0
        self._eager_core = None  # keep_core_eager's torch.compiler.disable'd core
        # models/rope.py: the first rotary_dims(cfg, hd) dims of each head
        self.rope = Rope(cfg, rotary_dims(cfg, hd)) if arch.rope else None
        q_dim, kv_dim = cfg.n_heads * hd, n_kv_heads * hd
        self.qkv = ColumnParallelLinear(cfg.d_model, [q_dim, kv_dim, kv_dim], bias, tp, unit=hd)
        self.proj = RowParallelLinear(q_dim, cfg.d_model, bias, tp, unit=hd)
        # Heads on this tp rank; kv heads are replicated when there are fewer than tp.
        self.local_heads = cfg.n_heads // tp.size
        self.local_kv_heads = max(n_kv_heads // tp.size, 1)
        self.q_norm, self.k_norm = qk_norms(cfg, hd, tp)  # qwen3's QK-norm, else None
        if bias:
            self.qkv.bias.register_hook(self._zero_key_bias_grad)

    def linears(self) -> tuple[nn.Module, ...]:
        return (self.qkv, self.proj)

    def _zero_key_bias_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The key bias adds q·b_k to every score of a row, which softmax cancels: its exact
        gradient is 0. Computed, it is round-off (~1e-12) that AdamW scales up to real steps,
        making runs that differ only in summation order (microbatches, meshes) drift apart."""
        lo = self.local_heads * self.head_dim
        hi = lo + self.local_kv_heads * self.head_dim
        grad = grad.clone()
        grad[lo:hi] = 0
        return grad

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, segment=None, documents=None
    ) -> torch.Tensor:
        """`segment`: a Seq1F1B SegmentScope (parallel/autograd/segment_kv.py) or None;
        `documents`: the whole row's document ids (b, T) under document masking, or None;
        `positions`: (T/cp,) or, under document masking, this rank's per-row (b, T/cp)."""
        qkv = self.qkv(x)  # (B, T, (H+2·Hkv)/tp·hd); with SP x is (B, T/tp, d), gathered inside
        B, T, _ = qkv.shape
        hd, h, hkv = self.head_dim, self.local_heads, self.local_kv_heads
        q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], dim=-1)
        q = q.view(B, T, h, hd).transpose(1, 2)  # (B, H/tp, T, hd)
        k = k.view(B, T, hkv, hd).transpose(1, 2)  # (B, Hkv/tp, T, hd)
        v = v.view(B, T, hkv, hd).transpose(1, 2)
        if self.q_norm is not None:  # per head, before RoPE (models/qk_norm.py)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = self.rope.tables(positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.rope is not None or self.q_norm is not None:
            # q and k are new tensors: v, a view, would keep the whole qkv output alive for
            # backward ((H+2·Hkv)/tp heads) where its own copy keeps Hkv/tp
            v = v.contiguous()
        if segment is not None:  # Seq1F1B: prepend earlier segments' K/V
            k, v = segment.extend(self, k, v)  # (B, Hkv/tp, S, hd), S = this segment's end
        p = self.dropout if self.training else 0.0
        # Selective recompute (Korthikanti et al. 2022, §4): keep only q, k, v for backward.
        core = self._core if self._eager_core is None else self._eager_core
        y = maybe_checkpoint(self.selective, replayable(core, self.tp), q, k, v, p, documents)
        y = y.transpose(1, 2).reshape(B, T, h * hd)  # (B, T, H/tp·hd)
        return self.proj(y)  # (B, T, d), or (B, T/tp, d) with SP

    def _core(self, q, k, v, dropout_p: float, documents=None) -> torch.Tensor:
        """Attention on this rank's heads: dropout draws from the tp-rank stream (Megatron).
        Under cp the queries of this rank's zigzag slice attend over the whole sequence by the
        cp variant (parallel/context/variants.py: the kv ring, or Ulysses' all-to-all around
        attention_core); config checks keep attention dropout off there."""
        if self.cp.size > 1:
            layout = self.cp.layout(documents)  # parallel.cp_balance=documents: by work
            return self.cp.attention(
                q, k, v, self.cp.group, attention_core, dropout_p, documents, layout, self.window
            )
        with sharded_rng(self.tp):
            return attention_core(q, k, v, dropout_p, documents, self.window)

    def keep_core_eager(self) -> None:
        """Run the core outside compiled graphs from now on (models/gpt.compile_math); made
        here, when compiling, so that importing the model does not import torch._dynamo."""
        self._eager_core = torch.compiler.disable(self._core)
