"""The software the model prices: what the runtime does with a step's work, besides the FLOPs.

Four runtimes: `megapipe` (ours, the default: what tools/plan.py projects), `megatron2021`, the
Megatron-LM of Narayanan et al. 2021 that produced Table 1, `megatron_core` (Megatron-Core
0.8-0.12 as its published H100 runs used it) and `torchtitan` (PyTorch's FSDP2 trainer); the
last three validate the mechanisms on published measurements (benchmarks/validation/: table1.py,
h100_validation.py). MEGATRON_CORE and TORCHTITAN state their facts beside each field with
its source; `megatron2022` (Korthikanti et al. 2022's code: validation/megatron_runs.py) is
`megatron2021` with Megatron-LM's asynchronous tp communication. Ours and Megatron 2021's
differ in facts about the code, none fitted:

  attention       ours: config/memory_terms.attention_path on CUDA (a fused kernel under bf16;
                  ring attention under cp). Megatron 2021: unfused: QKᵀ and PV batched
                  GEMMs with the s² scores in HBM, its fused scale-mask-softmax kernel and the
                  attention dropout in between (FlashAttention came in 2022). The fused
                  kernel's own rate is the profile's (cluster.attention_factor) for the kernel
                  ours runs on the profile's GPU, resolved_for asks the code
                  (parallel/context/kernel_choice.attention_kernel_for of the profile's
                  compute_capability, models/attention.py's and the ring's rule): "cudnn" on
                  Hopper (SDPA's cuDNN backend first, Transformer Engine's preference; the
                  ring's cuDNN block kernel, taken once its probe agrees with the flash one),
                  "flash" before it (FlashAttention-2: flash-attn or SDPA's flash backend).
  residual bytes  ours keeps the residual stream and norms in float32 (config/memory_terms.py);
                  Megatron's fp16 run keeps them in its compute dtype.
  fused           Megatron fuses bias+dropout+add and bias+GeLU (its fused kernels); ours runs
                  dropout, add and the autocast casts as separate kernels, except under
                  train.compile: inductor fuses each layer's norms, adds, activation and RoPE;
                  the norm outputs' casts only where the linears compile too (tp = 1, float32
                  weights, no Zero Bubble W: models/gpt.compiled_linears).
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
  dp              ours: float32 buckets of max(25 MB, 1M parameters per dp · cp replica)
                  (Megatron-Core's rule) all-reduced during the last microbatch's
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
                  (costs.CostModel._tp_overlapped, perf/tp_overlap.py). Megatron 2021 had no
                  such overlap.
  full recompute  ours reruns a layer's forward under torch's non-reentrant checkpoint, which
                  stops at the last saved tensor: a dense layer's MLP output sum over tp is
                  not rerun without dropout (tests/test_fake_ranks.py counts it); Megatron's
                  reruns it all.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megapipe.config import Config
from megapipe.config.fp8_weights import experts_fp8
from megapipe.config.states import (
    BUCKET_PARAMS_PER_REPLICA,
    DEFAULT_BUCKET_MB,
    FLOAT32,
    GRAD_BYTES,
    PARAM_BYTES,
)
from megapipe.models.gpt import compiled_linears
from megapipe.parallel.autograd.grouped_linear import grouped_mm_for
from megapipe.parallel.context.kernel_choice import attention_kernel_for
from megapipe.parallel.tensor.overlap import TP_COMM_OVERLAP
from megapipe.perf.cluster import Cluster
from megapipe.train.optim import device_adamw_kind

ADAMW_BYTES = {"fused": 28.0, "foreach": 80.0}  # HBM bytes per float32 parameter of one step
NORM_CLIP_BYTES = 12.0  # the global grad norm reads the grads (4), the clip rescales them (8)
WRITE_BACK_BYTES = float(FLOAT32 + PARAM_BYTES["bfloat16"])  # main param -> bf16 weight
WIDEN_BYTES = float(PARAM_BYTES["bfloat16"] + FLOAT32)  # a bf16 main grad's float32 copy


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
    # each high-precision linear casts its weight again in its backward (ours keeps the
    # parameter, not autocast's cast: parallel/autograd/weight_grad.save_operands)
    backward_weight_casts: bool = False
    adamw: str = ""  # ours: the AdamW kind the code runs on CUDA; "": optimizer_bytes as given
    param_bytes: int = 4  # bytes per weight element in zero>=1's all-gather (resolved())
    param_gather_overlap: bool = False  # zero>=1's gather hidden behind the next forward
    # sequence parallelism's all-gathers / reduce-scatters split into chunks that overlap the
    # linears' GEMMs (perf/tp_overlap.py: only what outlasts its GEMM is exposed)
    tp_comm_overlap: bool = False
    tp_overlap_splits: int = 0  # chunks of a pipelined reduce-scatter (0: tp)
    tp_overlap_sm_share: float = 0.0  # of the SMs the overlapped collectives keep
    p2p_overlap: bool = False  # interleaved schedules' sends overlap compute (else p2p_blocking)
    dp_bucket_first_only: bool = False  # only the first stage's first chunk bucketed (dp_plan)
    dp_bucket_per_block: bool = False  # one bucket per layer (FSDP's unit), not dp_bucket_mb
    # full recompute stops once the last saved tensor is back (torch's non-reentrant
    # checkpoint), so a dense layer's MLP output sum over tp is not rerun (Megatron's
    # CheckpointFunction reruns the whole forward)
    recompute_stops_early: bool = False
    # how recompute.mode=selective reruns: "attention" (recompute.modules as our code reruns
    # them: the attention core, Korthikanti et al. 2022, and the MLP), "op" (torchtitan's per-op
    # policy: every second matmul and the elementwise ops, whatever the modules) or "mlpwi"
    # (MaxText's save_dot_except_mlpwi, recompute.modules core_attn,mlp: the MLP input matmul,
    # the attention core and the elementwise ops)
    selective_recompute: str = "attention"
    # HBM bytes per logit of the whole-logits cross entropy (forward, backward): Table 1's
    # float32 log-softmax (the constants were fitted with it); not used by our fused head
    loss_bytes: tuple[float, float] = (16.0, 12.0)
    # buckets counted in parameters (0: dp_bucket_mb): max(dp_bucket_params, per_rank · dp)
    dp_bucket_params: float = 0.0
    dp_bucket_params_per_rank: float = 0.0
    # the fused attention kernel: "flash" (FlashAttention-2 class: PyTorch SDPA's flash
    # backend) or "cudnn" (cuDNN's, Transformer Engine's choice on Hopper); the profile
    # prices each (cluster.Cluster.attention_factor); "auto" (ours): the code's choice for
    # the profile's GPU, made by resolved_for (kernel_choice.attention_kernel_for)
    attention_kernel: str = "flash"
    # a MoE layer's local experts as one grouped GEMM (True) or one GEMM per local expert
    # (Megatron-Core's --moe-grouped-gemm is opt-in, default False in arguments.py); None (ours):
    # the code's choice for the profile's device and train.dtype, made by resolved_for
    # (parallel/autograd/grouped_linear.grouped_mm_for: bf16 on sm90/sm100, the CPU)
    moe_grouped_gemm: bool | None = False
    # experts split over tp like the dense MLP, the routed rows all-gathered over tp before them
    # and reduce-scattered after (Megatron-Core <= 0.9; ours keeps experts whole: docs/moe.md)
    moe_expert_tp: bool = False
    # the shared experts on a side stream beside the dispatch and combine all-to-alls, both
    # ways (Megatron-Core's --moe-shared-expert-overlap, moe/shared_experts.py; ours runs them
    # in line): perf/costs_moe.MoECosts._shared_hidden
    moe_shared_expert_overlap: bool = False
    # ours under train.compile (resolved_for): only the transformer layers are compiled
    # (models/gpt.TransformerLayer.compile_math); the final norm stays eager, and so does the
    # residual dropout under sequence parallelism
    compiled_layers: bool = False
    # Megatron-LM's asynchronous tp communication (2021-09 on): the column-parallel linears'
    # input-grad all-reduce (reduce-scatter under SP) beside their wgrad GEMMs, under SP the
    # input's all-gather again beside the dgrad GEMMs (perf/tp_overlap.async_backward)
    tp_async_wgrad: bool = False
    # how train.fp8's casts run (perf/fp8_costs.py): "current" (ours, parallel/fp8.py: every
    # operand's amax taken and cast afresh each microbatch, amaxes all-reduced one by one) or
    # "delayed" (Transformer Engine's DelayedScaling: casts fused with the norm or with the
    # transpose, weights cast once a step, one batched amax all-reduce per model chunk)
    fp8_scaling: str = "current"
    # the tp ring gathers tensorwise FP8 operands as one-byte payloads, the column linears'
    # inputs and the row linears' output grads (ours: parallel/fp8_overlap.payloads).
    # Transformer Engine's userbuffers gather FP8 as well (initialize_ub: "AllGather buffers
    # use fp8 when using fp8 recipe"), but its rows are priced in high precision: with
    # payloads the held-out FP8 rows project 8.7% mean / 20.5% max, faster than measured at
    # scale, which points at a cost the FP8 model misses there (docs/benchmarks/
    # 2026-12-01-sp-gather-and-fp8-saves-cpu.md)
    fp8_ring_payloads: bool = False
    # the tp ring's column linears keep their input's shard and gather it again before their
    # backward ring (parallel/tensor/overlap.py), priced exposed; False: not priced
    # (Transformer Engine keeps the shard too, and overlaps that gather with the dgrad GEMM)
    ring_regathers: bool = False
    # each norm keeps its input alone and reruns its forward in backward (ours eager:
    # parallel/autograd/rerun.py); compiled, inductor chooses for the whole layer
    norm_reruns: bool = False


MEGAPIPE = Runtime(
    name="megapipe",
    recompute_stops_early=True,  # parallel/recompute.py: use_reentrant=False
    attention="auto",
    attention_kernel="auto",  # models/attention.py's rule for the profile's GPU (resolved_for)
    residual_bytes=4,  # float32 weights' residual stream (resolved(): the weights' dtype)
    fused_elementwise=False,
    weight_cast_bytes=6.0,
    backward_weight_casts=True,  # parallel/autograd/weight_grad.save_operands
    fp8_ring_payloads=True,  # parallel/fp8_overlap.payloads
    ring_regathers=True,  # parallel/tensor/overlap.py
    norm_reruns=True,  # parallel/autograd/rerun.py (resolved(): eager only)
    grad_accum_bytes=18.0,
    p2p_bytes=4,  # likewise
    p2p_scatter_gather=False,
    p2p_blocking=False,
    grad_bytes=GRAD_BYTES,
    dp_overlap=True,  # buckets launched from the grad hooks (parallel/data/reducer.py; pinned)
    dp_bucket_mb=DEFAULT_BUCKET_MB,
    # the reducer's buckets (parallel/data/reducer.replica_bucket_mb, pinned): float32 grads of
    # max(25 MB, 1M per dp · cp replica) parameters, so the same parameters in another dtype
    dp_bucket_params=DEFAULT_BUCKET_MB * 2**20 / GRAD_BYTES,
    dp_bucket_params_per_rank=BUCKET_PARAMS_PER_REPLICA,
    optimizer_bytes=ADAMW_BYTES[device_adamw_kind("cuda")] + NORM_CLIP_BYTES,
    adamw=device_adamw_kind("cuda"),
    param_gather_overlap=True,  # waited for per bucket on first use (zero2.py; pinned)
    tp_comm_overlap=TP_COMM_OVERLAP,  # under parallel.tp_overlap (parallel/tensor/overlap.py)
    moe_grouped_gemm=None,  # grouped_linear.grouped_mm_for of the profile's GPU (resolved_for)
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
    autocast_casts=False,  # fp16 weights, no autocast
)

# Megatron-LM as Korthikanti et al. 2022 (arXiv 2205.05198) ran it (NVIDIA/Megatron-LM as of
# 2022-05, commit de593298): the 2021 code's facts, and its asynchronous tp communication,
# default on since 2021-09 (merge request !316, commit 6e1bde1e: --no-async-tensor-model-
# parallel-allreduce turns it off; megatron/mpu/layers.py LinearWithGradAccumulationAndAsync
# Communication). Its gradient accumulation fusion (2022-02, commit 83b1e42f) runs only with
# fp32 grad accumulation (arguments.py turns it off otherwise), which the 2021 runtime's fp16
# grads do not have: not priced.
MEGATRON_2022 = dataclasses.replace(MEGATRON_2021, name="megatron2022", tp_async_wgrad=True)

# Megatron-Core 0.8-0.12 with the flags its published H100 runs (NVIDIA NeMo / Megatron-LM
# performance recipes) set. Sources: NVIDIA/Megatron-LM megatron/training/arguments.py,
# megatron/core/distributed/{distributed_data_parallel,param_and_grad_buffer}.py,
# megatron/core/optimizer/distrib_optimizer.py, megatron/core/pipeline_parallel/schedules.py,
# megatron/core/transformer/transformer_config.py; Transformer Engine's docs.
MEGATRON_CORE = Runtime(
    name="megatron_core",
    attention="fused",
    # TE's DotProductAttention on Hopper: "Disabling FlashAttention to give FusedAttention
    # preference on Hopper+ for performance reasons" (attention/dot_product_attention/utils.py)
    attention_kernel="cudnn",
    residual_bytes=0,  # fp32_residual_connection defaults False: the residual in bf16
    # bias_activation_fusion, bias_dropout_fusion, bias_swiglu_fusion, apply_rope_fusion default
    # True; TE's LayerNormLinear / LayerNormMLP fuse the norm with the GEMM's input (bf16 out)
    fused_elementwise=True,
    weight_cast_bytes=0.0,  # --bf16: the model's weights are bf16, no per-forward cast
    # gradient_accumulation_fusion (default True with TE): the wgrad GEMM accumulates into the
    # fp32 main_grad in its epilogue (wgrad_gemm_accum_fp32): read and write it, 4 + 4 B
    grad_accum_bytes=8.0,
    p2p_bytes=0,  # the pipeline's tensors in the compute dtype (bf16)
    p2p_scatter_gather=False,  # under sequence parallelism each tp rank sends its own shard
    p2p_blocking=True,  # 1F1B: batched isend/irecv pairs waited for at once (schedules.py)
    # --overlap-p2p-communication (default on for interleaved schedules): sends posted
    # asynchronously and waited for only where their tensor is used
    p2p_overlap=True,
    # --bf16 sets accumulate_allreduce_grads_in_fp32: grads reduced in fp32 (arguments.py)
    grad_bytes=4,
    dp_overlap=True,  # --overlap-grad-reduce: a bucket reduce-scattered once its grads are done
    dp_bucket_mb=0.0,
    # DistributedDataParallelConfig.bucket_size default: max(40M, 1M · dp) parameters ("larger
    # DP sizes need larger buckets to ensure collectives do not become latency-bound")
    dp_bucket_params=40e6,
    dp_bucket_params_per_rank=1e6,
    # distributed optimizer over fp32 main params: grad norm (4) and clip (8), fused Adam
    # (param, grad, two moments read, three written: 16 + 12), main param -> bf16 weight (4 + 2);
    # bf16 needs no loss scale, so no unscale or inf check
    optimizer_bytes=NORM_CLIP_BYTES + ADAMW_BYTES["fused"] + WRITE_BACK_BYTES,
    autocast_casts=False,  # no autocast: TE's modules run on bf16 weights and inputs
    # core/tensor_parallel/cross_entropy.py on logits.float(): the cast (2 + 4), max (4),
    # subtract (8), exp in place (8), sum (4), divide (8) = 38; backward: the softmax times the
    # grad in place (8) and the cast back to bf16 (4 + 2) = 14
    loss_bytes=(38.0, 14.0),
    param_bytes=2,  # --overlap-param-gather all-gathers the bf16 weights
    param_gather_overlap=True,  # bucket by bucket in the next forward's pre-hooks
    # --tp-comm-overlap (TE userbuffers: ring-exchange all-gathers, pipelined reduce-scatters
    # beside the GEMMs) is opt-in (default False): priced where the config sets
    # parallel.tp_overlap, as for ours
    tp_comm_overlap=True,
    # TE's default userbuffers layout (module/base.py initialize_ub): pipelined reduce-scatters
    # in 4 splits, pipeline and bulk methods with num_sm 16 and set_sm_margin: 16 of an H100
    # SXM's 132 SMs (datasheet) kept from the GEMMs beside them
    tp_overlap_splits=4,
    tp_overlap_sm_share=16 / 132,
    # distributed_data_parallel.py: bucketing off on pipeline stages after the first and for
    # model chunks after the first (their reduction is off the critical path)
    dp_bucket_first_only=True,
    # --fp8-format hybrid with TE's default recipe, DelayedScaling (amax history 1024, "max"),
    # as NVIDIA's published FP8 recipes set it (NeMo's bf16_with_fp8_mixed; dgxc-benchmarking
    # llama3.1/configure.sh fp8_amax_history_len=1024); Megatron-Core's --fp8-recipe delayed
    fp8_scaling="delayed",
)

# torchtitan (Dec 2024 - mid 2025) as its published H100 benchmarks ran it. Sources: pytorch/
# torchtitan torchtitan/config_manager.py (job config defaults), torchtitan/parallelisms/
# parallelize_llama.py (fully_shard per transformer block and the root), docs/fsdp.md.
TORCHTITAN = Runtime(
    name="torchtitan",
    attention="fused",  # F.scaled_dot_product_attention: the flash backend on H100
    residual_bytes=0,  # FSDP2 MixedPrecisionPolicy param_dtype bf16: activations in bf16
    # torch.compile (training.compile; a row that compiles) fuses the norms, SwiGLU and the
    # residual adds per block; eager runs them op by op (validation rows set it per run)
    fused_elementwise=True,
    # the fp32 shard is cast to bf16 before each all-gather: 6 B per parameter per gather on
    # 1/dp of them, not priced (the gathered weight is already bf16)
    weight_cast_bytes=0.0,
    # mixed_precision_reduce float32: each microbatch's bf16 weight grad cast to fp32 (2 + 4)
    # before its reduce-scatter; the sum into the fp32 sharded grad is on 1/dp of them
    grad_accum_bytes=6.0,
    p2p_bytes=0,
    p2p_scatter_gather=False,
    p2p_blocking=False,  # torch.distributed.pipelining posts isend/irecv and waits at use
    grad_bytes=4,  # reduce_dtype float32
    dp_overlap=True,  # each block's reduce-scatter on its own stream as its backward ends
    dp_bucket_mb=0.0,
    dp_bucket_per_block=True,  # fully_shard per transformer block: one collective per block
    # optimizer.implementation "fused" AdamW over the fp32 sharded params (16 read, 12
    # written) with the grad norm and clip (12); no write-back: weights are cast at gather
    optimizer_bytes=ADAMW_BYTES["fused"] + NORM_CLIP_BYTES,
    autocast_casts=False,
    param_bytes=2,  # param_dtype bf16: the all-gathers move bf16
    param_gather_overlap=True,  # the next block's all-gather prefetched (FSDP2's default)
    # activation_checkpoint.selective_ac_option "op" (the published rows'): _save_list keeps
    # mm and SDPA outputs, "except every second mm" (parallelize_llama.py)
    selective_recompute="op",
)

# MosaicML LLM Foundry on Composer with PyTorch FSDP (FSDP1) as its H100 benchmark table ran it
# (scripts/train/benchmarking/submit_benchmarks.py and the MPT yamls;
# benchmarks/validation/data/llm_foundry_h100_bf16.csv's header): FULL_SHARD, mixed precision
# DEFAULT, amp_bf16, eager.
LLM_FOUNDRY = dataclasses.replace(
    TORCHTITAN,
    name="llm_foundry",
    attention="fused",  # attn_impl flash: FlashAttention-2 (attention_kernel "flash")
    # eager: norms, GeLU and the residual adds op by op (low_precision_layernorm keeps the norm
    # in bf16 under autocast, so no cast of its output)
    fused_elementwise=False,
    # torch/distributed/fsdp/_runtime_utils.py: each microbatch's bf16 flat grad cast to the
    # fp32 reduce dtype (2 + 4) and divided in place by the predivide factor before its
    # reduce-scatter (4 + 4)
    grad_accum_bytes=14.0,
    # decoupled LionW (one moment: param, grad, momentum read, param and momentum written,
    # 12 + 8) over the fp32 shard, with the grad norm clip (12)
    optimizer_bytes=32.0,
    selective_recompute="attention",
)

# MaxText (JAX/XLA) as NVIDIA's DGX Cloud recipe ran it (benchmarks/validation/data/
# maxtext_dgxc_h100_bf16.csv's header: maxtext/configure.sh): FSDP over all GPUs, float32 weights
# with bf16 compute.
MAXTEXT = dataclasses.replace(
    TORCHTITAN,
    name="maxtext",
    attention_kernel="cudnn",  # attention=cudnn_flash_te: cuDNN's flash kernel through TE
    fused_elementwise=True,  # XLA fuses the element-wise ops into their neighbours
    # the weight grads of the bf16 dots converted to the float32 weights' dtype (2 + 4)
    grad_accum_bytes=6.0,
    # remat_policy save_dot_except_mlpwi: the projections' and the MLP output's dots saved;
    # the MLP input dots, the attention core and the element-wise ops recomputed
    selective_recompute="mlpwi",
)

RUNTIMES = {
    r.name: r
    for r in (
        MEGAPIPE,
        MEGATRON_2021,
        MEGATRON_2022,
        MEGATRON_CORE,
        TORCHTITAN,
        LLM_FOUNDRY,
        MAXTEXT,
    )
}


def bucket_bytes(runtime: Runtime, ranks: int, element: int) -> float:
    """Bytes of one dp bucket of `element`-byte values over `ranks` ranks (0: one buffer)."""
    if runtime.dp_bucket_params:
        return max(runtime.dp_bucket_params, runtime.dp_bucket_params_per_rank * ranks) * element
    return runtime.dp_bucket_mb * 2**20


def weight_cast_bytes(params_dtype: str, compute: int) -> float:
    """Bytes per parameter per forward to cast a weight to the compute dtype (`compute` bytes):
    read the weight, write the copy; none where the weight is already in it."""
    weight = PARAM_BYTES[params_dtype]
    return float(weight + compute) if weight != compute else 0.0


def grad_accum_bytes(params_dtype: str, compute: int, main_grads: str = "float32") -> float:
    """Bytes per parameter per microbatch to add a weight grad (in the compute dtype) into the
    grad kept over the step: float32 weights' .grad takes it cast to float32 first (autograd
    accumulates in the parameter's dtype), then reads both and writes the sum; bf16 weights'
    main grad (float32, or `main_grads`) takes it in place (read it, read and write the main
    grad)."""
    if params_dtype == "float32":
        cast = compute + FLOAT32 if compute != FLOAT32 else 0
        return float(cast + 3 * GRAD_BYTES)
    return float(compute + 2 * PARAM_BYTES[main_grads])


def resolved_for(runtime: Runtime, cfg: Config, cluster: Cluster | None = None) -> Runtime:
    """`runtime` as it runs `cfg` (resolved: its dtypes, and train.compile) on `cluster`'s GPU:
    an "auto" attention kernel becomes the one the code runs there (attention_kernel), and so
    does an unset (None) grouped experts' GEMM."""
    compiled = cfg.train.compile
    linears = compiled_linears(cfg)
    t = cfg.train
    rt = resolved(runtime, t.dtype, t.params_dtype, compiled, linears, t.main_grads_dtype)
    if cluster is not None and rt.attention_kernel == "auto":
        rt = dataclasses.replace(rt, attention_kernel=attention_kernel(cfg, cluster))
    if cluster is not None and rt.moe_grouped_gemm is None:  # the experts' matmul's own rule
        grouped = grouped_mm_for(cluster.device, cluster.capability, cfg.train.dtype)
        grouped = grouped and not experts_fp8(cfg)  # FP8 experts: a loop (parallel/fp8_experts)
        rt = dataclasses.replace(rt, moe_grouped_gemm=grouped)
    return rt


