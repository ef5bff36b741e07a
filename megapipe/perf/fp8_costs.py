"""What `train.fp8` (parallel/fp8.py) changes in a layer's price: its linears' GEMMs at the
profile's FP8 rate with 1-byte operands, plus the casts that feed them.

tensorwise and rowwise run torch._scaled_mm: priced as GEMMs on a `Device` whose peak is the
profile's `fp8_tflops` (H100 and H200: 1979 dense, twice bf16), with the same calibrated
efficiency curve. blockwise is emulated in the code (cast per block, dequantize, matmul in the
compute dtype), so its GEMMs keep the compute dtype's price. A GPU without FP8 tensor cores
(`fp8_tflops` 0 on a CUDA profile: the A100, where torch has no _scaled_mm kernel) refuses an
FP8 projection in one line rather than price a run that cannot start; the CPU profiles price
FP8 at their compute rate (torch's CPU kernel upcasts).

The casts are memory-bound passes: each GEMM's two operands are read for their amax, read
again and written as 1-byte values. The amax all-reduces over tp and cp (config/fp8_amax.py:
a few bytes per scale, up to one float32 per token under rowwise) are latency-bound rings,
priced one by one on their axis's link, forward's in F and the backward's in B. The MoE
layer's GEMMs are FP8 but for the router's (float32): attention's, the shared experts' and,
unless train.fp8_keep_bf16 keeps them, the routed experts', which megapipe's code runs as a
loop of per-expert FP8 matmuls (parallel/fp8_experts.py: no grouped FP8 kernel), so its
runtime prices them ungrouped (perf/software.resolved_for). The head stays in high precision.
"""

from __future__ import annotations

from collections.abc import Callable

from megapipe.config import Config
from megapipe.config.flops import is_moe_layer
from megapipe.config.fp8_amax import layer_amax_ops
from megapipe.config.fp8_weights import experts_fp8
from megapipe.perf.cluster import Cluster, ClusterError
from megapipe.perf.cost_terms import Device

KERNEL_RECIPES = ("tensorwise", "rowwise")  # torch._scaled_mm; blockwise is emulated


def fp8_device(cfg: Config, cluster: Cluster, dev: Device) -> tuple[Device, int] | None:
    """(the Device, the operand bytes) the linears' GEMMs are priced on; None: not FP8."""
    recipe = cfg.train.fp8
    if recipe == "none":
        return None
    if cluster.device == "cuda" and cluster.fp8_tflops <= 0:
        raise ClusterError(
            f"{cluster.name} has no FP8 tensor cores (fp8_tflops unset): project it with "
            "--train.fp8=none"
        )
    if recipe not in KERNEL_RECIPES or cluster.fp8_tflops <= 0:
        return dev, 0  # emulated, or a CPU: the compute dtype's GEMMs (0: the caller's bytes)
    return Device(cluster.fp8_tflops * 1e12, dev.bandwidth, dev.cal), 1


def fp8_gemms(cfg: Config, count: int, moe: bool) -> list[bool]:
    """Which of a layer's `count` GEMMs (perf/costs.gemm_shapes' order) run in FP8: a dense
    layer's four linears; a MoE layer's all but the router (2), the routed experts (3, 4) only
    where train.fp8 casts them (module docstring)."""
    if not moe:
        return [i < 4 for i in range(count)]
    experts = experts_fp8(cfg)
    return [i != 2 and (experts or i not in (3, 4)) for i in range(count)]


def cast_bytes(m: float, n: float, k: float, c: int) -> tuple[float, float, float]:
    """HBM bytes of the casts before a linear's forward, input-grad and weight-grad GEMMs
    ((m×k)·(k×n), `c`-byte high-precision operands): amax read, cast read, 1-byte write."""
    per = 2 * c + 1
    return (m * k + n * k) * per, (m * n + n * k) * per, (m * n + m * k) * per


def amax_seconds(
    cfg: Config, moe: bool, price: dict[str, Callable[[float], float]]
) -> tuple[dict[str, float], dict[str, float]]:
    """(F, B) seconds per axis of a layer's amax all-reduces, the first dense (or MoE, `moe`)
    layer's, each op priced by `price[axis]` (an all-reduce of that many bytes on the axis)."""
    m, f_s, b_s = cfg.model, dict.fromkeys(price, 0.0), dict.fromkeys(price, 0.0)
    block = next((b for b in range(1, m.n_layers + 1) if is_moe_layer(m, b - 1) == moe), None)
    if block is None:
        return f_s, b_s
    f, b = layer_amax_ops(cfg, block)
    for ops, out in ((f, f_s), (b, b_s)):
        for axis, nbytes in ops:
            out[axis] += price[axis](nbytes)
    return f_s, b_s
