"""The amax all-reduces of train.fp8's linears in one microbatch, per mesh axis: the one source of
their count and size, which config/comm_bytes.py sums and perf/fp8_costs.py prices.

parallel/fp8.py's `Fp8Linear` casts six operands (each (R, C) with the contraction along C):
forward x (tokens, in) and W (out, in); backward g (tokens, out), Wᵀ (in, out), and for the
weight grad gᵀ (out, tokens) and xᵀ (in, tokens). parallel/fp8_scaling.py `amax_of` all-reduces
(MAX) a float32 amax over each group that splits the elements a scale covers, one op per group:
- tensorwise, one scale: over every group splitting R or C, 4 bytes each;
- rowwise, a scale per row: over the groups splitting C, R entries;
- blockwise (1 x 128 tiles, 128 x 128 blocks): each rank holds whole ones, no op.
The groups: cp splits the tokens; tp the output features of a column linear, the input ones of a
row linear, and under sequence parallelism the tokens of a linear whole on every tp rank
(latent attention's down projections, models/mla.py), which reads each rank's sequence chunk,
and under parallel.tp_overlap those of the operands the tp ring gathers piece by piece (the
column linear's x, the row linear's g: parallel/fp8_overlap.py).
MTP's depths (models/mtp.py) run on the head's block: each its projection (whole on every tp
rank, as a down projection) and its block, as layer n_layers + k − 1 (`block_amax_ops`).
W and Wᵀ are not cast every microbatch (fp8_weights.weight_casts): the linears keep their
weight casts over a step (parallel/fp8_weight_cache.py), W's amaxes all-reduced once a step in
the first forward and, rowwise, Wᵀ's in the first backward (`weight_step_ops`); under zero=3
the weights arrive cast (parallel/data/zero3_fp8.py), their amaxes the once-a-step
`fp8_weights.amax_entries`; only pipedream_async, whose weights change between microbatches,
casts them at every use.

The routed experts (parallel/fp8_experts.py) cast per (expert, source) part, E parts on a rank
(E/ep experts x ep sources), and `quantize_parts` all-reduces every part's amax of one operand
in one op per group: per stacked matmul (w_in, w_out) x and g split over the token groups (cp,
tp under SP; tensorwise only, rowwise's per-token rows are whole), gᵀ and xᵀ over them as their
contraction (tensorwise 4 bytes, rowwise a feature's row each, per part). Their weights are
whole on the rank and need no op. The shared experts are dense tp linears, counted above.
"""

from __future__ import annotations

from megapipe.config.flops import expert_ffn
from megapipe.config.fp8_weights import (
    SCALE_BYTES,
    Fp8Weight,
    block_fp8_weights,
    dense_mlp_fp8_weights,
    experts_cast,
    layer_fp8_weights,
    mtp_projection,
    weight_casts,
)
from megapipe.config.memory_terms import rank_dims
from megapipe.config.schema import Config, gated, layer_mode, reruns_mlp, tp_ring

AxisOp = tuple[str, float]  # (mesh axis, bytes) of one MAX all-reduce


def _operand_ops(granularity: str, rows: int, row_axes: tuple, col_axes: tuple) -> list[AxisOp]:
    """One operand's all-reduces: (R, C) = (`rows`, ·), R split over `row_axes`, C over
    `col_axes` (module docstring)."""
    if granularity == "tensorwise":
        return [(axis, SCALE_BYTES) for axis in row_axes + col_axes]
    if granularity == "rowwise":
        return [(axis, rows * SCALE_BYTES) for axis in col_axes]
    return []


def _granularity(cfg: Config) -> str:
    """The scales that share an amax (tensorwise, rowwise); '' where none does."""
    return {"tensorwise": "tensorwise", "rowwise": "rowwise"}.get(cfg.train.fp8, "")


def _axes(cfg: Config, w: Fp8Weight) -> tuple[tuple, tuple, tuple]:
    """(tokens, outs, ins): the axes splitting a linear's tokens, output and input features."""
    p = cfg.parallel
    tp = ("tp",) if p.tp > 1 else ()
    t = ("cp",) if p.cp > 1 else ()
    t += tp if w.splits == "none" and p.sequence_parallel else ()
    return t, (tp if w.splits == "out" else ()), (tp if w.splits == "in" else ())


def _ring_pieces(cfg: Config) -> tuple:
    """("tp",) where parallel.tp_overlap's ring gathers the column linears' input and the row
    linears' output grad piece by piece (parallel/fp8_overlap.py): those operands' tokens are
    split over tp when cast, else ()."""
    return ("tp",) if tp_ring(cfg.parallel) else ()


def linear_amax_ops(
    cfg: Config, w: Fp8Weight, tokens: int, every_use: bool | None = None
) -> tuple[list, list]:
    """(F, B) all-reduces of one FP8 linear over `tokens` rows in a microbatch (module
    docstring): W's and Wᵀ's only where each use casts them (weight_step_ops); `every_use`
    True counts them all the same (Transformer Engine's amax buffer holds the weights' too:
    perf/fp8_costs.py's delayed scaling)."""
    granularity = _granularity(cfg)
    t, o, i = _axes(cfg, w)
    ring = _ring_pieces(cfg)  # the operand a tp ring gathers: its pieces share a tensor scale
    f = _operand_ops(granularity, tokens, t + (ring if w.splits == "out" else ()), i)
    b = _operand_ops(granularity, tokens, t + (ring if w.splits == "in" else ()), o)
    if weight_casts(cfg) == "use" if every_use is None else every_use:
        f += _operand_ops(granularity, w.rows, o, i)
        b += _operand_ops(granularity, w.cols, i, o)
    b += _operand_ops(granularity, w.rows, o, t) + _operand_ops(granularity, w.cols, i, t)
    return f, b


