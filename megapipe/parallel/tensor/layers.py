"""Tensor-parallel linear and embedding layers (Megatron-LM, Shoeybi et al. 2019, §3).

With sequence parallelism (Korthikanti et al. 2022, §4.2.2) the column linear's f becomes an
all-gather along the sequence and the row linear's g a reduce-scatter along it, so norms and
dropout between them run on this rank's sequence chunk; with `parallel.tp_overlap` that
collective runs chunk by chunk beside the linear's matmul (overlap.py, Wang et al. 2023).

With `TPInfo()` (size 1) each layer is exactly nn.Linear / nn.Embedding, so the single-process
model is written against these classes and tensor parallelism only changes `tp`.
Every layer records, per parameter, its logical shape and `ShardSpec`, used by initialisation
and checkpoints to go between logical (unsharded) tensors and this rank's shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.parallel.autograd.kept_buffers import KeptBuffers
from megapipe.parallel.autograd.rerun import rerun_in_backward
from megapipe.parallel.autograd.tied_lookup import tied_lookup
from megapipe.parallel.autograd.weight_grad import WeightGradQueue, compute_dtype, linear
from megapipe.parallel.fp8 import deferred_weight_grad
from megapipe.parallel.fp8_overlap import fp8_gather_linear, fp8_linear_scatter
from megapipe.parallel.precision import add_bias
from megapipe.parallel.tensor.mappings import enter_column, exit_row, gather_from_tp
from megapipe.parallel.tensor.overlap import gather_linear, linear_scatter
from megapipe.parallel.tensor.sharded_input import sharded_input
from megapipe.parallel.tensor.sharding import NO_TP, REPLICATED, ShardSpec, TPInfo


class ShardedModule(nn.Module):
    """A module whose parameters have logical shapes and shard specs (see sharding.py)."""

    def __init__(self, tp: TPInfo) -> None:
        super().__init__()
        self.tp = tp
        self.wgrad_queue = WeightGradQueue()  # Zero Bubble: weight grads deferred to W
        self.kept_grads = KeptBuffers()  # the CPU weight grad's buffer, kept from step to step
        self.logical_shapes: dict[str, tuple[int, ...]] = {}
        self.shard_specs: dict[str, ShardSpec] = {}

    def _add_param(self, name: str, shape: tuple[int, ...], spec: ShardSpec, tp: TPInfo) -> None:
        local = list(shape)
        if spec.dim is not None:
            local[spec.dim] = spec.local_size(tp.size)
        self.register_parameter(name, nn.Parameter(torch.empty(local)))
        self.logical_shapes[name] = tuple(shape)
        self.shard_specs[name] = spec


class ParallelLinear(ShardedModule):
    """What the tp linears share: `forward` is their `_math`, or after `keep_eager()` the same
    math outside any compiled graph; the matmul is the deferrable `linear` of
    parallel/autograd/weight_grad.py, or after `use_builtin_linear()` torch's F.linear."""

    def __init__(self, tp: TPInfo) -> None:
        super().__init__(tp)
        self._eager_math = None  # keep_eager's torch.compiler.disable'd math
        self._builtin = False  # use_builtin_linear
        self.fp8 = None  # an Fp8Linear (parallel/fp8.py) where train.fp8 casts this linear
        self.fp8_weight = None  # its weight gathered in FP8 under zero=3 (data/zero3_fp8.py)

    def use_builtin_linear(self) -> None:
        """Multiply with torch's F.linear from now on (no deferred weight grads): for a caller
        that splits B and W itself by walking autograd nodes, as torch.distributed.pipelining
        does (benchmarks/bench_pipeline.py); a built-in node computes only the grads asked for."""
        self._builtin = True

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._builtin:
            return F.linear(x, self.weight, bias)
        if self.fp8 is not None:
            return self.fp8.linear(x, self.weight, bias, self)
        return linear(x, self.weight, bias, self)

    def deferred_weight_grad(self, operands) -> None:
        """W of an FP8 matmul: its queued quantized operands (parallel/fp8.py)."""
        deferred_weight_grad(self, operands)

    def _overlapped(self) -> bool:
        """SP's collective overlapped with this linear's matmul (overlap.py): tp_overlap on,
        and the deferrable linear (the built-in one splits no B/W the ring could follow)."""
        return self.tp.sp and self.tp.overlap and not self._builtin

    def keep_eager(self) -> None:
        """Run outside compiled graphs from now on: a graph break where compiled code calls
        this linear (models/gpt.compile_math). The disabled math is made here, when compiling,
        so that importing the layers does not import torch._dynamo."""
        self._eager_math = torch.compiler.disable(self._math)

    @property
    def forward(self):
        """What nn.Module.__call__ runs: the math, or keep_eager's disabled math."""
        return self._math if self._eager_math is None else self._eager_math

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelLinear(ParallelLinear):
    """y = x Aᵀ + b with the rows of A (output features) split over tp.

    `out_features` may be a list of segments (q | k | v, or gate | up); each segment is split
    over tp separately, in units of `unit` rows (a head), so a fused projection shards by head.
    Input: f (identity fwd / all-reduce bwd), or with SP all-gather along the sequence fwd /
    reduce-scatter bwd. Output: this rank's features, or all of them with `gather_output`.
    The weight grad can be deferred to a Zero Bubble W action (parallel/autograd/weight_grad.py).
    `pad` zero-pads a segment tp does not divide (the LM head over a vocab tp does not divide).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        bias: bool = True,
        tp: TPInfo = NO_TP,
        unit: int = 1,
        gather_output: bool = False,
        pad: bool = False,
    ) -> None:
        super().__init__(tp)
        self.tp_splits = "out"  # the features tp splits: FP8 shares their amax (fp8.py)
        self.input_shard = sharded_input(tp)  # under SP its input's shard is saved
        segments = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        self.gather_output = gather_output
        spec = ShardSpec(dim=0, segments=segments, unit=unit, pad=pad)
        self._add_param("weight", (sum(segments), in_features), spec, tp)
        if bias:
            self._add_param("bias", (sum(segments),), spec, tp)
        else:
            self.register_parameter("bias", None)

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        if self._overlapped():  # (B, T/tp, in) -> (B, T, out/tp), the gather on the ring
            ring = gather_linear if self.fp8 is None else fp8_gather_linear
            y = ring(x, self.weight, self.bias, self)
        else:
            y = self._linear(enter_column(x, self.tp, self._gather_dtype(x)), self.bias)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def _gather_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype SP's all-gather sends this linear's input in: the one its matmul computes
        in, where autocast casts it (the same values, half a float32 stream's bytes, as the tp
        ring sends: overlap.py); None (the stream's) for an FP8 linear, whose input grad comes
        back in its input's dtype (parallel/fp8.fp8_operands): cast first, it would be rounded
        to bf16 before the sum."""
        return None if self.fp8 is not None else compute_dtype(x)


