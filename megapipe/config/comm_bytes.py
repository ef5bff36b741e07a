"""Bytes each collective and point-to-point transfer of a training step carries, per rank and per
mesh axis: the one source of those sizes. The performance model prices its times from these
lists (perf/costs.py for tp, perf/data_parallel.py for the grad reduction, perf/model.py for
the pipeline's messages); `rank_comm_bytes` sums them for one rank, which `train.py
--fake-ranks` sets beside the bytes the code's collectives carried (train/fake_ranks.py).

Convention, for the planned and the measured bytes alike: what this rank puts into each op,
the tensor it hands the collective.
- all-reduce: the whole tensor S (ring_time's S);
- reduce-scatter: its whole input S, of which it keeps S/n;
- all-gather: its shard, S/n of the gathered S;
- all-to-all: its whole buffer, its own share included;
- point-to-point: what it sends; a receive puts in nothing (its sender counts the bytes).
Per step: every microbatch's, the reductions once. Sizes are those megapipe's code moves (its
runtime: pipeline messages in the residual stream's dtype, which is the weights', float32
grads, the dp reduction's in parallel.grad_reduce_dtype, weights gathered in
train.params_dtype), or the widths a caller passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from megapipe.config.flops import held_expert_params, is_moe_layer, moe_layers_in
from megapipe.config.fp8_amax import amax_bytes, step_amax_bytes
from megapipe.config.fp8_weights import (
    FP8_BYTES,
    SCALE_BYTES,
    amax_entries,
    fp8_params,
    weight_casts,
    weight_granularity,
)
from megapipe.config.memory_terms import rank_dims
from megapipe.config.pipeline_split import placement_of, rank_blocks, schedule_of
from megapipe.config.schema import Config, layer_mode, reruns_mlp, tp_ring
from megapipe.config.states import (
    FLOAT32,
    GRAD_BYTES,
    PARAM_BYTES,
    expert_replicas,
    main_grad_bytes,
    reduces_per_microbatch,
    replicas,
    shard_copies,
    state_layout,
)
from megapipe.config.tp_widths import (
    attention_column_inputs,
    column_input_widths,
    mlp_column,
    mlp_row,
    regathered,
    row_grad_width,
    scaled,
)
from megapipe.plan.actions import FORWARD

AXES = ("dp", "tp", "pp", "cp", "ep")
Op = tuple[str, float]  # (kind, S): all_reduce, reduce_scatter, all_gather, all_to_all, send
LOSS_BYTES = 8  # the step's summed loss, float64, all-reduced over dp × cp and over pp
NORM_BYTES = 4  # the squared grad norm, float32 (train/optim.global_grad_norm)


def put_in(kind: str, nbytes: float, n: int) -> float:
    """Bytes a rank puts into one op `kind` of S = `nbytes` over `n` ranks (module docstring);
    0 where n is 1 (no op runs)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return nbytes / n if kind == "all_gather" else float(nbytes)


def tp_layer_ops(
    sequence_parallel: bool,
    row_out: float,
    attention_inputs: tuple[tuple[float, float], ...],
    mlp_input: tuple[float, float] | None = None,
    row_grads: tuple[float, float] | None = None,
) -> tuple[list, list]:
    """(F, B) of a transformer layer's tp collectives (Shoeybi et al. 2019 §3; SP: Korthikanti
    et al. 2022 §4.2.2). Each input entering a column region is (sent, summed): the bytes SP
    gathers of it in F and those its grad is summed in over tp in B (column_input_widths;
    attention's are attention_column_inputs, the MLP's `mlp_input`, None in a MoE layer
    without shared experts: its routed experts are whole on every tp rank, models/moe.py);
    `row_out`: a row-parallel matmul's N·d output in the compute dtype, summed before the
    bias and the residual add, its grad gathered under SP in the same (`row_grads`: the
    bytes of attention's and the MLP's output grad gathers where they differ,
    row_grad_width). F sums attention's and the MLP's partial outputs (SP: gathers each
    region's inputs, reduce-scatters the sums), B sums the regions' input grads (SP: gathers
    the output grads, reduce-scatters the input grads; the kept input shards gathered again,
    tp_widths.regathered, are the caller's)."""
    regions = [attention_inputs] + ([(mlp_input,)] if mlp_input else [])
    grads = row_grads or (row_out, row_out)
    f, b = [], []
    for inputs, grad in zip(regions, grads, strict=False):
        if sequence_parallel:
            f += [*(("all_gather", sent) for sent, _ in inputs), ("reduce_scatter", row_out)]
            b += [("all_gather", grad), *(("reduce_scatter", summed) for _, summed in inputs)]
        else:
            f.append(("all_reduce", row_out))
            b += [("all_reduce", summed) for _, summed in inputs]
    return f, b


