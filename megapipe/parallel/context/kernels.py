"""Ring attention blocks: which (q chunk, kv chunk) blocks to compute, and kernels that do it.

A ring step attends this rank's queries to one key/value block; the results of all blocks are
merged by their log-sum-exp (online softmax, Milakov & Gimelshein 2018). The backward of a block
is the flash-attention one (Dao et al. 2022, Alg. 4): given the *merged* output O and log-sum-exp
L of the whole row, P = exp(S·scale − L) is the block's slice of the global softmax, and
dS = P ∘ (dP − rowsum(dO ∘ O)), so per-block gradients add up to the full-attention gradient.

Every kernel takes q (B, H, Tq, hd) and k, v (B, Hkv, Tk, hd) with H a multiple of Hkv (GQA:
query head h reads kv head h // (H/Hkv), as `scaled_dot_product_attention(enable_gqa=True)`), and
`causal` means the top-left aligned mask of a square diagonal block. Gradients of k and v come
back with Hkv heads (summed over each head group). The reference kernel also takes `hide`
(B, Tq, Tk) bool, keys hidden from each query besides causality (document masking); a row
with every key hidden gets out 0 and lse −inf.

On CUDA the block kernel is torch's flash one, or on Hopper+ cuDNN's (kernel_choice: Transformer
Engine's preference there), used only once probe() has seen it give the flash kernel's out, lse
and gradients on this device and dtype: the two kernels' lse conventions and the cuDNN op's
arguments cannot be checked without a GPU (torch's ring attention,
torch/distributed/tensor/experimental/_context_parallel, merges either kernel's natural-log lse).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from megapipe._torch_compat import (
    cudnn_attention_cuda,
    cudnn_attention_cuda_backward,
    flash_attention_cpu,
    flash_attention_cpu_backward,
    flash_attention_cuda,
    flash_attention_cuda_backward,
)
from megapipe.distributed.devices import capability as device_capability
from megapipe.parallel.context.kernel_choice import attention_kernel_for

Tensor = torch.Tensor


class BlockKernel(NamedTuple):
    """forward(q, k, v, causal, scale) -> (out, lse (B, H, Tq), fp32 or fp64);
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)."""

    name: str
    forward: object
    backward: object


# ---------------------------------------------------------------- which blocks to compute


class RingTile(NamedTuple):
    """One kernel call of a ring step, in local chunk indices [q0, q1) x [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool  # top-left causal mask on a square diagonal block; else no mask

    def slices(self, chunk: int) -> tuple[slice, slice]:
        """Token ranges of the q and kv sides for chunks of `chunk` tokens."""
        return slice(self.q0 * chunk, self.q1 * chunk), slice(self.k0 * chunk, self.k1 * chunk)


def plan_step(q_ids, kv_ids, causal: bool, visible=None) -> list[RingTile]:
    """Kernel calls for queries holding chunks q_ids against a kv block holding kv_ids.

    Chunk pair (a, b): full when not causal or b < a, causal diagonal when b == a, skipped when
    b > a. The own block (q_ids == kv_ids, ascending) is one causal call: the top-left mask of
    the concatenation is exactly that pattern. Elsewhere, query chunks seeing the same run of
    kv chunks are merged into one call (zigzag: all queries x first half, or the second half of
    the queries x all keys; Llama 3 §3.3.2).

    `visible[a][b]` (balance.ChunkLayout): False where every pair of chunk pair (a, b) is
    hidden by document masking; such pairs are skipped, and the own block is then one causal
    call per chunk, so that hidden pairs between its chunks cost nothing either.
    """
    if visible is None and causal and q_ids == kv_ids and q_ids == sorted(q_ids):
        return [RingTile(0, len(q_ids), 0, len(kv_ids), True)]
    blocks: list[RingTile] = []
    for i, a in enumerate(q_ids):
        if causal and a in kv_ids:
            if visible is None or q_ids != kv_ids:
                raise ValueError(
                    f"chunk {a} on both sides outside the diagonal block: bad sharding"
                )
            blocks.append(RingTile(i, i + 1, i, i + 1, True))
        seen = [
            j
            for j, b in enumerate(kv_ids)
            if (not causal or b < a) and (visible is None or visible[a][b])
        ]
        for k0, k1 in _runs(seen):
            key = (i, k0, k1, False)
            last = next(
                (n for n, b in enumerate(blocks) if (b.q1, b.k0, b.k1, b.causal) == key), -1
            )
            if last >= 0:
                blocks[last] = blocks[last]._replace(q1=i + 1)
            else:
                blocks.append(RingTile(i, i + 1, k0, k1, False))
    return blocks


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 3] -> [(0, 2), (3, 4)]: maximal runs of consecutive indices as half-open ranges."""
    runs: list[tuple[int, int]] = []
    for j in idx:
        if runs and runs[-1][1] == j:
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


# ---------------------------------------------------------------- kernels


def _causal_mask(tq: int, tk: int, device) -> Tensor:
    """True where a key is hidden from a query: (Tq, Tk), top-left aligned."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu(1)


