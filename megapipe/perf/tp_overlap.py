"""Sequence parallelism's collectives overlapped with the linears' GEMMs, as Transformer
Engine's userbuffers run them under Megatron-Core's --tp-comm-overlap (Wang et al., ASPLOS 2023,
"Overlap communication with dependent computation via decomposition"), priced per layer for
perf/costs.py. TE's default layout (transformer_engine/pytorch/module/base.py, initialize_ub):

  ring_exchange  the all-gathers before qkv and fc1 (forward) and before fc2's and proj's dgrad
                 (backward): tp steps, each GEMM chunk beside the next chunk's transfer on the
                 copy engines; exposed: what of the transfer outlasts the GEMM's other chunks
  pipeline       the reduce-scatters after proj and fc2 (forward): the GEMM in `splits` (4)
                 chunks, each chunk's reduce-scatter beside the next chunk's GEMM; exposed: the
                 last chunk's, or what outlasts the GEMM
  bulk           the reduce-scatters of fc1's and qkv's input grads (backward) beside their
                 wgrad GEMMs, whole
  SM margin      pipeline and bulk keep `num_sm` (16) SMs for the communication kernels
                 (set_sm_margin): the GEMMs beside them run on the rest, slower by that share

A runtime without a layout of its own (split count 0, no SM margin: torch's async TP) is priced
with the same pairs, tp chunks each.

Megatron-LM's asynchronous tensor-parallel communication (from 2021-09, default on; NVIDIA/
Megatron-LM merge request !316, commit 6e1bde1e, megatron/mpu/layers.py
ColumnParallelLinearWithAsyncAllreduce, in 2022 LinearWithGradAccumulationAndAsyncCommunication)
is priced by `async_backward`: no decomposition, whole collectives beside whole GEMMs.
"""

from __future__ import annotations


def exposed_tp(tp: int, ag: float, rs: float, fprop: list[float], dgrad: list[float],
            wgrad: list[float], splits: int, mlp: bool = True,
            ag_grad: float | None = None) -> tuple[float, float]:  # fmt: skip
    """Exposed seconds of one layer's forward and backward collectives (one all-gather `ag` of
    a column linear's input, `ag_grad` of a row linear's output grad, default `ag`; one
    reduce-scatter `rs`); fprop, dgrad, wgrad: the qkv, proj, fc1, fc2 GEMMs' seconds; `mlp`
    False: attention's alone (a MoE layer whose routed experts are whole on each rank)."""
    qkv, proj, fc1, fc2 = range(4)
    s = splits or tp
    ag_grad = ag if ag_grad is None else ag_grad
    if not mlp:
        forward = max(0.0, ag - fprop[qkv] * (tp - 1) / tp)
        forward += max(rs / s, rs - fprop[proj] * (s - 1) / s)
        back = max(0.0, ag_grad - dgrad[proj] * (tp - 1) / tp)
        return forward, back + max(0.0, rs - wgrad[qkv])

    def ring(gemm: float, gathered: float = ag) -> float:
        return max(0.0, gathered - gemm * (tp - 1) / tp)

    def pipeline(gemm: float) -> float:
        return max(rs / s, rs - gemm * (s - 1) / s)

    forward = ring(fprop[qkv]) + pipeline(fprop[proj]) + ring(fprop[fc1]) + pipeline(fprop[fc2])
    backward = (
        ring(dgrad[fc2], ag_grad)
        + max(0.0, rs - wgrad[fc1])  # bulk: fc1's input grad beside its wgrad
        + ring(dgrad[proj], ag_grad)
        + max(0.0, rs - wgrad[qkv])
    )
    return forward, backward


def sm_margin(share: float, fprop: list[float], wgrad: list[float]) -> tuple[float, float]:
    """Seconds the forward and the wgrads add when `share` of the SMs stay with the pipelined
    (proj, fc2 forward) and bulk (qkv, fc1 wgrad) collectives."""
    if share <= 0:
        return 0.0, 0.0
    slow = share / (1.0 - share)
    return slow * (fprop[1] + fprop[3]), slow * (wgrad[0] + wgrad[2])


def async_backward(sp: bool, ar: float, ag: float, rs: float, dgrad: list[float],
                   wgrad: list[float], mlp: bool = True) -> float:  # fmt: skip
    """Exposed seconds of one layer's backward tp collectives under Megatron-LM's asynchronous
    tp communication (module docstring): each column-parallel linear's (qkv, fc1) input grad is
    all-reduced (`ar`), or reduce-scattered under SP (`rs`), launched before its wgrad GEMM and
    waited for after it; under SP that linear's input, saved as its sequence shard, is
    all-gathered again (`ag`) beside its dgrad GEMM. The row-parallel linears' (proj, fc2)
    backward stays blocking: nothing without SP, the grad's all-gather with SP. The SMs NCCL
    takes from the GEMMs beside it are not priced. `mlp` False: attention's alone."""
    column = (0, 2) if mlp else (0,)  # qkv, fc1
    if not sp:
        return sum(max(0.0, ar - wgrad[i]) for i in column)
    return len(column) * ag + sum(max(0.0, ag - dgrad[i]) + max(0.0, rs - wgrad[i]) for i in column)