def tp_embedding_ops(sequence_parallel: bool, out: float) -> tuple[list[Op], list[Op]]:
    """(F, B) of the vocab-parallel embedding, `out` its N·d output bytes: F sums the partial
    lookups (SP: reduce-scatters them), B under SP all-gathers the grad."""
    if sequence_parallel:
        return [("reduce_scatter", out)], [("all_gather", out)]
    return [("all_reduce", out)], []


def tp_head_ops(sequence_parallel: bool, n: int, act: float) -> tuple[list[Op], list[Op]]:
    """(F, B) of the vocab-parallel head and cross entropy over `n` tokens, `act` the N·d input
    bytes (the residual stream's dtype): F three all-reduces of N float32 (the row max, by
    chunks, the sum of exp and the target logit; parallel/tensor/cross_entropy.py), under SP
    the input's all-gather; B the input grad's all-reduce (SP: reduce-scatter)."""
    f = [("all_reduce", n * FLOAT32)] * 3
    if sequence_parallel:
        return [*f, ("all_gather", act)], [("reduce_scatter", act)]
    return f, [("all_reduce", act)]


def reduce_width(cfg: Config, grad_bytes: int) -> int:
    """Bytes per element of the dp × cp grad reduction (and HSDP's replica all-reduce) of
    `grad_bytes`-byte grads: 2 under parallel.grad_reduce_dtype=bfloat16 (zero >= 1: the
    reduce-scatter sends and sums in it, parallel/data/zero.py `ShardedGradReducer`)."""
    return min(grad_bytes, 2) if cfg.parallel.grad_reduce_dtype == "bfloat16" else grad_bytes


def grad_reduction_kind(zero: int, n: int) -> str:
    """The dp × cp grad reduction: reduce-scatter from zero=1 on (Rajbhandari et al. 2020 §5),
    else all-reduce."""
    return "reduce_scatter" if zero and n > 1 else "all_reduce"


def zero3_gathers(cfg: Config, block: int) -> int:
    """zero=3's all-gathers of `block`'s weights per step (parallel/data/zero3.py): before its
    forward and before its backward, every microbatch; the embedding's (block 0) backward
    reads no weight and gathers nothing."""
    return cfg.parallel.microbatches * (1 if block == 0 else 2)


def fp8_gathers(cfg: Config, block: int) -> int:
    """zero=3's gathers of `block`'s FP8 payloads beyond its others' (zero3_gathers): under
    rowwise a full-recompute layer's forward runs again inside its backward, which holds the
    input grad's cast, so the forward's is gathered once more a microbatch."""
    if weight_granularity(cfg) != "rowwise" or not 1 <= block <= cfg.model.n_layers:
        return 0
    return cfg.parallel.microbatches * (layer_mode(cfg.recompute, block - 1) == "full")


def p2p_message_bytes(cfg: Config, tokens: int, element: int) -> float:
    """A pipeline message of `tokens` per sequence: the (b, T, d) activation or its grad in
    `element`-byte values; under SP each tp rank sends its sequence shard."""
    p = cfg.parallel
    nbytes = cfg.derived.micro_batch_size * tokens * cfg.model.d_model * element
    return nbytes / p.tp if p.sequence_parallel and p.tp > 1 else nbytes


@dataclass(frozen=True)
class Widths:
    """Bytes per element of each traffic: tp activations (the compute dtype), pipeline
    messages, grads (tp's and the tied table's sums), gathered weights, and the dp grad
    reduction's (`reduce`)."""

    act: int
    p2p: int  # the residual stream's: the pipeline's messages and the row-parallel sums
    grad: int
    param: int
    reduce: int = GRAD_BYTES

    @staticmethod
    def of(cfg: Config) -> Widths:
        """megapipe's own: the residual stream in the weights' dtype (float32 under float32
        weights, bf16 under bf16 ones: parallel/precision.Precision.weight_dtype) and float32
        grads (train.main_grads_dtype's under bf16 weights), the dp reduction in
        parallel.grad_reduce_dtype, weights gathered in train.params_dtype."""
        act = FLOAT32 if cfg.train.dtype == "float32" else 2
        param, grad = PARAM_BYTES[cfg.train.params_dtype], main_grad_bytes(cfg)
        return Widths(act, residual_width(cfg), grad, param, reduce_width(cfg, grad))


