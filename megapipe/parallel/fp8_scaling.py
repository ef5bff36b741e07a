"""FP8 quantization with current (just-in-time) scaling, exact under any sharding.

`quantize(t, dtype, granularity, groups)` casts a 2-D operand (R, C) of a matmul whose
contraction runs along C to float8 and returns it with its dequantization scale (the inverse
of the cast's): one scale for the tensor (`tensorwise`), one per row (`rowwise`: per token of
an activation, per output channel of a weight, as torch._scaled_mm's rowwise scales and
torchao's rowwise recipe), or one per 1 x 128 tile along C (`tile`, DeepSeek-V3 §3.3.2's
activation and gradient tiles) or per 128 x 128 block (`block`, its weight blocks).

A scale is taken from the amax of exactly the elements it scales, so where a mesh shards an
operand the amax is all-reduced (MAX) over the groups that split those elements (`Groups`: the
groups splitting R and those splitting C). Tensorwise reduces over both; rowwise over C's
groups (a row is whole once C is); tiles and blocks over none (the linears check that every
shard holds whole tiles, config/checks.py). Then every mesh casts every element with the scale
one process uses.

The amax-to-scale rule and the saturated cast follow torchao's float8 training
(torchao/float8/float8_utils.py `amax_to_scale`, `to_fp8_saturated`: the fp8 max over the amax
in float64, the amax clamped at 1e-12, then float32; values clamped to the fp8 range before the
cast); tests/test_fp8.py holds them to torchao's functions bit for bit. They are restated here,
not imported: importing torchao costs about 4 s of CPU per process and logs a warning, and the
tiles and blocks (no torchao CPU path) and the amax groups are megapipe's own anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe._torch_compat import scaled_mm
from megapipe.distributed import collectives as C

E4M3 = torch.float8_e4m3fn  # forward: activations and weights
E5M2 = torch.float8_e5m2  # backward: output gradients (range over precision)
BLOCK = 128  # DeepSeek-V3 §3.3.2: 1 x 128 activation tiles, 128 x 128 weight blocks
GRANULARITIES = ("tensorwise", "rowwise", "tile", "block")
EPS = 1e-12  # the smallest amax a scale is made from (torchao's float8_utils.EPS)


@dataclass(frozen=True)
class Groups:
    """The process groups that split an operand's rows (R) and its contraction columns (C)."""

    rows: tuple = ()
    cols: tuple = ()


