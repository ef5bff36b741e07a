"""The weights train.fp8 casts, as the config knows them: each layer's FP8 linears on one tp
rank (parallel/fp8.py `Fp8.apply`: every tp linear whose module name has no part in
train.fp8_keep_bf16; the embedding and the head by default; on the head's block each MTP
depth's projection and block, models/mtp.py), their scales, and what zero=3's
FP8 gathers move (parallel/data/zero3_fp8.py): the communication (config/comm_bytes.py) and
memory (config/memory_plan.py) models read them from here. The routed experts
(parallel/fp8_experts.py) cast in their matmuls from their high-precision weights, gathered in
high precision under zero=3, so they are not among the gathered FP8 weights; `experts_cast`
and `expert_deferred_fp8` count what their casts change (Zero Bubble W's kept operands).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megapipe.config.flops import expert_ffn, is_moe_layer
from megapipe.config.schema import Config, gated, tp_ring
from megapipe.config.states import FLOAT32, PARAM_BYTES, compute_bytes, replicas

FP8_BYTES = 1  # e4m3, gathered bit-cast to uint8
SCALE_BYTES = 4  # float32 amax and scale
BLOCK = 128  # parallel/fp8_scaling.BLOCK


@dataclass(frozen=True)
class Fp8Weight:
    """One FP8 linear's weight on a tp rank: (rows, cols) = (out, in) features, and the side
    tp splits (`out`: column-parallel, `in`: row-parallel, `none`: whole on every tp rank)."""

    rows: int
    cols: int
    splits: str

    def scales(self, granularity: str) -> tuple[int, int]:
        """Scales of its forward cast (W) and of its input grad's (Wᵀ)."""
        if granularity == "tensorwise":
            return 1, 1
        if granularity == "rowwise":
            return self.rows, self.cols
        blocks = -(-self.rows // BLOCK) * -(-self.cols // BLOCK)
        return blocks, blocks


def weight_granularity(cfg: Config) -> str | None:
    """train.fp8's weight scales (parallel/fp8.GRANULARITY), None when FP8 is off."""
    return {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "block"}.get(
        cfg.train.fp8
    )


def layer_fp8_weights(cfg: Config, block: int) -> list[Fp8Weight]:
    """The FP8 weights of layer `block` − 1 on one tp rank: 1..n_layers the main layers,
    n_layers + k the block of MTP depth k (models/gpt.build_mtp: the kind of layer
    n_layers + k − 1); [] for the others or with train.fp8=none. The pipeline's blocks:
    block_fp8_weights."""
    m = cfg.model
    if weight_granularity(cfg) is None or not 1 <= block <= m.n_layers + m.mtp_layers:
        return []
    return _cast(cfg, _layer_name(cfg, block - 1), _layer_named(cfg, block))


def _layer_named(cfg: Config, block: int) -> dict[str, Fp8Weight]:
    """Layer `block` − 1's linears train.fp8 would cast, by module name under the layer."""
    m, t, d = cfg.model, cfg.parallel.tp, cfg.derived
    h, hkv = m.n_heads // t, max(d.n_kv_heads // t, 1)  # memory_terms.rank_dims' heads
    mlps = {"mlp": d.d_ff // t}
    if is_moe_layer(m, block - 1):  # the routed experts stay high precision
        shared = m.moe_shared_experts * expert_ffn(m, d.d_ff) // t
        mlps = {"mlp.shared": shared} if m.moe_shared_experts else {}
    named = _mla_weights(cfg, h) if m.arch == "deepseek_v3" else {
        "attn.qkv": Fp8Weight((h + 2 * hkv) * d.head_dim, m.d_model, "out"),
        "attn.proj": Fp8Weight(m.d_model, h * d.head_dim, "in"),
    }  # fmt: skip
    for name, ff in mlps.items():
        named |= _mlp_weights(cfg, name, ff)
    return named


def casts_linear(cfg: Config, index: int | None, name: str) -> bool:
    """Whether train.fp8 casts the linear `name` ("attn.qkv", "mlp.fc1", "mlp.shared.fc1",
    "attn.q_b", ...) of layer `index` (None: a main layer's)."""
    block, m = (index or 0) + 1, cfg.model
    if weight_granularity(cfg) is None or not 1 <= block <= m.n_layers + m.mtp_layers:
        return False
    named = {n: w for n, w in _layer_named(cfg, block).items() if n == name}
    return bool(_cast(cfg, _layer_name(cfg, block - 1), named))


def casts_weights(cfg: Config) -> bool:
    """Autocast casts float32 weights to a narrower compute dtype for every matmul."""
    return compute_bytes(cfg) != FLOAT32 and cfg.train.params_dtype == "float32"


def ring_payloads(cfg: Config, index: int | None, name: str) -> bool:
    """The tp ring gathers the column linear `name`'s input as FP8 payloads, one byte an
    element (parallel/fp8_overlap.py: tensorwise scales, which its grad_W's xᵀ shares), and
    the linear keeps them for backward."""
    ring = tp_ring(cfg.parallel) and cfg.train.fp8 == "tensorwise"
    return ring and casts_linear(cfg, index, name)


def _mlp_weights(cfg: Config, name: str, ff: int) -> dict[str, Fp8Weight]:
    """An MLP's fc1 (column) and fc2 (row) of `ff` features on the tp rank, under `name`."""
    m = cfg.model
    return {
        f"{name}.fc1": Fp8Weight(ff * (2 if gated(m.arch) else 1), m.d_model, "out"),
        f"{name}.fc2": Fp8Weight(m.d_model, ff, "in"),
    }


def dense_mlp_fp8_weights(cfg: Config, block: int) -> list[Fp8Weight]:
    """The FP8 weights of layer `block` − 1's dense MLP (fc1, fc2; [] in a MoE layer, past
    the layers or with train.fp8 off): what recompute.modules=mlp reruns."""
    m = cfg.model
    if weight_granularity(cfg) is None or not 1 <= block <= m.n_layers + m.mtp_layers:
        return []
    if is_moe_layer(m, block - 1):
        return []
    mlp = _mlp_weights(cfg, "mlp", cfg.derived.d_ff // cfg.parallel.tp)
    return _cast(cfg, _layer_name(cfg, block - 1), mlp)


def dense_mlp_cast(cfg: Config, index: int) -> bool:
    """Layer `index`'s dense MLP (fc1, fc2) runs in FP8: train.fp8 on, not kept, not MoE."""
    if weight_granularity(cfg) is None or is_moe_layer(cfg.model, index):
        return False
    return not _kept(cfg) & {*_layer_name(cfg, index), "mlp", "fc2"}


def mtp_projection(cfg: Config, depth: int) -> list[Fp8Weight]:
    """MTP depth `depth`'s 2d → d projection (models/mtp.MTPModule.proj, a ReplicatedLinear
    whole on every tp rank) where train.fp8 casts it, else []."""
    if weight_granularity(cfg) is None or not 1 <= depth <= cfg.model.mtp_layers:
        return []
    d = cfg.model.d_model
    named = {"proj": Fp8Weight(d, 2 * d, "none")}
    return _cast(cfg, ("mtp", "depths", str(depth - 1)), named)


def block_fp8_weights(cfg: Config, block: int) -> list[Fp8Weight]:
    """The FP8 weights of the pipeline's `block` (0 the embedding, 1..n_layers the layers,
    n_layers + 1 the head's, which holds MTP's depths: each its projection and its block)."""
    m = cfg.model
    if block != m.n_layers + 1:
        return layer_fp8_weights(cfg, block)
    depths = range(1, m.mtp_layers + 1)
    return [
        w for k in depths for w in mtp_projection(cfg, k) + layer_fp8_weights(cfg, m.n_layers + k)
    ]


def _layer_name(cfg: Config, index: int) -> tuple[str, ...]:
    """The module name parts of layer `index` (0-based) in a chunk: a main layer's, or past
    n_layers an MTP depth's block (models/mtp.MTP.depths)."""
    n = cfg.model.n_layers
    return ("layers", str(index)) if index < n else ("mtp", "depths", str(index - n), "block")


def _cast(cfg: Config, prefix: tuple[str, ...], named: dict[str, Fp8Weight]) -> list[Fp8Weight]:
    """The weights of `named` (names under `prefix`) that Fp8.apply casts: those with no name
    part in train.fp8_keep_bf16."""
    keep = _kept(cfg)
    return [w for name, w in named.items() if not keep & {*prefix, *name.split(".")}]


def _mla_weights(cfg: Config, h: int) -> dict[str, Fp8Weight]:
    """Latent attention's FP8 linears (models/mla.py) with `h` heads on the tp rank: the down
    projections whole on every rank (`none`), the up ones column, the output row."""
    m = cfg.model
    qk, rq = m.qk_nope_head_dim + m.qk_rope_head_dim, m.q_lora_rank
    named = {"attn.q_a": Fp8Weight(rq, m.d_model, "none")} if rq else {}
    return named | {
        "attn.q_b": Fp8Weight(h * qk, rq or m.d_model, "out"),
        "attn.kv_a": Fp8Weight(m.kv_lora_rank + m.qk_rope_head_dim, m.d_model, "none"),
        "attn.kv_b": Fp8Weight(h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "out"),
        "attn.proj": Fp8Weight(m.d_model, h * m.v_head_dim, "in"),
    }


def _kept(cfg: Config) -> set[str]:
    return {k.strip() for k in cfg.train.fp8_keep_bf16.split(",") if k.strip()}


def experts_cast(cfg: Config, block: int) -> bool:
    """Whether train.fp8 casts layer `block` − 1's routed experts (Fp8.apply: `layers.i.mlp
    .experts`, an MTP depth's `mtp.depths.k.block.mlp.experts`, unless a part of that name is
    in train.fp8_keep_bf16)."""
    m = cfg.model
    if weight_granularity(cfg) is None or not 1 <= block <= m.n_layers + m.mtp_layers:
        return False
    names = {*_layer_name(cfg, block - 1), "mlp", "experts"}
    return is_moe_layer(m, block - 1) and not _kept(cfg) & names


def experts_fp8(cfg: Config) -> bool:
    """Whether train.fp8 casts any layer's routed experts (the performance model's MoE layer)."""
    return any(experts_cast(cfg, b) for b in range(1, cfg.model.n_layers + 1))


def expert_deferred_fp8(cfg: Config, block: int, rows: int, element: int) -> tuple[float, float]:
    """(bytes saved, scale bytes added) where Zero Bubble's W keeps `block`'s routed experts'
    FP8 operands (parallel/fp8_experts.py) in place of their `element`-byte inputs and output
    grads over `rows` routed rows: per stacked matmul (in + out)·rows values at one byte; their
    scales per (expert, source) part, E of them on a rank (E/ep experts × ep sources): two per
    part tensorwise, in + out per part rowwise, in + out per 128-row tile of a part blockwise
    (at most rows/128 + E tiles)."""
    if not experts_cast(cfg, block):
        return 0.0, 0.0
    m, granularity = cfg.model, weight_granularity(cfg)
    f = expert_ffn(m, cfg.derived.d_ff)
    features = (m.d_model + f * (2 if gated(m.arch) else 1)) + (f + m.d_model)
    parts = m.n_experts
    per = {"tensorwise": 0, "rowwise": parts, "block": -(-rows // BLOCK) + parts}[granularity]
    scales = 2 * 2 * parts if granularity == "tensorwise" else features * per
    return features * rows * (element - FP8_BYTES), scales * SCALE_BYTES


def fp8_params(cfg: Config, blocks: Iterable[int]) -> int:
    """Elements of the FP8 weights in the pipeline's `blocks` on one tp rank."""
    return sum(w.rows * w.cols for b in blocks for w in block_fp8_weights(cfg, b))


def amax_entries(cfg: Config, blocks: Iterable[int]) -> tuple[int, int]:
    """Float32 amax entries zero=3's casts all-reduce once a step for `blocks`' FP8 weights:
    (over the dp × cp shard group, over tp). Tensorwise: one per weight on both; rowwise: a
    row's of W and of Wᵀ, over tp where tp splits that row (row-parallel W, column-parallel
    Wᵀ); blocks: whole on each tp rank."""
    granularity = weight_granularity(cfg)
    forms = 2 if granularity == "rowwise" else 1
    dp = tp = 0
    for w in (w for b in blocks for w in block_fp8_weights(cfg, b)):
        fwd, dgrad = w.scales(granularity)
        dp += fwd + (dgrad if forms == 2 else 0)
        if w.splits == "none":  # whole on every tp rank: no amax shared over tp
            continue
        if granularity == "tensorwise":
            tp += 1
        elif granularity == "rowwise":
            tp += fwd if w.splits == "in" else dgrad
    return dp, (tp if cfg.parallel.tp > 1 else 0)


def cast_bytes(cfg: Config, blocks: Iterable[int], shards: int) -> float:
    """What zero=3's FP8 gathers keep over a step on a rank holding `blocks`, its weights
    sharded `shards` ways: the 1-byte cast of its shard of their FP8 weights (two under
    rowwise) and the float32 inverse scales of every weight, whole on each rank."""
    if weight_granularity(cfg) is None or shards <= 1:
        return 0.0
    return _kept_casts(cfg, list(blocks), shards)


def weight_casts(cfg: Config) -> str:
    """When the FP8 linears cast their weights: "gathered" (zero=3: its gathers cast the shards
    once a step, parallel/data/zero3_fp8.py), "held" (train.fp8_params at zero 1-2: cast from
    the main params after the step and held as the weights, parallel/data/fp8_params.py),
    "use" (pipedream_async, whose optimizer steps between a step's microbatches: at every
    use), else "step" (at the first use in a step, kept to its end:
    parallel/fp8_weight_cache.py)."""
    if cfg.parallel.zero == 3:
        return "gathered"
    if cfg.train.fp8_params and cfg.parallel.zero in (1, 2) and replicas(cfg) > 1:
        return "held"
    return "use" if cfg.parallel.schedule == "pipedream_async" else "step"


def held_weight_bytes(cfg: Config, blocks: Iterable[int]) -> tuple[float, float]:
    """train.fp8_params (weight_casts "held"): what holding `blocks`' FP8 weights as their
    casts changes on a rank, (its weights, zero 1-2's gather after the step): each weight's
    bf16 bytes out and its 1-byte casts (two under rowwise) and scales in; the gather fills
    the held casts from a 1-byte shard per form instead of a bf16 flat and shard; else 0."""
    if weight_granularity(cfg) is None or weight_casts(cfg) != "held":
        return 0.0, 0.0
    blocks = list(blocks)
    n, d = fp8_params(cfg, blocks), replicas(cfg)
    forms = 2 if weight_granularity(cfg) == "rowwise" else 1
    bf16, shard = PARAM_BYTES[cfg.train.params_dtype], -(-n // d)
    return _kept_casts(cfg, blocks, 1) - bf16 * n, forms * shard * FP8_BYTES - bf16 * (n + shard)


def step_cast_bytes(cfg: Config, blocks: Iterable[int]) -> float:
    """What the FP8 linears' weight casts kept over a step's forwards and backwards hold on a
    rank holding `blocks` (parallel/fp8_weight_cache.py): each FP8 weight at one byte (two
    under rowwise: W's and Wᵀ's casts) and their float32 inverse scales; 0 where the weights
    are cast otherwise (weight_casts)."""
    if weight_granularity(cfg) is None or weight_casts(cfg) != "step":
        return 0.0
    return _kept_casts(cfg, list(blocks), 1)


def _kept_casts(cfg: Config, blocks: list[int], shards: int) -> float:
    """The 1-byte casts of a 1/`shards` range of `blocks`' FP8 weights (two forms under
    rowwise) and every weight's inverse scales."""
    forms = 2 if weight_granularity(cfg) == "rowwise" else 1
    shard = -(-fp8_params(cfg, blocks) // shards)
    return forms * shard * FP8_BYTES + amax_entries(cfg, blocks)[0] * SCALE_BYTES


def deferred_fp8(cfg: Config, block: int, tokens: int, element: int) -> tuple[float, float]:
    """(bytes saved, scale bytes added) where Zero Bubble's W keeps a layer's FP8 operands
    (parallel/fp8.py: gᵀ in e5m2 and xᵀ in e4m3, cast in B) in place of its `element`-byte
    inputs and output grads over `tokens` rows: per FP8 linear (in + out)·tokens values at one
    byte, their scales one per tensor, per feature (rowwise) or per 128-token tile."""
    granularity = weight_granularity(cfg)
    weights = layer_fp8_weights(cfg, block)
    features = sum(w.rows + w.cols for w in weights)
    per = {"tensorwise": 0, "rowwise": 1, "block": -(-tokens // BLOCK)}.get(granularity, 0)
    scales = 2 * len(weights) if granularity == "tensorwise" else features * per
    return features * tokens * (element - FP8_BYTES), scales * SCALE_BYTES


def fp8_summary(cfg: Config, blocks: Iterable[int], shards: int, deferred: dict) -> list:
    """The dry run's FP8 lines for a rank holding `blocks` (train/dry_run.py): the weights
    cast, zero=3's 1-byte gathers and kept casts (`shards` > 1), and what W keeps
    (`deferred`: a layer's memory_terms.layer_deferred under a B/W split, else {})."""
    granularity = weight_granularity(cfg)
    if granularity is None:
        return []
    blocks = list(blocks)
    layers = [b for b in blocks if 1 <= b <= cfg.model.n_layers]
    lines = [
        f"(FP8 weights on pp=0 tp=0: {fp8_params(cfg, blocks):,} elements, the linears of "
        f"{len(layers)} layers{_mtp_note(cfg, blocks)} outside "
        f"train.fp8_keep_bf16={cfg.train.fp8_keep_bf16}, {granularity} scales)"
    ]
    experts = [b for b in layers if experts_cast(cfg, b)]
    if experts:
        lines.append(
            f"(FP8 routed experts in {len(experts)} layers: each expert's weight cast with its "
            "own scales, its rows per source ep rank; gathered in high precision under zero=3)"
        )
    step = step_cast_bytes(cfg, blocks)
    if step:
        lines.append(
            f"(FP8 weight casts: each weight cast at its first use in a step and kept to the "
            f"step's last backward, {step:,.0f} bytes with their scales)"
        )
    held, _ = held_weight_bytes(cfg, blocks)
    if held:
        lines.append(
            "(FP8 weights held cast, train.fp8_params: those weights are their 1-byte casts "
            f"and scales, {_kept_casts(cfg, blocks, 1):,.0f} bytes ({-held:,.0f} less than in "
            f"{cfg.train.params_dtype}); zero={cfg.parallel.zero} gathers them in 1 byte "
            "after the step)"
        )
    if shards > 1:
        kept = cast_bytes(cfg, blocks, shards)
        lines.append(
            "(FP8 gathers, zero=3: they are gathered as 1-byte e4m3 payloads; the casts of "
            f"the rank's shards and their scales are kept over the step: {kept:,.0f} bytes, "
            "in the gathered weights)"
        )
    if deferred.get("FP8 scales"):
        saved, scales = -deferred["FP8 cast saving"], deferred["FP8 scales"]
        lines.append(
            "(FP8 deferred W: a layer keeps its FP8 linears' inputs and output grads cast to "
            f"one byte from B to W, {saved:,.0f} bytes less a microbatch, plus {scales:,.0f} "
            "bytes of scales)"
        )
    return lines


def _mtp_note(cfg: Config, blocks: list[int]) -> str:
    depths = cfg.model.mtp_layers if cfg.model.n_layers + 1 in blocks else 0
    return f" and {depths} MTP depth{'s' if depths > 1 else ''}" if depths else ""
