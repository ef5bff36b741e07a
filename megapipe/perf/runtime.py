"""The software the model prices: what the runtime does with a step's work, besides the FLOPs.

Two runtimes: `megapipe` (ours, the default: what tools/plan.py projects) and `megatron2021`,
the Megatron-LM of Narayanan et al. 2021 that produced Table 1, used to validate the mechanisms
on published measurements. They differ in facts about the code, none fitted:

  attention       ours: config/memory.attention_path on CUDA (a fused flash/SDPA kernel under
                  bf16; ring attention under cp). Megatron 2021: unfused: QKᵀ and PV batched
                  GEMMs with the s² scores in HBM, its fused scale-mask-softmax kernel and the
                  attention dropout in between (FlashAttention came in 2022).
  residual bytes  ours keeps the residual stream and norms in float32 (config/memory.py);
                  Megatron's fp16 run keeps them in its compute dtype.
  fused           Megatron fuses bias+dropout+add and bias+GeLU (its fused kernels); ours runs
                  dropout, add and the autocast casts as separate kernels.
  weight cast     autocast casts every float32 weight to bf16 in each forward (read 4, write 2
                  bytes per parameter); Megatron keeps fp16 weights (0).
  grad accumulate bytes per parameter per microbatch to add a weight grad into the grad kept
                  over the step: ours the cast-back of the bf16 grad to float32 (2 + 4) and
                  the accumulation into the float32 .grad (4 + 4 + 4); Megatron 2021's fp16
                  run adds the fp16 weight grad into its fp16 grad buffer (2 + 2 + 2; fp32
                  accumulation was opt-in, --accumulate-allreduce-grads-in-fp32).
  p2p             ours: float32 activations (StageLinks' dtype), the whole (b, T/cp, d) tensor
                  from every tp rank (1/tp of it under sequence parallelism), sends
                  fire-and-forget (pipeline/p2p.py). Megatron: fp16, the scatter/gather
                  optimisation (§4.1: each tp rank sends 1/tp over its own NIC, then an NVLink
                  all-gather), blocking send/receive pairs (the sender waits for its transfer).
  dp              ours: float32 buckets of 25 MB all-reduced during the last microbatch's
                  backward (parallel/data/reducer.py, overlapped); Megatron 2021: one fp16
                  all-reduce of the contiguous grad buffer after the pipeline is done (its
                  `allreduce_gradients` after forward_backward, not overlapped).
  optimizer       bytes per parameter of the step over HBM. Ours: torch's foreach AdamW over
                  float32 weights, grads and moments, op by op (decay 8, first moment 12,
                  second moment 8 + 12, the denominator's sqrt, divide and add 24, the
                  update 16) plus the grad norm (4) and the clip (8): 92 B. Megatron: the
                  fp16 grads copied to fp32 (6), unscaled and checked (4), norm and clip
                  (12), fused Adam over fp32 master weights and moments (4·4 read + 3·4
                  written), the fp16 weights written back (6): 56 B.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    name: str
    attention: str  # "auto": our kernel choice (attention_path); "math": unfused
    residual_bytes: int  # 0: the compute dtype's (2 under bf16/fp16, else 4)
    fused_elementwise: bool
    weight_cast_bytes: float  # per parameter per forward
    grad_accum_bytes: float  # per parameter per microbatch backward
    p2p_bytes: int  # bytes per activation element sent between stages (0: compute dtype's)
    p2p_scatter_gather: bool
    p2p_blocking: bool
    grad_bytes: int  # bytes per grad element in the dp reduction (0: compute dtype's)
    dp_overlap: bool  # reduce during the last backward (True) or after the pipeline
    dp_bucket_mb: float  # 0: one buffer
    optimizer_bytes: float  # HBM bytes per parameter of the optimizer step
    autocast_casts: bool = True  # the norm outputs cast for the next linear (resolved())


MEGAPIPE = Runtime(
    name="megapipe",
    attention="auto",
    residual_bytes=4,
    fused_elementwise=False,
    weight_cast_bytes=6.0,
    grad_accum_bytes=18.0,
    p2p_bytes=4,
    p2p_scatter_gather=False,
    p2p_blocking=False,
    grad_bytes=4,
    dp_overlap=True,
    dp_bucket_mb=25.0,
    optimizer_bytes=92.0,
)

MEGATRON_2021 = Runtime(
    name="megatron2021",
    attention="math",
    residual_bytes=0,
    fused_elementwise=True,
    weight_cast_bytes=0.0,
    grad_accum_bytes=6.0,
    p2p_bytes=0,
    p2p_scatter_gather=True,
    p2p_blocking=True,
    grad_bytes=0,
    dp_overlap=False,
    dp_bucket_mb=0.0,
    optimizer_bytes=56.0,
)

RUNTIMES = {r.name: r for r in (MEGAPIPE, MEGATRON_2021)}


def resolved(runtime: Runtime, dtype: str) -> Runtime:
    """`runtime` as it runs a config of train.dtype `dtype`. Ours under float32 runs without
    autocast (parallel/precision.py): no weight casts, no cast of the norm outputs, and each
    microbatch's weight grad added straight into the float32 .grad (read 4 + 4, write 4 = 12 B
    per parameter). The bf16/fp16 runs (every GPU projection) are unchanged."""
    if runtime.name == "megapipe" and dtype == "float32":
        return dataclasses.replace(
            runtime, weight_cast_bytes=0.0, grad_accum_bytes=12.0, autocast_casts=False
        )
    return runtime