def attention_kernel(cfg: Config, cluster: Cluster) -> str:
    """The fused attention kernel megapipe's code runs for `cfg` on `cluster`'s GPU: the rule
    models/attention.py and the ring's pick_kernel apply to the device they run on
    (kernel_choice.attention_kernel_for), here to the profile's device and compute capability.
    It assumes the default install, without flash-attn: that changes only the document-masked
    kernel, which the profile prices at the flash rate either way."""
    return attention_kernel_for(
        cluster.device, cluster.capability, cfg.train.dtype, documents=cfg.data.document_mask
    )


@functools.lru_cache(maxsize=256)  # a search asks it for every candidate (Runtime is frozen)
def resolved(
    runtime: Runtime,
    dtype: str,
    params_dtype: str = "float32",
    compiled: bool = False,
    linears_compiled: bool = False,
    main_grads: str = "float32",
) -> Runtime:
    """`runtime` as it runs a config of train.dtype `dtype` and train.params_dtype
    `params_dtype` (idempotent). Ours: the weight casts and grad accumulation of the weights'
    and compute dtypes (float32 without autocast also casts no norm output), the optimizer of
    the AdamW kind the code runs plus the bf16 write-back, the gather in the weights' dtype.
    Under train.compile (`compiled`) inductor fuses each layer's norms, residual adds,
    activation, RoPE and head relayouts (fused_elementwise); the norm output's autocast cast
    goes only where the linears are compiled too (`linears_compiled`: models/gpt
    .compiled_linears), else the eager linear still makes it. Others are unchanged."""
    if runtime.name != "megapipe":
        return runtime
    compute = FLOAT32 if dtype == "float32" else 2
    optimizer = ADAMW_BYTES[runtime.adamw] + NORM_CLIP_BYTES
    if params_dtype != "float32":
        optimizer += WRITE_BACK_BYTES
    if params_dtype != "float32" and main_grads != "float32":
        optimizer += WIDEN_BYTES
    return dataclasses.replace(
        runtime,
        weight_cast_bytes=weight_cast_bytes(params_dtype, compute),
        grad_accum_bytes=grad_accum_bytes(params_dtype, compute, main_grads),
        # the dp reduction's grads: bf16 weights' main grads in train.main_grads_dtype
        grad_bytes=PARAM_BYTES[main_grads] if params_dtype != "float32" else GRAD_BYTES,
        autocast_casts=dtype != "float32" and not linears_compiled,
        fused_elementwise=compiled,
        compiled_layers=compiled,
        norm_reruns=not compiled,
        optimizer_bytes=optimizer,
        param_bytes=PARAM_BYTES[params_dtype],
        # the residual stream, summed over tp and sent between stages, in the weights' dtype
        # (config/comm_bytes.residual_width)
        residual_bytes=PARAM_BYTES[params_dtype],
        p2p_bytes=PARAM_BYTES[params_dtype],
    )
