"""What `train.fp8` (parallel/fp8.py) changes in a layer's price: its linears' GEMMs at the
profile's FP8 rate with 1-byte operands, plus the casts that feed them.

tensorwise and rowwise run torch._scaled_mm: priced as GEMMs on a `Device` whose peak is the
profile's `fp8_tflops` (H100 and H200: 1979 dense, twice bf16), with the same calibrated
efficiency curve. blockwise is emulated in the code (cast per block, dequantize, matmul in the
compute dtype), so its GEMMs keep the compute dtype's price. A GPU without FP8 tensor cores
(`fp8_tflops` 0 on a CUDA profile: the A100, where torch has no _scaled_mm kernel) refuses an
FP8 projection in one line rather than price a run that cannot start; the CPU profiles price
FP8 at their compute rate (torch's CPU kernel upcasts).

The casts are memory-bound passes, priced as the runtime scales (runtime.fp8_scaling):
- "current" (megapipe's, parallel/fp8.py: just-in-time scaling): each GEMM's two operands are
  read for their amax, read again and written as 1-byte values, every microbatch; the weights
  once a step (parallel/fp8_weight_cache.py: W's cast, and under rowwise Wᵀ's, kept over the
  step's microbatches; one tensor scale or 128 x 128 blocks read W's cast transposed, which
  the input grad's GEMM copies into its layout each microbatch: read 1, write 1), at every
  use only under pipedream_async (its weights change between microbatches). The amax
  all-reduces over tp and cp (config/fp8_amax.py: a few bytes per scale, up to one float32
  per token under rowwise) are latency-bound rings, priced one by one on their axis's link,
  forward's in F and the backward's in B, the weights' once a step (a microbatch's share).
- "delayed" (Transformer Engine's DelayedScaling, which Megatron-Core's published FP8 runs use:
  a scale from the amax history of earlier steps). The cast kernel records the amax as it
  writes, so there is no amax pass; it writes both layouts Hopper's FP8 GEMMs take (TE's
  cast_transpose: read c bytes, write 1 + 1). The inputs of the linears TE fuses with their
  norm (LayerNormLinear: QKV and the MLP's first linear) leave the norm already cast, and only
  their transposed copy is made (read 1, write 1). A weight is cast with its transpose on a
  step's first microbatch and the others reuse it (TE's `is_first_microbatch` cache). Every
  amax of a model chunk is reduced in one all-reduce as its forward and its backward end
  (TE's `reduce_and_update_fp8_tensors`), priced per layer as that op's share. The MoE
layer's GEMMs are FP8 but for the router's (float32): attention's, the shared experts' and,
unless train.fp8_keep_bf16 keeps them, the routed experts', which megapipe's code runs as a
loop of per-expert FP8 matmuls (parallel/fp8_experts.py: no grouped FP8 kernel), so its
runtime prices them ungrouped (perf/software.resolved_for). The head stays in high precision.
"""

from __future__ import annotations

from collections.abc import Callable

from megapipe.config import Config
from megapipe.config.flops import is_moe_layer
from megapipe.config.fp8_amax import layer_amax_ops, layer_step_amax_ops
from megapipe.config.fp8_weights import experts_fp8, weight_casts
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


SCALINGS = ("current", "delayed")  # runtime.fp8_scaling (module docstring)


def weight_cast_terms(cfg: Config, scaling: str) -> tuple[int, bool]:
    """(the microbatches a weight's cast serves, whether Wᵀ is cast apart from W) under
    `scaling` (module docstring): a step's, and apart under rowwise; where megapipe's runtime
    casts at every use (pipedream_async), 1 and apart."""
    if scaling == "current" and weight_casts(cfg) == "use":
        return 1, True
    return cfg.parallel.microbatches, cfg.train.fp8 == "rowwise"


def after_norm(gemm: int, moe: bool) -> bool:
    """Whether a layer's GEMM (perf/costs.gemm_shapes' order) reads its norm's output: QKV, and
    a dense layer's first MLP linear (a MoE layer's experts read routed rows)."""
    return gemm == 0 or (gemm == 2 and not moe)


def cast_bytes(
    m: float, n: float, k: float, c: int, scaling: str = "current", norm_input: bool = False,
    microbatches: int = 1, own_transpose: bool = False,
) -> tuple[float, float, float]:  # fmt: skip
    """HBM bytes of the casts before a linear's forward, input-grad and weight-grad GEMMs
    ((m×k)·(k×n), `c`-byte high-precision operands) as `scaling` casts (module docstring):
    `norm_input` a linear whose input TE casts in the norm, `microbatches` per step over which
    a weight's cast is kept (1: cast at every use), `own_transpose` Wᵀ cast apart (rowwise)."""
    if scaling == "current":  # amax read, cast read, 1-byte write, per operand per GEMM
        per = 2 * c + 1
        weight = n * k * per / microbatches
        weight_t = weight if own_transpose else n * k * 2  # or W's cast copied transposed
        return m * k * per + weight, m * n * per + weight_t, (m * n + m * k) * per
    both_layouts = c + 2  # cast_transpose: read c, write 1 + 1
    x = m * k * (2 if norm_input else both_layouts)
    weight = n * k * both_layouts / microbatches
    return x + weight, m * n * both_layouts, 0.0


def amax_seconds(
    cfg: Config, moe: bool, price: dict[str, Callable[[float], float]], scaling: str = "current"
) -> tuple[dict[str, float], dict[str, float]]:
    """(F, B) seconds per axis of a layer's amax all-reduces, the first dense (or MoE, `moe`)
    layer's, each op priced by `price[axis]` (an all-reduce of that many bytes on the axis);
    under "delayed" scaling the layer's share of its chunk's one batched op per axis."""
    m, f_s, b_s = cfg.model, dict.fromkeys(price, 0.0), dict.fromkeys(price, 0.0)
    block = next((b for b in range(1, m.n_layers + 1) if is_moe_layer(m, b - 1) == moe), None)
    if block is None:
        return f_s, b_s
    if scaling == "delayed":  # TE's amax buffer: the weights' amaxes every microbatch
        f, b = layer_amax_ops(cfg, block, every_use=cfg.parallel.zero != 3)
        return _batched(cfg, f, price), _batched(cfg, b, price)
    f, b = layer_amax_ops(cfg, block)
    step_f, step_b = layer_step_amax_ops(cfg, block)  # once a step: a microbatch's share
    share = 1 / cfg.parallel.microbatches
    for ops, step, out in ((f, step_f, f_s), (b, step_b, b_s)):
        for axis, nbytes in ops:
            out[axis] += price[axis](nbytes)
        for axis, nbytes in step:
            out[axis] += price[axis](nbytes) * share
    return f_s, b_s


def _batched(cfg: Config, ops: list, price: dict) -> dict[str, float]:
    """A layer's share of one all-reduce per axis holding its chunk's amaxes (`ops` a layer's)."""
    p = cfg.parallel
    layers = max(1, cfg.model.n_layers // (p.pp * p.vpp))  # a model chunk's
    out = dict.fromkeys(price, 0.0)
    for axis in {axis for axis, _ in ops}:
        nbytes = layers * sum(n for a, n in ops if a == axis)
        out[axis] = price[axis](nbytes) / layers
    return out