def residual_width(cfg: Config) -> int:
    """Bytes per element of megapipe's residual stream: the weights' dtype (Widths.of)."""
    return PARAM_BYTES[cfg.train.params_dtype]


ChunkParams = Callable[[range, int], int]  # (blocks, tp_rank) -> parameters of that chunk


def rank_comm_bytes(
    cfg: Config,
    pp_rank: int,
    tp_rank: int,
    chunk_params: ChunkParams,
    widths: Widths | None = None,
    synced_params: ChunkParams | None = None,
) -> dict[str, float]:
    """Bytes the rank at (pp_rank, tp_rank) puts into one step's ops, per axis (module
    docstring): tp's per block and microbatch, dp's grad reduction and weight gathers, the
    pipeline's sends and the tied table's grads, the cp ring's K/V blocks, ep's all-to-alls,
    train.fp8's amax all-reduces (config/fp8_amax.py), and the step's loss sums (latency
    only: perf prices none of their time). `synced_params` counts a chunk's parameters whose
    grads tp sums once a step (tp_synced_grads); None: none counted."""
    w, p = widths or Widths.of(cfg), cfg.parallel
    held = rank_blocks(cfg, pp_rank)
    params = [chunk_params(b, tp_rank) for b in held]
    experts = [held_expert_params(cfg, b) for b in held]
    out = dict.fromkeys(AXES, 0.0)
    out["tp"] = p.microbatches * sum(_tp_block(cfg, b, w) for blocks in held for b in blocks)
    if synced_params is not None:
        out["tp"] += tp_synced_grads(cfg, sum(synced_params(b, tp_rank) for b in held), w)
    out["cp"] = p.microbatches * sum(_cp_block(cfg, b, w) for blocks in held for b in blocks)
    out["ep"] = p.microbatches * sum(_ep_block(cfg, b, w) for blocks in held for b in blocks)
    out["dp"] = _dp(cfg, sum(params), sum(experts), w)
    out["dp"] += _more_reductions(cfg, pp_rank, params, experts, w)
    blocks = [b for bs in held for b in bs]
    if p.zero == 3:  # the gathers per block instead of after the step
        out["dp"] += _zero3(cfg, held, tp_rank, chunk_params, w)
    if p.zero == 3 or weight_casts(cfg) == "held":  # shards cast once a step: their amaxes
        dp_amax, tp_amax = amax_entries(cfg, blocks)
        out["dp"] += put_in("all_reduce", dp_amax * SCALE_BYTES, p.dp * p.cp)
        out["tp"] += put_in("all_reduce", tp_amax * SCALE_BYTES, p.tp)
    out["dp"] += _held_gather(cfg, blocks, w)
    for axis in ("tp", "cp"):  # train.fp8's amax all-reduces (config/fp8_amax.py)
        out[axis] += p.microbatches * amax_bytes(cfg, blocks, axis)
        out[axis] += step_amax_bytes(cfg, blocks, axis)  # the weights', once a step
    out["pp"] = _pp(cfg, pp_rank, w) + _tied(cfg, pp_rank, w)
    if p.dp == 1 and p.cp > 1:  # the replica group is cp's own: its sums run on cp's ranks
        out["cp"], out["dp"] = out["cp"] + out["dp"], 0.0
    return out


def _tp_block(cfg: Config, block: int, w: Widths) -> float:
    """One microbatch's tp bytes in `block` (F, B, and F again under full recompute)."""
    p, x = cfg.parallel, rank_dims(cfg)
    if p.tp == 1:
        return 0.0
    sp, nd = p.sequence_parallel, x.n * cfg.model.d_model
    if block == 0:
        ops = sum(tp_embedding_ops(sp, nd * w.param), [])
    elif block == cfg.model.n_layers + 1:
        ops = sum(tp_head_ops(sp, x.n, nd * w.p2p), []) + _tp_mtp(cfg, w)
    else:
        ops = _tp_layer(cfg, block - 1, w)
    return sum(put_in(kind, nbytes, p.tp) for kind, nbytes in ops)


