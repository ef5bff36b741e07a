"""Qwen3 and Qwen3-MoE in the Hugging Face name tables and configs (models/hf.py uses these).

transformers' Qwen3ForCausalLM is Llama's layout with QK-norm gains `self_attn.q_norm` and
`self_attn.k_norm` (models/qk_norm.py) and an explicit head_dim. Qwen3MoeForCausalLM puts a
mixture of experts on layer i when (i + 1) % decoder_sparse_step == 0 and i is not in
mlp_only_layers (modeling_qwen3_moe.Qwen3MoeDecoderLayer): model.moe_every is
decoder_sparse_step; its router `mlp.gate` (softmax, top-k, renormalised when norm_topk_prob)
and stacked experts `mlp.experts.gate_up_proj` / `down_proj` have Mixtral's layout. Whatever
our model cannot compute is a one-line ValueError naming the HF field.
"""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.models.hf_require import require

QWEN3_QK_NORMS = {
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
}
QWEN3_EXPERTS = {  # a sparse layer's MLP; its dense layers keep the llama MLP names
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.experts.w_in": ("mlp.experts.gate_up_proj",),
    "mlp.experts.w_out": ("mlp.experts.down_proj",),
}
QWEN3_TYPES = ("qwen3", "qwen3_moe")


def qwen3_config(hf, base: ModelConfig) -> ModelConfig:
    """The ModelConfig of an HF Qwen3Config or Qwen3MoeConfig; `base`: its llama fields."""
    fields = vars(base) | {"arch": "qwen3", "head_dim": head_dim_field(hf)} | _window_fields(hf)
    if hf.model_type == "qwen3_moe":
        fields |= _moe_fields(hf)
    return ModelConfig(**fields)


def _window_fields(hf) -> dict:
    """model.sliding_window and max_window_layers: Qwen3 slides the layers whose layer_types
    entry is sliding_attention (by default those from max_window_layers on), Qwen3-MoE every
    layer; transformers keeps sliding_window only when use_sliding_window is true."""
    window = hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
    if not window:
        return {}
    if hf.model_type == "qwen3_moe":
        return {"sliding_window": window, "max_window_layers": 0}
    kinds = list(hf.layer_types)
    first = kinds.index("sliding_attention") if "sliding_attention" in kinds else len(kinds)
    require(
        set(kinds[first:]) == {"sliding_attention"} or first == len(kinds),
        f"HF layer_types {kinds} unsupported: model.max_window_layers slides the last layers only",
    )
    return {"sliding_window": window, "max_window_layers": first}


def head_dim_field(hf) -> int:
    """model.head_dim: 0 where it is hidden_size / num_attention_heads (the default)."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return 0 if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim


def _moe_fields(hf) -> dict:
    require(
        not hf.mlp_only_layers,
        f"HF mlp_only_layers={list(hf.mlp_only_layers)} unsupported (model.moe_every places "
        "every decoder_sparse_step-th layer only); set it []",
    )
    return {
        "n_experts": hf.num_experts,
        "top_k": hf.num_experts_per_tok,
        "moe_ffn": hf.moe_intermediate_size,
        "moe_every": hf.decoder_sparse_step,
        "norm_topk_prob": bool(hf.norm_topk_prob),
        "moe_aux_coef": float(hf.router_aux_loss_coef),
    }


def qwen3_hf_config(cfg: ModelConfig, expert_ffn: int, d_ff: int, common: dict):
    """Qwen3Config, or Qwen3MoeConfig for n_experts > 0; `common`: the llama family's keys."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    full = {"use_sliding_window": False, "sliding_window": None, "attention_bias": False}
    if cfg.sliding_window:
        full |= {"use_sliding_window": True, "sliding_window": cfg.sliding_window}
    if not cfg.n_experts:
        layers = {"max_window_layers": cfg.max_window_layers} if cfg.sliding_window else {}
        return Qwen3Config(intermediate_size=d_ff, **full, **layers, **common)
    require(
        not cfg.sliding_window or cfg.max_window_layers == 0,
        "model.max_window_layers > 0: Qwen3-MoE slides every layer; set it 0 to export",
    )
    require(cfg.moe_shared_experts == 0, "model.moe_shared_experts: Qwen3-MoE has none; set 0")
    require(
        cfg.moe_capacity_factor == 0,
        "model.moe_capacity_factor > 0: Qwen3-MoE routes dropless; set it 0 to export",
    )
    return Qwen3MoeConfig(
        intermediate_size=d_ff,
        moe_intermediate_size=expert_ffn,
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        decoder_sparse_step=cfg.moe_every,
        mlp_only_layers=[],
        norm_topk_prob=cfg.norm_topk_prob,
        router_aux_loss_coef=cfg.moe_aux_coef,
        **full,
        **common,
    )
