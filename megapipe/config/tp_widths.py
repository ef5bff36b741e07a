"""The bytes an element travels in, and is kept in, at the edges of a tp region (Shoeybi et
al. 2019 §3; SP: Korthikanti et al. 2022 §4.2.2): a column-parallel linear's input as SP's
all-gather (or the tp ring, parallel/tensor/overlap.py) sends it and as the linear keeps it
for backward, and a row-parallel linear's output grad as SP gathers it. One rule for the
comm model (config/comm_bytes.py), the memory model (memory_terms, memory_mla, memory_moe)
and the time model (perf/costs.py), so the three price the same widths the code moves:

  plain SP     cast to the compute dtype before the gather (ColumnParallelLinear._gather_dtype),
               but an FP8 linear's input, gathered in the stream's dtype; grads summed in the
               input's own dtype
  kept         under SP a column linear keeps its input's sequence shard for backward and
               gathers it again there, in the width it was sent in
               (parallel/tensor/sharded_input.py)
  tp ring      cast before it sends, grads summed in the compute dtype; under tensorwise FP8
               the column inputs and the row output grads travel as one-byte payloads, and the
               column linear keeps its own payloads (parallel/fp8_overlap.payloads)
"""

from __future__ import annotations

from collections.abc import Callable

from megapipe.config.flops import is_moe_layer
from megapipe.config.fp8_weights import FP8_BYTES, casts_linear, ring_payloads
from megapipe.config.schema import Config, tp_ring
from megapipe.config.states import compute_bytes

ColumnWidths = Callable[[str], tuple[int, int]]  # a column linear's name -> (sent, summed) bytes


def column_input_widths(cfg: Config, index: int | None, name: str, act: int, residual: int):
    """(sent, summed): bytes an element of a norm's output (the residual stream's, `residual`
    bytes) travels in to the column-parallel linear `name` of layer `index` (None: a main
    layer's) under SP, and bytes its grad is summed in over tp (module docstring; `act` the
    compute dtype's)."""
    if tp_ring(cfg.parallel):
        return (FP8_BYTES if ring_payloads(cfg, index, name) else act), act
    return (residual if casts_linear(cfg, index, name) else act), residual


def casts_before_gather(cfg: Config, index: int | None, name: str) -> bool:
    """Whether the input of the column linear `name` is cast (to the compute dtype, or to FP8
    payloads) on the rank's own tokens before SP gathers it, rather than after."""
    return tp_ring(cfg.parallel) or not casts_linear(cfg, index, name)


def column_input_bytes(cfg: Config, index: int | None, name: str) -> int:
    """Bytes an element of the input the column linear `name` keeps for backward: the compute
    dtype's, one under the tp ring's FP8 payloads (fp8_weights.ring_payloads)."""
    return FP8_BYTES if ring_payloads(cfg, index, name) else compute_bytes(cfg)


def keeps_shard(cfg: Config) -> bool:
    """Whether a column linear keeps only its input's sequence shard for backward and gathers
    it again there (parallel/tensor/sharded_input.py; on the tp ring, overlap.py and
    fp8_overlap.py alike): under SP."""
    p = cfg.parallel
    return p.sequence_parallel and p.tp > 1


def kept_rows(cfg: Config, x) -> int:
    """Rows of a column linear's input kept for backward (`x` a RankDims): the rank's
    sequence shard Nₛ (keeps_shard), else all N it multiplies (N = Nₛ without SP)."""
    return x.ns if keeps_shard(cfg) else x.n


def regathered(
    cfg: Config, index: int | None, act: int, ring: bool | None = None
) -> tuple[int, int]:
    """Bytes per token layer `index`'s backward gathers again over tp (keeps_shard): attention's
    column linears' inputs (qkv's, or latent attention's q_b and kv_b) and the MLP's (fc1's,
    or the shared experts'; a MoE layer without them: none), each in the width it was kept
    in: `act` bytes (the compute dtype's), one as the tp ring's FP8 payloads. `ring`: whether
    the tp ring runs (default: the config's parallel.tp_overlap; a runtime without one
    gathers plainly, Megatron-LM's SP linear too)."""
    if not keeps_shard(cfg):
        return 0, 0
    m = cfg.model
    ring = tp_ring(cfg.parallel) if ring is None else ring
    moe = index is not None and is_moe_layer(m, index)

    def width(name: str) -> int:
        return FP8_BYTES if ring and ring_payloads(cfg, index, name) else act

    att = sum(k * width(n) for n, k in attention_columns(m).items())
    column = not moe or m.moe_shared_experts > 0  # routed experts are whole on every tp rank
    return att, m.d_model * width(mlp_column(moe)) if column else 0


def row_grad_width(cfg: Config, index: int | None, name: str, act: int) -> int:
    """Bytes an element of the row-parallel linear `name`'s output grad is gathered in under
    SP: the compute dtype's, one where the tp ring moves it as FP8 payloads
    (fp8_weights.ring_payloads)."""
    return FP8_BYTES if ring_payloads(cfg, index, name) else act


def mlp_column(moe: bool) -> str:
    """The name of the column linear an MLP's input enters: fc1, or in a MoE layer its
    shared experts' (fp8_weights._layer_named)."""
    return "mlp.shared.fc1" if moe else "mlp.fc1"


def mlp_row(moe: bool) -> str:
    """The name of the row linear an MLP's output leaves: fc2, or its shared experts'."""
    return "mlp.shared.fc2" if moe else "mlp.fc2"


def attention_column_inputs(m, widths: ColumnWidths, act: int) -> tuple[tuple[int, int], ...]:
    """(sent, summed) bytes per token of each input that enters attention's column region:
    a norm's output as `widths` gives it for the linear it enters (column_input_widths), a
    projection's in the compute dtype's `act` bytes both ways. The norm's output (d_model)
    enters qkv, or under latent attention (models/mla.py) the query latent after its norm
    (or norm1's output, d_model, without a query LoRA) enters q_b, the normed kv latent
    kv_b, and the shared rope key (a projection's output) is gathered on its own, each made
    on the rank's own tokens by the down projections whole on every tp rank."""
    inputs = tuple(scaled(k, widths(name)) for name, k in attention_columns(m).items())
    if m.arch != "deepseek_v3":
        return inputs
    rope = m.qk_rope_head_dim * act
    return (*inputs, (rope, rope))


def attention_columns(m) -> dict[str, int]:
    """Attention's column linears by name, each with its input's elements per token: qkv on
    the norm's output (d_model), or under latent attention (models/mla.py) q_b on the query
    latent (d_model without a query LoRA) and kv_b on the kv latent."""
    if m.arch != "deepseek_v3":
        return {"attn.qkv": m.d_model}
    return {"attn.q_b": m.q_lora_rank or m.d_model, "attn.kv_b": m.kv_lora_rank}


def scaled(k: int, pair: tuple[int, int]) -> tuple[int, int]:
    """A (sent, summed) pair of bytes times `k` (elements, or tokens)."""
    return k * pair[0], k * pair[1]