def _tp_layer(cfg: Config, index: int, w: Widths) -> list[Op]:
    """One microbatch's tp ops of transformer layer `index`, and under full recompute its
    forward again (but its last, `recompute_skips_output_sum`), under recompute.modules=mlp
    its MLP's."""
    m, x, sp = cfg.model, rank_dims(cfg), cfg.parallel.sequence_parallel
    nd, moe = x.n * m.d_model, is_moe_layer(m, index)
    mlp = not moe or m.moe_shared_experts > 0
    widths = partial(column_input_widths, cfg, index, act=w.act, residual=w.p2p)
    inputs = tuple(scaled(x.n, each) for each in attention_column_inputs(m, widths, w.act))
    inputs, plain = _rope_key_apart(cfg, inputs)
    mlp_in = scaled(nd, widths(mlp_column(moe))) if mlp else None
    grads = tuple(nd * row_grad_width(cfg, index, n, w.act) for n in ("attn.proj", mlp_row(moe)))
    again = tuple(x.n * k for k in regathered(cfg, index, w.act))
    ops = tp_layer_ops(sp, nd * w.act, inputs, mlp_in, grads)
    f, b = (ring_ops(cfg, each) for each in ops)
    b = [*b, *plain[1], *(("all_gather", each) for each in again if each)]  # plain on the ring
    f = [*f, *plain[0], *routing_count_ops(cfg, moe, "tp")]
    if reruns_mlp(cfg.recompute, index) and not moe:
        return f + ring_ops(cfg, mlp_rerun_ops(cfg, mlp_in[0], nd * w.act)) + b
    if layer_mode(cfg.recompute, index) != "full":
        return f + b
    return f + (f[:-1] if recompute_skips_output_sum(cfg, moe) else f) + b


def _rope_key_apart(cfg: Config, inputs: tuple) -> tuple[tuple, tuple[list[Op], list[Op]]]:
    """Under the tp ring, latent attention's shared rope key (the last of its column inputs,
    attention_column_inputs) is not a linear's input: it enters its column region through
    SP's own all-gather and its grad leaves through SP's reduce-scatter (models/mla.py
    enter_column), which the ring does not run. (inputs the ring gathers, (F, B) plain ops)."""
    if not (tp_ring(cfg.parallel) and cfg.model.arch == "deepseek_v3"):
        return inputs, ([], [])
    *ring, (sent, summed) = inputs
    return tuple(ring), ([("all_gather", sent)], [("reduce_scatter", summed)])


def mlp_rerun_ops(cfg: Config, sent: float, act: float) -> list[Op]:
    """The tp ops of recompute.modules=mlp's rerun (parallel/recompute.py) under SP, before
    ring_ops: the gather of norm2's output, `sent` bytes as the forward's
    (column_input_widths), and under the ring (`act`: N·d bytes in the compute dtype)
    fc2's reduce-scatter too, whose autograd function saves after summing (the rerun stops
    at fc2's saves). Without SP nothing: the input's f is an identity, the output's sum comes
    after the saves (tp_layer_ops: the forward's own)."""
    if not cfg.parallel.sequence_parallel:
        return []
    if not tp_ring(cfg.parallel):
        return [("all_gather", sent)]
    return [("all_gather", sent), ("reduce_scatter", act)]


def ring_ops(cfg: Config, ops: list[Op]) -> list[Op]:
    """A layer's SP gathers and reduce-scatters as parallel.tp_overlap runs them (parallel/
    tensor/overlap.py): tp − 1 ring sends of one S/tp chunk each, (tp − 1)/tp · S a rank (a
    reduce-scatter's input S is never handed over whole, an all-gather's shard travels on);
    `ops` as they are without the overlap."""
    if not tp_ring(cfg.parallel):
        return ops
    n, ring = cfg.parallel.tp, ("all_gather", "reduce_scatter")
    return [("send", s * (n - 1) / n) if kind in ring else (kind, s) for kind, s in ops]