def _grouped_scores(q: Tensor, k: Tensor, causal: bool, scale: float, hide=None):
    """Scores of each kv head against its group of query heads, computed in ≥ fp32."""
    B, H, Tq, hd = q.shape
    hkv, g = k.shape[1], H // k.shape[1]
    dt = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dt).reshape(B, hkv, g * Tq, hd)  # (B, Hkv, g·Tq, hd): a kv head's queries stacked
    s = qg @ k.to(dt).transpose(-1, -2) * scale  # (B, Hkv, g·Tq, Tk)
    if causal:
        s = s.masked_fill(_causal_mask(Tq, k.shape[2], q.device).repeat(g, 1), float("-inf"))
    if hide is not None:  # (B, Tq, Tk) -> (B, 1, g·Tq, Tk): row r of a group is query r % Tq
        s = s.masked_fill(hide.repeat(1, g, 1).unsqueeze(1), float("-inf"))
    return qg, s


def reference_forward(q, k, v, causal: bool, scale: float, hide=None):
    """Plain-matmul attention of one block in fp32 (or fp64): always available, the reference."""
    B, H, Tq, hd = q.shape
    _, s = _grouped_scores(q, k, causal, scale, hide)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, Hkv, g·Tq, 1)
    # a row with every key hidden: lse −inf; exp(s − 0) = 0 gives out 0 instead of NaN
    out = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)) @ v.to(s.dtype)
    return out.reshape(B, H, Tq, hd).to(q.dtype), lse.reshape(B, H, Tq)


def reference_backward(dout, q, k, v, out, lse, causal: bool, scale: float, hide=None):
    """Flash-attention backward of one block from the row's global out and log-sum-exp."""
    B, H, Tq, hd = q.shape
    hkv = k.shape[1]
    qg, s = _grouped_scores(q, k, causal, scale, hide)
    dt = s.dtype
    p = torch.exp(s - lse.to(dt).reshape(B, hkv, -1, 1))  # (B, Hkv, g·Tq, Tk)
    do = dout.to(dt).reshape(B, hkv, -1, hd)  # (B, Hkv, g·Tq, hd)
    delta = (do * out.to(dt).reshape(B, hkv, -1, hd)).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    dv = p.transpose(-1, -2) @ do  # (B, Hkv, Tk, hd): the group's rows sum here
    ds = p * (do @ v.to(dt).transpose(-1, -2) - delta)  # (B, Hkv, g·Tq, Tk)
    dq = (ds @ k.to(dt) * scale).reshape(B, H, Tq, hd)  # (B, H, Tq, hd)
    dk = ds.transpose(-1, -2) @ qg * scale  # (B, Hkv, Tk, hd)
    return dq, dk, dv


def aten_cpu_forward(q, k, v, causal: bool, scale: float):
    """torch's CPU flash kernel: handles GQA itself and returns lse (B, H, Tq) in fp32."""
    out, lse = flash_attention_cpu(q, k, v, causal, scale)
    return out, lse


def aten_cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return flash_attention_cpu_backward(dout.contiguous(), q, k, v, out, lse, causal, scale)


def _expand_kv(q: Tensor, x: Tensor) -> Tensor:
    """(B, Hkv, T, hd) -> (B, H, T, hd): one copy of each kv head per query head of its group."""
    g = q.shape[1] // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _sum_groups(dx: Tensor, hkv: int) -> Tensor:
    B, H, T, hd = dx.shape
    return dx.view(B, hkv, H // hkv, T, hd).sum(2)  # (B, Hkv, T, hd)


def aten_cuda_forward(q, k, v, causal: bool, scale: float):
    """torch's CUDA flash kernel (fp16/bf16). Untested here: written for the GPU machines."""
    return flash_attention_cuda(q, _expand_kv(q, k), _expand_kv(q, v), causal, scale)


def aten_cuda_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    hkv = k.shape[1]
    # Row slices of lse/out are strided views: the kernel reads them by pointer, so copy.
    dout, q, out, lse = (t.contiguous() for t in (dout, q, out, lse))
    ek, ev = _expand_kv(q, k), _expand_kv(q, v)
    dq, dk, dv = flash_attention_cuda_backward(dout, q, ek, ev, out, lse, causal, scale)
    return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)


def aten_cudnn_forward(q, k, v, causal: bool, scale: float):
    """torch's cuDNN attention kernel (fp16/bf16), lse as the flash kernel's. Written for the
    GPU machines: pick_kernel runs it only after probe() found it agreeing with aten_cuda."""
    q, ek, ev = (t.contiguous() for t in (q, _expand_kv(q, k), _expand_kv(q, v)))
    return cudnn_attention_cuda(q, ek, ev, causal, scale)


