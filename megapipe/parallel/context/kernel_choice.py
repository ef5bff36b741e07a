"""Which fused attention kernel runs on a device: the one rule the model and the projection read.

models/attention.py runs the kernel this names for its dense core, the ring's block kernels
(parallel/context/kernels.pick_kernel) try cuDNN's where it names "cudnn", and the performance
model prices megapipe's attention with it for a profile's GPU (perf/software.resolved_for reads
the profile's compute capability). Pure Python: no torch, so the projection can ask it about a
GPU this machine does not have.

The rule is Transformer Engine's (attention/dot_product_attention/utils.py: "Disabling
FlashAttention to give FusedAttention preference on Hopper+ for performance reasons"): on
Hopper and later, where both apply, cuDNN's fused attention before FlashAttention-2 (the
FlashAttention-3 paper, Shah et al. 2024, Figs. 5-6, measures cuDNN's kernel at ~1.6x FA2's
rate on an H100: perf/clusters/h100.yaml); before Hopper the flash kernel (flash-attn's FA2 or
SDPA's flash backend, first in PyTorch's own order there).
"""

from __future__ import annotations

HOPPER = (9, 0)  # compute capability from which cuDNN's kernel is preferred (TE's rule)
AMPERE = (8, 0)  # compute capability from which FlashAttention-2 runs half precision
HALF = ("float16", "bfloat16")


def attention_kernel_for(
    device: str,
    capability: tuple[int, int] | None,
    dtype: str,
    *,
    flash_attn: bool = False,
    documents: bool = False,
    cudnn: bool = True,
) -> str:
    """The fused attention kernel for `device` ("cuda" | "cpu") of compute `capability`
    ((major, minor); None: not known) on `dtype` ("bfloat16", "float16", "float32") inputs:

    "cudnn"  SDPA with its cuDNN backend first (sm90+, half precision, dense causal rows);
    "flash"  FlashAttention-2: the flash-attn package where installed (`flash_attn`), else SDPA's
             flash backend (sm80+, half precision; also a CUDA GPU of unknown capability);
             under document masking flash-attn's varlen kernel;
    "sdpa"   SDPA's own choice otherwise (memory-efficient or math backend: float32, document
             masks without flash-attn, GPUs before sm80);
    "cpu"    torch's CPU kernels (SDPA's CPU flash kernel or math).

    `cudnn`: whether torch can put the cuDNN backend first (sdpa_kernel's set_priority)."""
    if device != "cuda":
        return "cpu"
    if dtype not in HALF:
        return "sdpa"
    if documents:  # flash-attn's varlen kernel, else SDPA's memory-efficient one with the mask
        return "flash" if flash_attn else "sdpa"
    if capability is None:
        return "flash"
    if cudnn and tuple(capability) >= HOPPER:
        return "cudnn"
    return "flash" if tuple(capability) >= AMPERE else "sdpa"
