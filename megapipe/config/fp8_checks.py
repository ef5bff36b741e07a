"""What `train.fp8` (parallel/fp8.py) combines with, one line each, before any process group."""

from __future__ import annotations

from megapipe.config.checks_runtime import require
from megapipe.config.schema import Config, Derived
from megapipe.plan.schedules import SCHEDULES

FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise")
BLOCK = 128  # parallel/fp8_scaling.BLOCK: DeepSeek-V3's tile and block width


def check_fp8(cfg: Config) -> None:
    """train.fp8's value, and the settings it cannot be exact under."""
    t, p = cfg.train, cfg.parallel
    require(t.fp8 in FP8_RECIPES, f"train.fp8={t.fp8!r} is not one of {', '.join(FP8_RECIPES)}")
    if t.fp8_params:
        _check_fp8_params(cfg)
    if t.fp8 == "none":
        return
    require(
        not (SCHEDULES[p.schedule].segmented and p.pp > 1),
        f"train.fp8={t.fp8} with parallel.schedule={p.schedule}: sequence segments would scale "
        "each segment apart from the whole sequence; choose another schedule",
    )
    if t.fp8 == "blockwise":
        _check_blocks(cfg)


def _check_fp8_params(cfg: Config) -> None:
    """train.fp8_params: FP8 weights whose high-precision copy is the distributed optimizer's
    float32 main shard (parallel/data/fp8_params.py)."""
    t, p = cfg.train, cfg.parallel
    name = "train.fp8_params=true"
    require(t.fp8 != "none", f"{name} holds the FP8 linears' casts: set train.fp8 (tensorwise, "
            "rowwise or blockwise) or train.fp8_params=false")  # fmt: skip
    require(
        t.params_dtype == "bfloat16",
        f"{name} keeps the high-precision weights as float32 main params: set "
        "train.params_dtype=bfloat16",
    )
    require(  # without replicas nothing is sharded, whatever the level: nothing held either
        p.zero >= 1 or p.dp * p.cp == 1,
        f"{name} with parallel.zero=0 over dp x cp={p.dp * p.cp}: FP8 weights are cast from the "
        "distributed optimizer's main params; set parallel.zero=1 (or 2; zero=3 does this "
        "already)",
    )
    require(
        t.optimizer == "adamw",
        f"{name} with train.optimizer={t.optimizer}: Muon steps whole matrices from the weights; "
        "use train.optimizer=adamw",
    )
    require(
        not p.post_validation,
        f"{name} with parallel.post_validation: its rollback restores the bf16 weights, which "
        "FP8 weights do not hold; set one of them false",
    )


def _check_blocks(cfg: Config) -> None:
    """blockwise: each rank holds whole 1x128 tiles and 128x128 blocks, so none shares an amax."""
    p, d = cfg.parallel, Derived.of(cfg)
    require(
        p.cp == 1,
        f"train.fp8=blockwise with parallel.cp={p.cp}: the weight grad's 128-token tiles would "
        "cross the cp ranks' sequence chunks; use train.fp8=rowwise or tensorwise under cp",
    )
    if p.tp == 1:
        return
    kept = {k.strip() for k in cfg.train.fp8_keep_bf16.split(",")}
    require(  # each tp rank routes its chunk of the tokens (parallel/fp8_experts.py)
        not (cfg.model.n_experts and p.sequence_parallel and "experts" not in kept),
        f"train.fp8=blockwise with parallel.tp={p.tp} and sequence_parallel: the routed "
        "experts' 128-token tiles would cross the tp ranks' token chunks; add experts to "
        "train.fp8_keep_bf16 or use train.fp8=rowwise",
    )
    widths = _split_widths(cfg, d)
    for what, width in widths.items():
        require(
            width % (p.tp * BLOCK) == 0,
            f"train.fp8=blockwise with parallel.tp={p.tp}: {what} ({width} features) must split "
            f"into whole {BLOCK}-wide blocks per tp rank; use train.fp8=rowwise or another tp",
        )
    if cfg.model.arch == "deepseek_v3" and p.sequence_parallel:
        chunk = cfg.model.seq_len // p.tp
        require(
            chunk % BLOCK == 0,
            f"train.fp8=blockwise with model.arch=deepseek_v3 and sequence parallelism: latent "
            f"attention's down projections take each tp rank's {chunk}-token chunk, so their "
            f"weight grad's {BLOCK}-token tiles would cross ranks; set "
            "--parallel.sequence_parallel=false or use train.fp8=rowwise",
        )


def _split_widths(cfg: Config, d: Derived) -> dict[str, int]:
    """The features tp splits in a layer's FP8 linears (models/mla.py's up and out projections
    under deepseek_v3; its down projections are whole on every tp rank)."""
    m = cfg.model
    if m.arch == "deepseek_v3":
        return {
            "the query heads": m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
            "the latent key/value heads": m.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
            "the value heads": m.n_heads * m.v_head_dim,
            "model.d_ff": d.d_ff,
        }
    return {
        "the query heads": m.n_heads * d.head_dim,
        "the key/value heads": d.n_kv_heads * d.head_dim,
        "model.d_ff": d.d_ff,
    }
