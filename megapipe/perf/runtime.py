"""The software the model prices: what the runtime does with a step's work, besides the FLOPs.

Two runtimes: `megapipe` (ours, the default: what tools/plan.py projects) and `megatron2021`,
the Megatron-LM of Narayanan et al. 2021 that produced Table 1, used to validate the mechanisms
on published measurements. They differ in facts about the code, none fitted:

  attention       ours: config/memory.attention_path on CUDA (a fused flash/SDPA kernel under
                  bf16; ring attention under cp). Megatron 2021: unfused: QKᵀ and PV batched
                  GEMMs with the s² scores in HBM, its fused scale-mask-softmax kernel and the
                  attention dropout in between (FlashAttention came in 2022). The fused
                  kernel's own rate is the profile's (attention_kernel: ours "flash", PyTorch
                  SDPA's flash backend, FlashAttention-2 on Hopper).
  residual bytes  ours keeps the residual stream and norms in float32 (config/memory.py);
                  Megatron's fp16 run keeps them in its compute dtype.
  fused           Megatron fuses bias+dropout+add and bias+GeLU (its fused kernels); ours runs
                  dropout, add and the autocast casts as separate kernels.
  weight cast     bytes per parameter per forward: ours with float32 weights under bf16 autocast
                  casts every weight to bf16 (read 4, write 2); with bf16 weights
                  (train.params_dtype=bfloat16) nothing; Megatron keeps fp16 weights (0).
  grad accumulate bytes per parameter per microbatch to add a weight grad into the grad kept
                  over the step: ours with float32 weights the cast-back of the bf16 grad to
                  float32 (2 + 4) and the accumulation into the float32 .grad (4 + 4 + 4); with
                  bf16 weights the bf16 weight grad added in place into the float32 main grad
                  (2 + 4 + 4); Megatron 2021's fp16 run adds the fp16 weight grad into its fp16
                  grad buffer (2 + 2 + 2; fp32 accumulation was opt-in,
                  --accumulate-allreduce-grads-in-fp32).
  p2p             ours: float32 activations (StageLinks' dtype), the whole (b, T/cp, d) tensor
                  from every tp rank (1/tp of it under sequence parallelism), sends
                  fire-and-forget (pipeline/p2p.py). Megatron: fp16, the scatter/gather
                  optimisation (§4.1: each tp rank sends 1/tp over its own NIC, then an NVLink
                  all-gather), blocking send/receive pairs (the sender waits for its transfer).
  dp              ours: float32 buckets of 25 MB all-reduced during the last microbatch's
                  backward (parallel/data/reducer.py, overlapped); Megatron 2021: one fp16
                  all-reduce of the contiguous grad buffer after the pipeline is done (its
                  `allreduce_gradients` after forward_backward, not overlapped).
  optimizer       bytes per parameter of the step over HBM. Ours: the AdamW kind the code picks
                  for a CUDA parameter (train/optim.device_adamw_kind: fused where torch has
                  the kernel): fused, one pass reading weight, grad and both moments (16) and
                  writing weight and moments (12): 28 B; foreach, op by op (decay 8, first
                  moment 12, second moment 8 + 12, the denominator's sqrt, divide and add 24,
                  the update 16): 80 B; plus the grad norm (4) and the clip (8); with bf16
                  weights the float32 main param written back to the bf16 weight (4 + 2).
                  Megatron: the fp16 grads copied to fp32 (6), unscaled and checked (4), norm
                  and clip (12), fused Adam over fp32 master weights and moments (4·4 read +
                  3·4 written), the fp16 weights written back (6): 56 B.
  param gather    zero>=1: the updated weights all-gathered over dp·cp after the step, in the
                  weights' dtype. Ours launches every bucket's gather at the end of the step
                  and waits for each at the first use of its bucket in the next forward
                  (parallel/data/zero2.OverlappedGatherReducer; tests/test_perf_runtime.py pins
                  it), as Megatron-Core's --overlap-param-gather does: only the first
                  bucket's is exposed.
  zero 2, 3       grads reduce-scattered once per step in float32, in the last backward, as at
                  zero=1 (the earlier microbatches accumulate local grads; each rank keeps its
                  shard after), and at zero=3 each block's weights all-gathered in the
                  weights' dtype before its forward and again for its backward, every
                  microbatch (perf/data_parallel.py prices them as traffic beside the compute;
                  tests/test_perf_runtime.py pins the dtypes and counts).
  tp overlap      sequence parallelism's all-gather / reduce-scatter decomposed into tp ring
                  steps beside the linears' matmul chunks where parallel.tp_overlap asks
                  for it (parallel/tensor/overlap.py, Wang et al. 2023: TP_COMM_OVERLAP, read
                  here): only what a step's transfer outlasts its chunk's matmul is exposed
                  (costs.CostModel._tp_layer). Megatron 2021 had no such overlap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megapipe.config.states import FLOAT32, GRAD_BYTES, PARAM_BYTES
from megapipe.parallel.tensor.overlap import TP_COMM_OVERLAP
from megapipe.train.optim import device_adamw_kind

ADAMW_BYTES = {"fused": 28.0, "foreach": 80.0}  # HBM bytes per float32 parameter of one step
NORM_CLIP_BYTES = 12.0  # the global grad norm reads the grads (4), the clip rescales them (8)
WRITE_BACK_BYTES = float(FLOAT32 + PARAM_BYTES["bfloat16"])  # main param -> bf16 weight


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
    adamw: str = ""  # ours: the AdamW kind the code runs on CUDA; "": optimizer_bytes as given
    param_bytes: int = 4  # bytes per weight element in zero>=1's all-gather (resolved())
    param_gather_overlap: bool = False  # zero>=1's gather hidden behind the next forward
    tp_comm_overlap: bool = False  # SP's collectives chunked beside the linears' matmuls
    # the fused attention kernel: "flash" (FlashAttention-2 class: PyTorch SDPA's flash
    # backend) or "cudnn" (cuDNN's, Transformer Engine's choice on Hopper); the profile
    # prices each (cluster.Cluster.attention_factor)
    attention_kernel: str = "flash"


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
    grad_bytes=GRAD_BYTES,
    dp_overlap=True,  # buckets launched from the grad hooks (parallel/data/reducer.py; pinned)
    dp_bucket_mb=25.0,
    optimizer_bytes=ADAMW_BYTES[device_adamw_kind("cuda")] + NORM_CLIP_BYTES,
    adamw=device_adamw_kind("cuda"),
    param_gather_overlap=True,  # waited for per bucket on first use (zero2.py; pinned)
    tp_comm_overlap=TP_COMM_OVERLAP,  # under parallel.tp_overlap (parallel/tensor/overlap.py)
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


def weight_cast_bytes(params_dtype: str, compute: int) -> float:
    """Bytes per parameter per forward to cast a weight to the compute dtype (`compute` bytes):
    read the weight, write the copy; none where the weight is already in it."""
    weight = PARAM_BYTES[params_dtype]
    return float(weight + compute) if weight != compute else 0.0


def grad_accum_bytes(params_dtype: str, compute: int) -> float:
    """Bytes per parameter per microbatch to add a weight grad (in the compute dtype) into the
    grad kept over the step: float32 weights' .grad takes it cast to float32 first (autograd
    accumulates in the parameter's dtype), then reads both and writes the sum; bf16 weights'
    float32 main grad takes it in place (read it, read and write the main grad)."""
    if params_dtype == "float32":
        cast = compute + FLOAT32 if compute != FLOAT32 else 0
        return float(cast + 3 * GRAD_BYTES)
    return float(compute + 2 * GRAD_BYTES)


def resolved(runtime: Runtime, dtype: str, params_dtype: str = "float32") -> Runtime:
    """`runtime` as it runs a config of train.dtype `dtype` and train.params_dtype
    `params_dtype` (idempotent). Ours: the weight casts and grad accumulation of the weights'
    and compute dtypes (float32 without autocast also casts no norm output), the optimizer of
    the AdamW kind the code runs plus the bf16 write-back, the gather in the weights' dtype.
    Megatron 2021 (fp16 weights) is unchanged."""
    if runtime.name != "megapipe":
        return runtime
    compute = FLOAT32 if dtype == "float32" else 2
    optimizer = ADAMW_BYTES[runtime.adamw] + NORM_CLIP_BYTES
    if params_dtype != "float32":
        optimizer += WRITE_BACK_BYTES
    return dataclasses.replace(
        runtime,
        weight_cast_bytes=weight_cast_bytes(params_dtype, compute),
        grad_accum_bytes=grad_accum_bytes(params_dtype, compute),
        autocast_casts=dtype != "float32",
        optimizer_bytes=optimizer,
        param_bytes=PARAM_BYTES[params_dtype],
    )