def aten_cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    hkv = k.shape[1]
    # one layout for all (cuDNN reads dout with out's strides); row slices are strided views
    dout, q, out = (t.contiguous() for t in (dout, q, out))
    ek, ev = _expand_kv(q, k).contiguous(), _expand_kv(q, v).contiguous()
    dq, dk, dv = cudnn_attention_cuda_backward(dout, q, ek, ev, out, lse, causal, scale)
    return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)


KERNELS = {
    "reference": BlockKernel("reference", reference_forward, reference_backward),
    "aten_cpu": BlockKernel("aten_cpu", aten_cpu_forward, aten_cpu_backward),
    "aten_cuda": BlockKernel("aten_cuda", aten_cuda_forward, aten_cuda_backward),
    "aten_cudnn": BlockKernel("aten_cudnn", aten_cudnn_forward, aten_cudnn_backward),
}
CUDA_KERNELS = ("aten_cuda", "aten_cudnn")


def pick_kernel(q: Tensor, name: str | None = None) -> BlockKernel:
    """The kernel for q's device and dtype, or the one named ("reference", "aten_cpu", ...).
    On CUDA: cuDNN's where kernel_choice names it for the device (Hopper+) and probe() found
    it agreeing with the flash kernel, else the flash kernel."""
    if name is not None:
        if name not in KERNELS:
            raise ValueError(f"ring attention kernel {name!r} unknown; one of {sorted(KERNELS)}")
        return KERNELS[name]
    if q.is_cuda:  # flash kernel wants half precision and hd a multiple of 8
        ok = q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
        return KERNELS[cuda_kernel_name(q) if ok else "reference"]
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return KERNELS["aten_cpu"]
    return KERNELS["reference"]


_PROBED: dict[tuple, str] = {}  # (device, dtype, head dim) -> the kernel probe() chose


def cuda_kernel_name(q: Tensor) -> str:
    """The CUDA block kernel for q: "aten_cudnn" where the device prefers cuDNN (kernel_choice)
    and its block kernel agrees with the flash one on this (device, dtype, head dim), probed
    once; else "aten_cuda"."""
    dtype = str(q.dtype).removeprefix("torch.")
    if attention_kernel_for("cuda", device_capability(q.device), dtype) != "cudnn":
        return "aten_cuda"
    key = (str(q.device), q.dtype, q.shape[-1])
    if key not in _PROBED:
        agree = probe(KERNELS["aten_cudnn"], KERNELS["aten_cuda"], *key)
        _PROBED[key] = "aten_cudnn" if agree else "aten_cuda"
    return _PROBED[key]


def probe(candidate: BlockKernel, trusted: BlockKernel, device, dtype, hd: int) -> bool:
    """Whether candidate gives trusted's out, lse and gradients on small random blocks (a
    causal square one and a full rectangular one, 2 query heads per kv head); if not, a
    one-line warning says why and that trusted runs. Both backwards get trusted's out and lse:
    the ring hands a block the merged row's, not the block's own."""
    with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
        return _probe(candidate, trusted, device, dtype, hd)


def _probe(candidate: BlockKernel, trusted: BlockKernel, device, dtype, hd: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    scale = hd**-0.5
    for causal, tq, tk in ((True, 128, 128), (False, 64, 128)):
        q, dout = (torch.randn(1, 4, tq, hd, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, 2, tk, hd, generator=gen) for _ in range(2))
        q, k, v, dout = (t.to(device, dtype) for t in (q, k, v, dout))
        want = trusted.forward(q, k, v, causal, scale)
        want_grads = trusted.backward(dout, q, k, v, *want, causal, scale)
        try:
            got = candidate.forward(q, k, v, causal, scale)
            got_grads = candidate.backward(dout, q, k, v, *want, causal, scale)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            why = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            why = _disagreement([*got, *got_grads], [*want, *want_grads])
        if why:
            warnings.warn(
                f"ring attention: the {candidate.name} block kernel {why} on {device} {dtype} "
                f"(head dim {hd}, causal {causal}); using {trusted.name}",
                stacklevel=2,
            )
            return False
    return True


PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-8}  # else half precision's: 2e-2


def _disagreement(got: list[Tensor], want: list[Tensor]) -> str:
    """Which of out, lse, dq, dk, dv differs beyond the dtype's tolerance ("": none), each
    relative to the largest value of trusted's (lse: absolute, in natural-log units)."""
    tol = PROBE_TOL.get(want[0].dtype, 2e-2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        if a.shape != b.shape:
            return f"gave {name} of shape {tuple(a.shape)}, not {tuple(b.shape)}"
        err = (a.double() - b.double()).abs().max().item()
        bound = tol * (1.0 if name == "lse" else max(b.double().abs().max().item(), 1e-6))
        if not err <= bound:  # NaN fails too
            return f"gave {name} off by {err:.3g} (tolerance {bound:.3g})"
    return ""