def recompute_skips_output_sum(cfg: Config, moe: bool) -> bool:
    """Full recompute leaves out a layer's last tp op, its MLP output's sum: the recompute is
    torch's non-reentrant checkpoint (parallel/recompute.py), which stops once the last tensor
    backward needs is recomputed, and a dense layer's row-linear sum comes after its saves.
    Rerun on a MoE layer (the experts' saves come after it), under dropout (the residual
    dropout's mask is saved after it) and under parallel.tp_overlap's ring (the row linear's
    autograd function saves its input after its ring has summed, `ring_ops`)."""
    return not moe and cfg.model.dropout == 0 and not tp_ring(cfg.parallel)


def _tp_mtp(cfg: Config, w: Widths) -> list[Op]:
    """The tp ops of the MTP depths beside the head (models/mtp.py), each: the shared
    embedding's lookup of the tokens k ahead, its block as layer n_layers + k − 1, and the
    shared head on the positions with a target (T − k of T; its input gathered, or its grad
    summed, over every position)."""
    m, x, sp = cfg.model, rank_dims(cfg), cfg.parallel.sequence_parallel
    nd, ops = x.n * m.d_model, []
    for k in range(1, m.mtp_layers + 1):
        ops += sum(tp_embedding_ops(sp, nd * w.param), [])
        ops += _tp_layer(cfg, m.n_layers + k - 1, w)
        rows = x.n * (m.seq_len - k) // m.seq_len
        f, b = tp_head_ops(sp, rows, nd * w.p2p)
        ops += f + b
    return ops


def tp_synced_grads(cfg: Config, elements: int, w: Widths) -> float:
    """The one all-reduce over tp, once a step, of the grads tp ranks hold partial copies of
    (parallel/tensor/grad_sync.py), `elements` of them: under SP the parameters whole on every
    tp rank see only its sequence chunk (norm gains, row-linear biases, learned positions,
    latent attention's down projections, a MoE layer's router and routed experts), and kv
    heads replicated over fewer than tp ranks. In float32 (the main grads under bf16 weights);
    perf prices none of its time (once a step, after the backward)."""
    return put_in("all_reduce", elements * w.grad, cfg.parallel.tp) if elements else 0.0