class RowParallelLinear(ParallelLinear):
    """y = x Aᵀ + b with the columns of A (input features) split over tp.

    Input: this rank's features. Output: g (all-reduce fwd / identity bwd), or with SP
    reduce-scatter along the sequence fwd / all-gather bwd; the bias is added once, after.
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int,
        bias: bool = True,
        tp: TPInfo = NO_TP,
        unit: int = 1,
    ) -> None:
        super().__init__(tp)
        self.tp_splits = "in"
        segments = (in_features,) if isinstance(in_features, int) else tuple(in_features)
        self._add_param("weight", (out_features, sum(segments)), ShardSpec(1, segments, unit), tp)
        if bias:
            self._add_param("bias", (out_features,), REPLICATED, tp)
        else:
            self.register_parameter("bias", None)

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        if self._overlapped():  # (B, T, in/tp) -> (B, T/tp, out), the scatter on the ring
            ring = linear_scatter if self.fp8 is None else fp8_linear_scatter
            y = ring(x, self.weight, self)
        else:
            y = exit_row(self._linear(x, None), self.tp)
        return y if self.bias is None else add_bias(y, self.bias)


class VocabParallelEmbedding(ShardedModule):
    """Token embedding with the vocabulary rows split over tp (Megatron §3).

    Each rank looks up the ids in its row range, zeroes the rest, and the partial results are
    all-reduced (g), or with SP reduce-scattered along the sequence. A vocab tp does not divide
    is zero-padded to ceil(V/tp) rows per rank; padding rows are never looked up.
    """

    def __init__(self, vocab_size: int, dim: int, tp: TPInfo = NO_TP) -> None:
        super().__init__(tp)
        self.vocab_size = vocab_size
        self._add_param("weight", (vocab_size, dim), ShardSpec(0, (vocab_size,), pad=True), tp)
        self.vocab_start = tp.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._lookup(ids, lambda local: (F.embedding(local, self.weight), None))[0]

    def lookup_with_table(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The lookup, and this rank's table for a tied head in the same graph, through one
        autograd node that adds the lookup's grad into the head's (autograd/tied_lookup.py)."""
        return self._lookup(ids, lambda local: tied_lookup(local, self.weight))

    def _lookup(self, ids, lookup):
        if self.tp.size == 1:
            return lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out, table = lookup(local.masked_fill(outside, 0))
        return exit_row(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp), table


