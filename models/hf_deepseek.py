"""Import and export of transformers' DeepseekV3ForCausalLM (model.arch deepseek_v3, tp=1).

Names map as in models/hf.py (ours -> the HF tensors a parameter concatenates). Two differences:
- RoPE's dims: ours rotate halves (models/mla.py); transformers' rope_interleave=true (its
  default) rotates adjacent pairs (x0, x1), (x2, x3), ... Rotating pairs equals rotating halves
  of the de-interleaved vector (x0, x2, ..., x1, x3, ...), and q·k is the same when queries and
  keys are permuted alike, so the import permutes the rope rows of the query projection (per
  head) and of kv_a_proj_with_mqa; the export writes rope_interleave=false and no permutation.
- The routing's selection bias is a buffer (models/routing.py) and maps to transformers'
  `mlp.gate.e_score_correction_bias`.
transformers' model computes no MTP modules (it drops layer num_hidden_layers on load), so
there is nothing of them to import or export.
"""

from __future__ import annotations

import torch

from megapipe.config import ModelConfig
from megapipe.models.gpt import GPT
from megapipe.models.hf_require import require
from megapipe.models.rope import rope_fields

TOP = {
    "embed.tok.weight": ("model.embed_tokens.weight",),
    "head.norm.weight": ("model.norm.weight",),
    "head.out.weight": ("lm_head.weight",),
}
LAYER = {
    "norm1.weight": ("input_layernorm.weight",),
    "attn.q_a.weight": ("self_attn.q_a_proj.weight",),
    "attn.q_norm.weight": ("self_attn.q_a_layernorm.weight",),
    "attn.kv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
    "attn.kv_norm.weight": ("self_attn.kv_a_layernorm.weight",),
    "attn.kv_b.weight": ("self_attn.kv_b_proj.weight",),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "norm2.weight": ("post_attention_layernorm.weight",),
    "mlp.fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.fc2.weight": ("mlp.down_proj.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.routing.bias": ("mlp.gate.e_score_correction_bias",),
    "mlp.experts.w_in": ("mlp.experts.gate_up_proj",),
    "mlp.experts.w_out": ("mlp.experts.down_proj",),
    "mlp.shared.fc1.weight": tuple(f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up")),
    "mlp.shared.fc2.weight": ("mlp.shared_experts.down_proj.weight",),
}


def hf_names(cfg: ModelConfig, name: str) -> tuple[str, ...]:
    if not name.startswith("layers."):
        return TOP[name]
    _, index, leaf = name.split(".", 2)
    if leaf == "attn.q_b.weight":  # the query's up projection, or its only one
        leaf_names = (
            "self_attn.q_b_proj.weight" if cfg.q_lora_rank else "self_attn.q_proj.weight",
        )
    else:
        leaf_names = LAYER[leaf]
    return tuple(f"model.layers.{index}.{n}" for n in leaf_names)


def rope_rows(cfg: ModelConfig, name: str, rows: int) -> torch.Tensor | None:
    """The row order that de-interleaves the rope rows of `name` (rows in all), or None."""
    rope = cfg.qk_rope_head_dim
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    order = torch.arange(rows)
    if name.endswith("attn.kv_a.weight"):
        order[-rope:] = rows - rope + pairs
    elif name.endswith("attn.q_b.weight"):
        qk = cfg.qk_nope_head_dim + rope
        for h in range(rows // qk):
            order[h * qk + cfg.qk_nope_head_dim : (h + 1) * qk] = (
                h * qk + cfg.qk_nope_head_dim + pairs
            )
    else:
        return None
    return order


def config_from_hf(hf) -> ModelConfig:
    """The ModelConfig of an HF DeepseekV3Config; what is not built raises ValueError."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = rope_fields(rope, hf.max_position_embeddings)  # models/rope.py: default, yarn
    require(hf.hidden_act in ("silu", "swish"), f"HF hidden_act={hf.hidden_act!r} unsupported")
    require(not hf.attention_bias, "HF attention_bias=True is unsupported")
    require(not hf.attention_dropout, "HF attention_dropout != 0 is unsupported")
    require(
        hf.num_key_value_heads == hf.num_attention_heads,
        "HF num_key_value_heads must equal num_attention_heads (MLA has no GQA)",
    )
    return ModelConfig(
        arch="deepseek_v3", n_layers=hf.num_hidden_layers, d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads, d_ff=hf.intermediate_size, vocab_size=hf.vocab_size,
        seq_len=hf.max_position_embeddings, tie_embeddings=bool(hf.tie_word_embeddings),
        norm_eps=hf.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 10000.0)),
        q_lora_rank=hf.q_lora_rank or 0, kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim, n_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok,
        moe_ffn=hf.moe_intermediate_size, moe_shared_experts=hf.n_shared_experts, moe_every=1,
        moe_aux_coef=0.0, first_k_dense_replace=hf.first_k_dense_replace,
        n_group=hf.n_group or 1, topk_group=hf.topk_group or 1,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        norm_topk_prob=bool(hf.norm_topk_prob), **scaling,
    )  # fmt: skip


def hf_config(cfg: ModelConfig, common: dict):
    """DeepseekV3Config of a deepseek_v3 ModelConfig; `common`: the llama family's keys."""
    from transformers import DeepseekV3Config

    require(cfg.dropout == 0.0, "model.dropout != 0: HF DeepSeek-V3 has no dropout; set it 0")
    require(cfg.moe_every == 1, "model.moe_every != 1: HF DeepSeek-V3 has none; set it 1")
    require(cfg.moe_capacity_factor == 0, "model.moe_capacity_factor > 0: HF routes dropless")
    keys = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}
    return DeepseekV3Config(
        num_key_value_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.moe_ffn or keys["intermediate_size"],
        n_shared_experts=cfg.moe_shared_experts, first_k_dense_replace=cfg.first_k_dense_replace,
        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor, rope_interleave=False,
        attention_bias=False, num_mtp_layers=0, **keys,
    )  # fmt: skip


def _tensors(gpt: GPT):
    """What maps to transformers' tensors: all but the MTP modules, which it has no place for."""
    yield from ((n, p) for n, p in gpt.named_parameters() if not n.startswith("mtp."))
    for name, buf in gpt.named_buffers():
        if name.endswith("mlp.routing.bias") and not name.startswith("mtp."):
            yield name, buf


@torch.no_grad()
def load_hf(gpt: GPT, model) -> GPT:
    """Copy an HF DeepseekV3ForCausalLM's weights into `gpt` (built from config_from_hf)."""
    cfg, hf_state = gpt.cfg, model.state_dict()
    interleaved = bool(getattr(model.config, "rope_interleave", True))
    for name, tensor in _tensors(gpt):
        names = hf_names(cfg, name)
        value = torch.cat([hf_state[n] for n in names], dim=0)
        order = rope_rows(cfg, name, value.shape[0]) if interleaved else None
        value = value if order is None else value[order]
        require(
            value.shape == tensor.shape, f"HF {names} has shape {value.shape}, not {tensor.shape}"
        )
        tensor.copy_(value)
    return gpt.train(model.training)


@torch.no_grad()
def write_hf(gpt: GPT, model) -> None:
    """Copy `gpt`'s weights into `model` (built from hf_config: rope_interleave=false)."""
    hf = dict(model.named_parameters()) | dict(model.named_buffers())
    written = set()
    for name, tensor in _tensors(gpt):
        names = hf_names(gpt.cfg, name)
        parts = tensor.detach().float().split([hf[n].shape[0] for n in names], dim=0)
        for n, part in zip(names, parts, strict=True):
            require(part.shape == hf[n].shape, f"{name} does not fit HF {n}")
            hf[n].copy_(part)
            written.add(n)
    missing = {n for n, p in model.named_parameters() if n not in written and p.numel()}
    require(not missing, f"HF weights not written: {missing}")