WHOLE = Groups()


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast's scale, fp8 max / amax (float64, then float32; torchao's rule)."""
    return (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()


def to_fp8(t: torch.Tensor, dtype: torch.dtype, scratch: bool = False) -> torch.Tensor:
    """`t` cast to `dtype`, saturating at its largest finite value (torchao's rule); `scratch`:
    `t` is the caller's own temporary, clamped in place."""
    top = torch.finfo(dtype).max
    return (t.clamp_ if scratch else t.clamp)(min=-top, max=top).to(dtype)


def _max_over(amax: torch.Tensor, groups: tuple) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            amax = C.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    return amax


def _tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(R, C) as (R/rows, rows, C/128, 128) zero-padded to whole tiles (zeros do not move an
    amax)."""
    r, c = t.shape
    pr, pc = -r % rows, -c % BLOCK
    if pr or pc:
        t = torch.nn.functional.pad(t, (0, pc, 0, pr))
    return t.reshape((r + pr) // rows, rows, (c + pc) // BLOCK, BLOCK)


def _local_amax(t: torch.Tensor, granularity: str) -> torch.Tensor:
    """The amax of `granularity` over this rank's elements (zeros for an empty `t`)."""
    if t.numel() == 0:  # torch's amax refuses empty reductions; zeros do not move a MAX
        r, c = t.shape
        shape = {"tensorwise": (), "rowwise": (r, 1), "tile": (r, -(-c // BLOCK))}
        blocks = (-(-r // BLOCK), -(-c // BLOCK))
        return t.new_zeros(shape.get(granularity, blocks), dtype=torch.float32)
    # max(max, −min): |t|'s max without an |t| copy of the operand (exact in any float dtype)
    a, dims = t.detach(), {"rowwise": {"dim": 1, "keepdim": True}}.get(granularity, {})
    if granularity in ("tile", "block"):
        a, dims = _tiles(a, 1 if granularity == "tile" else BLOCK), {"dim": (1, 3)}
    return torch.maximum(a.amax(**dims), -a.amin(**dims)).float()


def _sharing(granularity: str, groups: Groups) -> tuple:
    """The groups a scale's amax is shared over: tensorwise both sides, rowwise C's, tiles and
    blocks none (module docstring)."""
    return {"tensorwise": groups.rows + groups.cols, "rowwise": groups.cols}.get(granularity, ())


def amax_of(t: torch.Tensor, granularity: str, groups: Groups = WHOLE) -> torch.Tensor:
    """The amax each scale of `granularity` is made from, shared over the groups splitting it:
    () tensorwise, (R, 1) rowwise, (R, C/128) tile, (R/128, C/128) block."""
    return _max_over(_local_amax(t, granularity), _sharing(granularity, groups))


def expand(scale: torch.Tensor, shape: torch.Size, granularity: str) -> torch.Tensor:
    """A tile's or block's scales repeated over its elements, cut to (R, C); else as is."""
    if granularity not in ("tile", "block"):
        return scale
    rows = 1 if granularity == "tile" else BLOCK
    full = scale.repeat_interleave(rows, 0).repeat_interleave(BLOCK, 1)
    return full[: shape[0], : shape[1]]


def quantize(
    t: torch.Tensor, dtype: torch.dtype, granularity: str, groups: Groups = WHOLE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 `t`, dequantization scale) of the 2-D `t` (module docstring); the scale has the
    shape amax_of gives and dequantizes as `q.float() * expand(scale)`."""
    return quantize_with(t, dtype, granularity, amax_of(t, granularity, groups))


def quantize_with(
    t: torch.Tensor, dtype: torch.dtype, granularity: str, amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` with the amax already taken (amax_of): a piece of a larger tensor cast with
    the scales of the whole (parallel/fp8_overlap.py's ring pieces)."""
    scale = amax_to_scale(amax, dtype)
    full = expand(scale, t.shape, granularity)
    values = t.float()  # float32 operands scale into a new tensor, narrower ones in their copy
    values = values * full if values is t else values.mul_(full)
    return to_fp8(values, dtype, scratch=True), scale.reciprocal()


def dequantize(q: torch.Tensor, inv: torch.Tensor, granularity: str) -> torch.Tensor:
    """The float32 values the float8 `q` stands for."""
    return q.float() * expand(inv, q.shape, granularity)


def quantize_parts(
    parts, dtype: torch.dtype, granularity: str, groups: Groups = WHOLE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`quantize` of each 2-D part with scales of its own (the routed experts' row groups,
    parallel/fp8_experts.py), every part's amax shared over `groups` in one collective."""
    local = [_local_amax(p, granularity) for p in parts]
    sharing = _sharing(granularity, groups)
    if local and any(g is not None and dist.get_world_size(g) > 1 for g in sharing):
        flat = _max_over(torch.cat([a.reshape(-1) for a in local]), sharing)
        local = [a.view_as(b) for a, b in zip(flat.split([b.numel() for b in local]), local)]
    return [quantize_with(p, dtype, granularity, a) for p, a in zip(parts, local, strict=True)]


def fp8_matmul(a, b_t, act: str, weight_like: str) -> torch.Tensor:
    """a · b_tᵀ in float32 from quantized operands, each (rows, contraction) with its scale,
    of granularity `act` and `weight_like`: torch._scaled_mm for tensorwise and rowwise scales,
    dequantized float32 matmul for tiles and blocks (no torch kernel takes them)."""
    (qa, sa), (qb, sb) = a, b_t
    if act in ("tensorwise", "rowwise"):  # torch's kernel: (M, 1) and (1, N) scales, or ()
        sb = sb.reshape(1, -1) if sb.dim() else sb
        return scaled_mm(qa.contiguous(), qb.contiguous().t(), sa, sb)
    return dequantize(qa, sa, act) @ dequantize(qb, sb, weight_like).t()