class ReplicatedEmbedding(ShardedModule):
    """An embedding table every tp rank holds whole (learned positions)."""

    def __init__(self, num: int, dim: int, tp: TPInfo = NO_TP) -> None:
        super().__init__(tp)
        self._add_param("weight", (num, dim), REPLICATED, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LayerNorm(ShardedModule):
    """LayerNorm (GPT-2) with replicated weight and bias."""

    def __init__(self, dim: int, eps: float, tp: TPInfo = NO_TP) -> None:
        super().__init__(tp)
        self.eps = eps
        self._add_param("weight", (dim,), REPLICATED, tp)
        self._add_param("bias", (dim,), REPLICATED, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # autograd keeps x itself and two floats a row
            return self._norm(x, self.weight, self.bias)
        # a low-precision stream: keeps x alone, not CUDA autocast's float32 copy of it and
        # the statistics (autograd/rerun.py)
        return rerun_in_backward(self._norm, x, self.weight, self.bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], weight, bias, self.eps)


class LayerNorm1P(LayerNorm):
    """LayerNorm whose gain is held zero-centred: it scales by 1 + weight, and `weight` starts
    at 0 (its `zero_centred` mark, read by models/init.py). Nemotron-4's norm (Megatron's
    apply_layernorm_1p, transformers' NemotronLayerNorm1P): a gain near 1 held as its small
    offset keeps more of its bits in low precision."""

    def __init__(self, dim: int, eps: float, tp: TPInfo = NO_TP) -> None:
        super().__init__(dim, eps, tp)
        self.weight.zero_centred = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # keeps x alone in any dtype: 1 + w is made again in backward, not kept beside it
        return rerun_in_backward(self._norm, x, self.weight, self.bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], weight + 1.0, bias, self.eps)


class RMSNorm(ShardedModule):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like Llama's reference."""

    def __init__(self, dim: int, eps: float, tp: TPInfo = NO_TP) -> None:
        super().__init__(tp)
        self.eps = eps
        self._add_param("weight", (dim,), REPLICATED, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # keeps x alone, not its float32 copy, rstd and x̂ (autograd/rerun.py)
        return rerun_in_backward(self._norm, x, self.weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * weight


def sharded_params(model: nn.Module):
    """(logical name, parameter, logical shape, shard spec) for every parameter of `model`."""
    for mod_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{local}" if mod_name else local
            shape, spec = module.logical_shapes[local], module.shard_specs[local]
            yield name, param, shape, spec, module.tp