def _cp_block(cfg: Config, block: int, w: Widths) -> float:
    """One microbatch's cp bytes in a block: a layer's (_cp_layer), and on the head's block
    the MTP depths' (models/mtp.py): each depth's block as a layer, and once the targets and
    their places gathered over cp (int64)."""
    p, m = cfg.parallel, cfg.model
    if p.cp == 1 or block == 0:
        return 0.0
    if block < m.n_layers + 1:
        return _cp_layer(cfg, block - 1, w)
    if m.mtp_layers == 0:
        return 0.0
    x = rank_dims(cfg)
    # the (B, T/cp) targets and (T/cp,) places of every cp rank, gathered
    gathers = put_in("all_gather", (x.n + x.n // x.b) * 8 * p.cp, p.cp)
    return gathers + sum(_cp_layer(cfg, m.n_layers + k - 1, w) for k in range(1, m.mtp_layers + 1))


def _cp_layer(cfg: Config, index: int, w: Widths) -> float:
    """One microbatch's cp bytes in layer `index` (parallel/context/ring.py): cp − 1 K/V
    blocks forward, cp − 1 of K/V with dK/dV backward and the dK/dV that come home (the ring
    variant only: Ulysses' all-to-alls are not counted here), K and V of every local kv head
    (latent attention: each query head's key of nope + rope, its value padded to that width);
    and a MoE layer's routing counts."""
    p, m = cfg.parallel, cfg.model
    again = layer_mode(cfg.recompute, index) == "full"
    ops = routing_count_ops(cfg, is_moe_layer(m, index), "cp")
    total = sum(put_in(kind, nbytes, p.cp) for kind, nbytes in ops) * (2 if again else 1)
    if p.cp_comm != "ring":
        return total
    x = rank_dims(cfg)
    kv = 2 * x.n * x.hkv * x.hd * w.act
    if m.arch == "deepseek_v3":
        kv = 2 * x.n * x.h * (m.qk_nope_head_dim + m.qk_rope_head_dim) * w.act
    return total + (p.cp - 1) * kv * (2 if again else 1) + (p.cp - 1) * 2 * kv + kv


def routing_count_ops(cfg: Config, moe: bool, axis: str) -> list[Op]:
    """A MoE layer's forward sum, over `axis`, of its routed-row counts per sequence and expert
    ((b, E) float64: models/moe.py, for capacity and the aux loss's share), where that axis
    holds parts of the same sequences (tp under SP, cp); none elsewhere."""
    p = cfg.parallel
    parts = {"tp": p.tp > 1 and p.sequence_parallel, "cp": p.cp > 1}[axis]
    if not (moe and parts):
        return []
    return [("all_reduce", cfg.derived.micro_batch_size * cfg.model.n_experts * 8)]


def _ep_block(cfg: Config, block: int, w: Widths) -> float:
    """One microbatch's ep bytes in a MoE layer (parallel/expert/all_to_all.py): forward, the
    rows per expert exchanged (int64 (E,) counts: `received_counts`), then dispatch and combine
    of the N·k rows; backward their transposes; each row all-to-all the rank's N·k·d buffer, N
    the tokens the rank holds (N/tp under SP). Full recompute runs the forward's again. On
    the head's block, its MTP depths' MoE layers."""
    p, m = cfg.parallel, cfg.model
    held = rank_dims(cfg).n / (p.tp if p.sequence_parallel else 1)
    rows = put_in("all_to_all", held * m.top_k * m.d_model * w.act, p.ep)
    forward = put_in("all_to_all", m.n_experts * 8, p.ep) + 2 * rows
    again = layer_mode(cfg.recompute, block - 1) == "full"
    return moe_layers_in(m, [block]) * (forward * (2 if again else 1) + 2 * rows)


def _dp(cfg: Config, params: int, experts: int, w: Widths) -> float:
    """The grad reduction of the rank's `params` (`experts` of them over the expert replicas)
    and the weights' gathers: after the step at zero 1 and 2, at zero=3 each block's twice a
    microbatch (perf/data_parallel.py); the step's loss over dp × cp (and its grad norm, where
    that group is the world's). Under HSDP the
    reduce-scatters and gathers run in the shard groups and each shard is then all-reduced
    over its dp/dp_shard replicas, once a step (parallel/data/zero.py)."""
    p = cfg.parallel
    groups = [(params - experts, replicas(cfg)), (experts, expert_replicas(cfg) if p.ep > 1 else 0)]
    if p.ep == 1:
        groups = [(params, replicas(cfg))]
    total = put_in("all_reduce", LOSS_BYTES, p.dp * p.cp)
    if p.tp == 1 and p.pp == 1 and (p.zero > 0 or p.ep > 1):
        # the grad norm's sum runs on the world's group where each grad is whole on one of its
        # replicas only (parallel/data/levels.spread), here the dp × cp group itself
        total += put_in("all_reduce", NORM_BYTES, p.dp * p.cp)
    for n_params, n in groups:
        total += put_in(grad_reduction_kind(p.zero, n), n_params * w.reduce, n)
        total += put_in("all_reduce", n_params * w.reduce / max(n, 1), shard_copies(cfg))
        gathers = 1 if p.zero in (1, 2) else 0
        total += gathers * put_in("all_gather", n_params * w.param, n)
    return total


def grad_reductions(cfg: Config, pp_rank: int, schedule=None) -> list[int]:
    """How often each local chunk's grads are reduce-scattered in a step: once, or reducing
    every microbatch (states.reduces_per_microbatch) at the end of each of the chunk's grad
    actions: a BW, or Zero Bubble's B and its W each (parallel/data/zero2.py, `_flushing`).
    `schedule`: schedule_of(cfg), where the caller asks for every rank (built once)."""
    p = cfg.parallel
    chunks = len(rank_blocks(cfg, pp_rank))
    if not reduces_per_microbatch(cfg):
        return [1] * chunks
    if p.pp == 1:  # one backward per microbatch (train/replica.py)
        return [p.microbatches]
    actions = (schedule or schedule_of(cfg))[pp_rank]
    return [sum(a.chunk == c and a.kind != FORWARD for a in actions) for c in range(chunks)]


def _more_reductions(cfg: Config, pp_rank: int, params, experts, w: Widths) -> float:
    """The reduce-scatters beyond `_dp`'s one a step (grad_reductions), per local chunk of
    `params` (`experts` of them over the expert replicas under parallel.ep)."""
    total = 0.0
    for k, n, e in zip(grad_reductions(cfg, pp_rank), params, experts):
        e = e if cfg.parallel.ep > 1 else 0
        total += (k - 1) * put_in("reduce_scatter", (n - e) * w.grad, replicas(cfg))
        total += (k - 1) * put_in("reduce_scatter", e * w.grad, expert_replicas(cfg) if e else 1)
    return total


def _held_gather(cfg: Config, blocks: list[int], w: Widths) -> float:
    """train.fp8_params at zero 1-2 (weight_casts "held"): the gather after the step moves
    `blocks`' FP8 weights as 1-byte casts (two under rowwise: parallel/data/fp8_params.py)
    where `_dp` counted them in the weights' dtype; else 0."""
    if weight_casts(cfg) != "held":
        return 0.0
    n, forms = fp8_params(cfg, blocks), 2 if weight_granularity(cfg) == "rowwise" else 1
    moved = put_in("all_gather", forms * n * FP8_BYTES, replicas(cfg))
    return moved - put_in("all_gather", n * w.param, replicas(cfg))


def _zero3(cfg: Config, held: list[range], tp_rank: int, chunk_params: ChunkParams, w) -> float:
    """zero=3's gathers of each held block's weights (zero3_gathers), the routed experts' over
    their replicas, the rest over dp × cp (HSDP: over the shard groups); train.fp8's weights as
    1-byte payloads (config/fp8_weights.py; their amax all-reduces: rank_comm_bytes)."""
    p, total = cfg.parallel, 0.0
    for b in (b for blocks in held for b in blocks):
        n_params = chunk_params(range(b, b + 1), tp_rank)
        e = held_expert_params(cfg, range(b, b + 1)) if p.ep > 1 else 0
        f = fp8_params(cfg, [b]) if replicas(cfg) > 1 else 0
        shares = [((n_params - e - f) * w.param + f * FP8_BYTES, replicas(cfg))]
        shares.append((e * w.param, expert_replicas(cfg) if e else 1))
        gathered = sum(put_in("all_gather", nbytes, n) for nbytes, n in shares)
        total += zero3_gathers(cfg, b) * gathered
        total += fp8_gathers(cfg, b) * put_in("all_gather", f * FP8_BYTES, replicas(cfg))
    return total


def _pp(cfg: Config, pp_rank: int, w: Widths) -> float:
    """The pipeline's sends of one step: each microbatch's activation to the next stage and
    its grad to the previous one where that stage is on another rank; and the step's loss
    summed over pp."""
    p = cfg.parallel
    if p.pp == 1:
        return 0.0
    place, last = placement_of(cfg), placement_of(cfg).num_stages - 1
    message = p2p_message_bytes(cfg, cfg.model.seq_len // p.cp, w.p2p)
    sends = 0
    for mb in range(p.microbatches):
        for stage in range(last + 1):
            if place.locate(stage, mb)[0] != pp_rank:
                continue
            sends += stage < last and place.locate(stage + 1, mb)[0] != pp_rank
            sends += stage > 0 and place.locate(stage - 1, mb)[0] != pp_rank
    return sends * message + put_in("all_reduce", LOSS_BYTES, p.pp)


def tied_grad_bytes(cfg: Config, element: int) -> float:
    """The tied table's grad that the first and the last stage's ranks swap once a step
    (pipeline/tied.py; perf/data_parallel prices it as a two-rank all-reduce): their (V/tp, d)
    copies' grads in `element`-byte values, from zero=2 on the rank's shard of them (the swap
    follows the dp reduction)."""
    m, p = cfg.model, cfg.parallel
    return -(-m.vocab_size // p.tp) * m.d_model * element / state_layout(cfg).grad_shards


def _tied(cfg: Config, pp_rank: int, w: Widths) -> float:
    """tied_grad_bytes on the two ranks that swap them, where they are two."""
    place = placement_of(cfg)
    ends = {place.locate(0)[0], place.locate(place.num_stages - 1)[0]}
    if not shares_table(cfg.model) or len(ends) == 1 or pp_rank not in ends:
        return 0.0
    return tied_grad_bytes(cfg, w.grad)


def shares_table(m) -> bool:
    """Whether the last stage reads the token table too (a tied head, or MTP's lookups:
    models/gpt.GPT.shared_table), whose copies pipeline/tied.py keeps equal."""
    return m.tie_embeddings or m.mtp_layers > 0