def weight_step_ops(cfg: Config, w: Fp8Weight) -> tuple[list, list]:
    """(F, B) all-reduces of one FP8 linear's weight casts kept over a step (parallel/
    fp8_weight_cache.py), once a step: W's in the first forward, and under rowwise Wᵀ's in
    the first backward (one tensor scale reads W's transposed); ([], []) where the weights
    are cast otherwise (fp8_weights.weight_casts)."""
    if weight_casts(cfg) != "step":
        return [], []
    granularity = _granularity(cfg)
    _, o, i = _axes(cfg, w)
    f = _operand_ops(granularity, w.rows, o, i)
    b = _operand_ops(granularity, w.cols, i, o) if granularity == "rowwise" else []
    return f, b


def step_amax_bytes(cfg: Config, blocks, axis: str) -> float:
    """Bytes the rank holding the pipeline's `blocks` puts into `axis`'s all-reduces of the
    weight casts kept over a step, once a step (weight_step_ops)."""
    ops = [weight_step_ops(cfg, w) for b in blocks for w in block_fp8_weights(cfg, b)]
    return sum(n for f, b in ops for a, n in f + b if a == axis)


def layer_step_amax_ops(cfg: Config, block: int) -> tuple[list[AxisOp], list[AxisOp]]:
    """(F, B) once-a-step all-reduces of layer `block` − 1's weight casts (weight_step_ops)."""
    f, b = [], []
    for w in layer_fp8_weights(cfg, block):
        wf, wb = weight_step_ops(cfg, w)
        f, b = f + wf, b + wb
    return f, b


def experts_amax_ops(cfg: Config, block: int) -> tuple[list[AxisOp], list[AxisOp]]:
    """(F, B) all-reduces of `block`'s routed experts' FP8 matmuls in one microbatch (module
    docstring); ([], []) where train.fp8 leaves them in high precision."""
    if not experts_cast(cfg, block):
        return [], []
    m, p, granularity = cfg.model, cfg.parallel, _granularity(cfg)
    tokens = ("cp",) * (p.cp > 1) + ("tp",) * (p.tp > 1 and p.sequence_parallel)
    ffn = expert_ffn(m, cfg.derived.d_ff)
    f, b = [], []
    for out, ins in ((ffn * (2 if gated(m.arch) else 1), m.d_model), (m.d_model, ffn)):
        f += _operand_ops(granularity, 1, tokens, ())  # x, a part's rows at a time
        b += _operand_ops(granularity, 1, tokens, ())  # g
        b += _operand_ops(granularity, out, (), tokens) + _operand_ops(granularity, ins, (), tokens)
    parts = m.n_experts  # every part's amaxes in one op
    return [(a, n * parts) for a, n in f], [(a, n * parts) for a, n in b]


def layer_amax_ops(
    cfg: Config, block: int, every_use: bool | None = None
) -> tuple[list[AxisOp], list[AxisOp]]:
    """(F, B) all-reduces of layer `block` − 1's FP8 linears and routed experts in one
    microbatch ([], [] where it has none; past n_layers an MTP depth's block,
    fp8_weights.layer_fp8_weights); `every_use`: linear_amax_ops'."""
    f, b = experts_amax_ops(cfg, block)
    lf, lb = _linears_ops(cfg, layer_fp8_weights(cfg, block), every_use)
    return f + lf, b + lb


def _linears_ops(
    cfg: Config, weights: list[Fp8Weight], every_use: bool | None = None
) -> tuple[list[AxisOp], list[AxisOp]]:
    """(F, B) all-reduces of FP8 linears `weights` over a microbatch's tokens (a linear whole
    on every tp rank reads the rank's own: its sequence chunk under SP)."""
    x, f, b = rank_dims(cfg), [], []
    for w in weights:
        lf, lb = linear_amax_ops(cfg, w, x.ns if w.splits == "none" else x.n, every_use)
        f, b = f + lf, b + lb
    return f, b


def block_amax_ops(cfg: Config, block: int) -> list[tuple[list, list, bool]]:
    """(F, B, F again in B) of what the pipeline's `block` runs in FP8: a layer's (again under
    full recompute); on the head's block each MTP depth's projection and its block (models/
    mtp.py; its block recomputed as layer n_layers + k − 1 is)."""
    m = cfg.model
    if not 1 <= block <= m.n_layers + 1:
        return []
    layers = [block] if block <= m.n_layers else []
    out = []
    for k in range(1, m.mtp_layers + 1) if block == m.n_layers + 1 else ():
        out.append((*_linears_ops(cfg, mtp_projection(cfg, k)), False))
        layers.append(m.n_layers + k)
    for layer in layers:
        again = layer_mode(cfg.recompute, layer - 1) == "full"
        out.append((*layer_amax_ops(cfg, layer), again))
        if reruns_mlp(cfg.recompute, layer - 1):  # the MLP checkpoint's rerun: fc1's, fc2's F
            out.append((_linears_ops(cfg, dense_mlp_fp8_weights(cfg, layer))[0], [], False))
    return out


def amax_bytes(cfg: Config, blocks, axis: str) -> float:
    """Bytes the rank holding the pipeline's `blocks` puts into `axis`'s amax all-reduces in
    one microbatch (F twice in a full-recompute layer)."""
    total = 0.0
    for block in blocks:
        for f, b, again in block_amax_ops(cfg, block):
            total += sum(n for a, n in f * (2 if again else 1) + b if a == axis)
    return total
