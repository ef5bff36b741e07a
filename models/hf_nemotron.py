"""Nemotron (Nemotron-4) in the Hugging Face name tables and configs (models/hf.py uses these).

transformers' NemotronForCausalLM is Llama's layout with three differences, each ours too
(config/archs.py, model.arch nemotron): its norms are NemotronLayerNorm1P (a LayerNorm with a
bias whose stored weight w scales by 1 + w: our LayerNorm1P holds the same w, so the tensors
move as they are), its MLP is down_proj(relu2(up_proj x)) (no gate), and RoPE turns the first
partial_rotary_factor of each head (rope_parameters' key; 0.5 by default there). Whatever our
model cannot compute is a one-line ValueError naming the HF field.
"""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.models.hf_qwen3 import head_dim_field
from megapipe.models.hf_require import require

NEMOTRON_TOP = {
    "embed.tok.weight": ("model.embed_tokens.weight",),
    "head.norm.weight": ("model.norm.weight",),
    "head.norm.bias": ("model.norm.bias",),
    "head.out.weight": ("lm_head.weight",),
}
NEMOTRON_LAYER = {
    "norm1.weight": ("input_layernorm.weight",),
    "norm1.bias": ("input_layernorm.bias",),
    "attn.qkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "norm2.weight": ("post_attention_layernorm.weight",),
    "norm2.bias": ("post_attention_layernorm.bias",),
    "mlp.fc1.weight": ("mlp.up_proj.weight",),
    "mlp.fc2.weight": ("mlp.down_proj.weight",),
}


def partial_rotary_factor(hf) -> float:
    """The fraction of each head RoPE turns: rope_parameters' key, else the config's own."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    return float(rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))


def nemotron_config(hf, base: ModelConfig) -> ModelConfig:
    """The ModelConfig of an HF NemotronConfig; `base`: its llama-layout fields."""
    require(hf.hidden_act == "relu2", f"HF hidden_act={hf.hidden_act!r} unsupported (relu2)")
    fields = {"arch": "nemotron", "head_dim": head_dim_field(hf)}
    return ModelConfig(
        **(vars(base) | fields | {"partial_rotary_factor": partial_rotary_factor(hf)})
    )


def nemotron_hf_config(cfg: ModelConfig, d_ff: int, common: dict):
    """NemotronConfig of a ModelConfig; `common`: the llama family's keys (models/hf.py)."""
    from transformers import NemotronConfig

    keys = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "hidden_act")}
    keys["rope_parameters"] = keys["rope_parameters"] | {
        "partial_rotary_factor": cfg.partial_rotary_factor
    }
    return NemotronConfig(
        intermediate_size=d_ff,
        hidden_act="relu2",
        norm_eps=cfg.norm_eps,
        attention_bias=False,
        mlp_bias=False,
        **keys,
    )
