"""The architecture-specific model checks (RoPE's head dims, nemotron's dense MLP,
deepseek_v3's latent attention, routing, aux-loss-free balancing and multi-token prediction):
config/checks.py's `_check_model` runs `check_arch` after the keys every arch shares."""

from __future__ import annotations

from megapipe.config.archs import arch_of, rotary_dims
from megapipe.config.checks_runtime import require as _require
from megapipe.config.schema import Config, ModelConfig


def check_arch(cfg: Config) -> None:
    m = cfg.model
    _check_bias_update(cfg)
    _check_mtp(cfg)
    _check_rope(m)
    if m.arch == "deepseek_v3":
        _check_deepseek(m, cfg.parallel.cp)
    _require(
        m.arch != "nemotron" or m.n_experts == 0,
        "model.arch=nemotron is dense (Nemotron-4); set model.n_experts=0, or use llama or "
        "deepseek_v3 for a mixture of experts",
    )
    _check_head_dim(m)


def _check_head_dim(m: ModelConfig) -> None:
    """RoPE turns pairs of dims: the rotated part of a head (model.partial_rotary_factor of
    it) must be even (none at all leaves the head without positions, NoPE)."""
    if not arch_of(m.arch).rope:
        _require(
            not m.head_dim or m.head_dim * m.n_heads == m.d_model,
            f"model.head_dim: {m.arch} needs d_model / n_heads; set it 0",
        )
        return  # model.partial_rotary_factor unread, as the other archs' own keys
    _require(
        m.partial_rotary_factor == 1.0 or m.arch != "deepseek_v3",
        "model.partial_rotary_factor: deepseek_v3 rotates its own qk_rope_head_dim; set it 1",
    )
    head_dim = m.head_dim or m.d_model // m.n_heads
    if m.head_dim:
        _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim}: RoPE needs it even")
    else:
        _require(
            head_dim % 2 == 0,
            f"model.d_model={m.d_model} / model.n_heads={m.n_heads} gives head dim {head_dim}, "
            f"but {m.arch}'s RoPE needs an even head dim: make model.d_model a multiple of "
            f"2·model.n_heads={2 * m.n_heads}",
        )
    rotated = rotary_dims(m, head_dim)
    _require(
        rotated % 2 == 0,
        f"model.partial_rotary_factor={m.partial_rotary_factor} rotates {rotated} of the head's "
        f"{head_dim} dims, but RoPE turns pairs: pick a fraction that rotates an even number",
    )


def _check_bias_update(cfg: Config) -> None:
    """Aux-loss-free balancing (train/moe_balance.py) updates once per flushed step (under
    post-validation with the weights' accept or rollback)."""
    m, p = cfg.model, cfg.parallel
    if m.moe_bias_update_rate == 0:
        return
    _require(
        m.arch == "deepseek_v3" and m.n_experts > 0,
        "model.moe_bias_update_rate > 0 needs model.arch=deepseek_v3 with model.n_experts > 0 "
        "(the bias is its routing's); set it 0",
    )
    _require(
        p.schedule != "pipedream_async",
        "model.moe_bias_update_rate > 0 needs a flushing schedule: pipedream_async updates each "
        "stage per microbatch on stashed weights, with no whole-batch load to step the bias by; "
        "set parallel.schedule=1f1b or the rate 0",
    )


def _check_rope(m: ModelConfig) -> None:
    """YaRN (models/rope.py) needs its pretrained context; its keys are read only under it."""
    if m.rope_type == "default":
        unset = {"rope_factor": 1.0, "original_max_position_embeddings": 0, "mscale": 0.0,
                 "mscale_all_dim": 0.0, "rope_attention_factor": 0.0}  # fmt: skip
        for key, value in unset.items():
            _require(
                getattr(m, key) == value,
                f"model.{key} is read only under model.rope_type=yarn; set rope_type or unset it",
            )
        return
    _require(
        arch_of(m.arch).rope, f"model.rope_type=yarn: {m.arch} has no RoPE; use llama, qwen3, ..."
    )
    _require(
        m.original_max_position_embeddings > 0,
        "model.rope_type=yarn needs model.original_max_position_embeddings (the pretrained "
        "context length) > 0",
    )
    _require(
        m.beta_fast >= m.beta_slow,
        f"model.beta_fast={m.beta_fast} must be at least model.beta_slow={m.beta_slow}",
    )


def _check_mtp(cfg: Config) -> None:
    """Multi-token prediction (models/mtp.py) where it is built."""
    m = cfg.model
    if m.mtp_layers == 0:
        return
    _require(
        not m.tie_embeddings,
        "model.mtp_layers > 0 needs model.tie_embeddings=false (MTP shares an untied head)",
    )
    _require(
        m.mtp_layers < m.seq_len,
        f"model.mtp_layers={m.mtp_layers} must be below model.seq_len={m.seq_len}",
    )


def _check_deepseek(m, cp: int) -> None:
    """deepseek_v3's attention and routing shapes (models/mla.py, models/routing.py)."""
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    _require(
        cp == 1 or m.v_head_dim <= qk,
        f"model.v_head_dim={m.v_head_dim} > qk_nope_head_dim + qk_rope_head_dim={qk} is not "
        "built under parallel.cp > 1 (the ring pads values to the key width); lower it",
    )
    _require(
        m.qk_rope_head_dim % 2 == 0,
        f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs)",
    )
    if m.n_experts == 0:
        return
    _require(
        m.n_experts % m.n_group == 0 and m.n_experts // m.n_group >= 2,
        f"model.n_group={m.n_group} must divide model.n_experts={m.n_experts} into groups "
        "of at least 2 experts (a group scores by its top 2)",
    )
    _require(
        m.topk_group <= m.n_group,
        f"model.topk_group={m.topk_group} must be at most model.n_group={m.n_group}",
    )
    reach = m.n_experts // m.n_group * m.topk_group
    _require(
        m.top_k <= reach,
        f"model.top_k={m.top_k} exceeds the {reach} experts of model.topk_group groups",
    )
