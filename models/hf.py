"""Import and export of Hugging Face GPT-2, Llama, Mixtral, Qwen3, Qwen3-MoE and Nemotron causal
LMs (the whole model, tp=1; Qwen3's and Nemotron's tables and configs in models/hf_qwen3.py and
models/hf_nemotron.py).

Weights move by name through one table per architecture: our logical name -> the HF names whose
tensors it holds. A fused tensor of ours (q|k|v, gate|up) is the row-wise concatenation of several
HF tensors; GPT-2's Conv1D weights are stored as [in, out] and are transposed on the way.
Mixtral (transformers' MixtralForCausalLM) is the llama table with each MLP a mixture of experts
(models/moe.py): its router `mlp.gate`, and the stacked experts `mlp.experts.gate_up_proj`
(E, 2f, d: [gate | up], as our `w_in`) and `down_proj` (E, d, f, as our `w_out`), same layout.
A config either side cannot represent exactly is a one-line ValueError naming the field.
"""

from __future__ import annotations

import torch

from megapipe.config import Config, ModelConfig
from megapipe.config.flops import expert_ffn
from megapipe.models import hf_deepseek
from megapipe.models.gpt import GPT
from megapipe.models.hf_nemotron import (
    NEMOTRON_LAYER,
    NEMOTRON_TOP,
    nemotron_config,
    nemotron_hf_config,
)
from megapipe.models.hf_qwen3 import (
    QWEN3_EXPERTS,
    QWEN3_QK_NORMS,
    QWEN3_TYPES,
    qwen3_config,
    qwen3_hf_config,
)
from megapipe.models.hf_require import require
from megapipe.models.rope import hf_rope_parameters, rope_fields

# Ours -> HF names, outside and inside a transformer layer (`layers.{i}.` <-> prefix + `{i}.`).
GPT2_TOP = {
    "embed.tok.weight": ("transformer.wte.weight",),
    "embed.pos.weight": ("transformer.wpe.weight",),
    "head.norm.weight": ("transformer.ln_f.weight",),
    "head.norm.bias": ("transformer.ln_f.bias",),
    "head.out.weight": ("lm_head.weight",),
}
GPT2_LAYER = {
    "norm1.weight": ("ln_1.weight",),
    "norm1.bias": ("ln_1.bias",),
    "attn.qkv.weight": ("attn.c_attn.weight",),  # Conv1D [d, 3d], columns q|k|v
    "attn.qkv.bias": ("attn.c_attn.bias",),
    "attn.proj.weight": ("attn.c_proj.weight",),
    "attn.proj.bias": ("attn.c_proj.bias",),
    "norm2.weight": ("ln_2.weight",),
    "norm2.bias": ("ln_2.bias",),
    "mlp.fc1.weight": ("mlp.c_fc.weight",),
    "mlp.fc1.bias": ("mlp.c_fc.bias",),
    "mlp.fc2.weight": ("mlp.c_proj.weight",),
    "mlp.fc2.bias": ("mlp.c_proj.bias",),
}
LLAMA_TOP = {
    "embed.tok.weight": ("model.embed_tokens.weight",),
    "head.norm.weight": ("model.norm.weight",),
    "head.out.weight": ("lm_head.weight",),
}
LLAMA_LAYER = {
    "norm1.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "norm2.weight": ("post_attention_layernorm.weight",),
    "mlp.fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.fc2.weight": ("mlp.down_proj.weight",),
}
MIXTRAL_LAYER = {
    **{k: v for k, v in LLAMA_LAYER.items() if not k.startswith("mlp.")},
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.experts.w_in": ("mlp.experts.gate_up_proj",),
    "mlp.experts.w_out": ("mlp.experts.down_proj",),
}
QWEN3_LAYER = LLAMA_LAYER | QWEN3_QK_NORMS  # models/hf_qwen3.py
TABLES = {
    "gpt2": (GPT2_TOP, GPT2_LAYER, "transformer.h."),
    "llama": (LLAMA_TOP, LLAMA_LAYER, "model.layers."),
    "mixtral": (LLAMA_TOP, MIXTRAL_LAYER, "model.layers."),
    "qwen3": (LLAMA_TOP, QWEN3_LAYER, "model.layers."),
    "qwen3_moe": (LLAMA_TOP, QWEN3_LAYER | QWEN3_EXPERTS, "model.layers."),
    "nemotron": (NEMOTRON_TOP, NEMOTRON_LAYER, "model.layers."),
}
GPT2_CONV1D = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")
GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def table_of(cfg: ModelConfig) -> str:
    """Which name table a model uses: its arch, or mixtral for a llama mixture of experts."""
    if cfg.arch == "qwen3":
        return "qwen3_moe" if cfg.n_experts else "qwen3"
    return "mixtral" if cfg.n_experts else cfg.arch


def hf_names(arch: str, name: str) -> tuple[tuple[str, ...], bool]:
    """The HF names that our parameter `name` concatenates, and whether they are transposed
    (`arch`: a TABLES key, table_of(cfg))."""
    top, layer, prefix = TABLES[arch]
    if not name.startswith("layers."):
        return top[name], False
    _, index, leaf = name.split(".", 2)
    return tuple(
        f"{prefix}{index}.{n}" for n in layer[leaf]
    ), arch == "gpt2" and leaf in GPT2_CONV1D


# ---------------------------------------------------------------- import


def config_from_hf(hf) -> ModelConfig:
    """The ModelConfig of an HF GPT2Config or LlamaConfig; unsupported fields raise ValueError."""
    kind = getattr(hf, "model_type", None)
    if kind == "gpt2":
        return _gpt2_config(hf)
    if kind == "llama":
        return _llama_config(hf)
    if kind == "mixtral":
        return _mixtral_config(hf)
    if kind == "deepseek_v3":
        return hf_deepseek.config_from_hf(hf)
    if kind in QWEN3_TYPES:
        return qwen3_config(hf, _llama_config(hf, any_head_dim=True))
    if kind == "nemotron":
        base = _llama_layout(hf, True, float(hf.norm_eps), partial_rope=True)
        return nemotron_config(hf, base)
    raise ValueError(
        f"HF model_type {kind!r} is not supported; use a gpt2, llama, mixtral, qwen3, "
        "qwen3_moe, nemotron or deepseek_v3 model"
    )


def _mixtral_config(hf) -> ModelConfig:
    """Llama's fields, every layer's MLP a dropless mixture of experts (models/moe.py)."""
    require(hf.sliding_window is None, "HF sliding_window is unsupported; set it None")
    require(not hf.router_jitter_noise, "HF router_jitter_noise != 0 is unsupported")
    base = _llama_config(hf)
    moe = {"n_experts": hf.num_local_experts, "top_k": hf.num_experts_per_tok, "moe_every": 1}
    moe |= {"moe_ffn": hf.intermediate_size, "moe_aux_coef": float(hf.router_aux_loss_coef)}
    return ModelConfig(**(vars(base) | moe))


def _gpt2_config(hf) -> ModelConfig:
    act = hf.activation_function
    require(act in GPT2_TANH_GELUS, f"HF activation_function={act!r} unsupported (tanh GELU only)")
    require(hf.scale_attn_weights, "HF scale_attn_weights=False is unsupported")
    require(
        not hf.scale_attn_by_inverse_layer_idx, "HF scale_attn_by_inverse_layer_idx unsupported"
    )
    require(not hf.add_cross_attention, "HF add_cross_attention=True is unsupported")
    drops = {hf.resid_pdrop, hf.embd_pdrop, hf.attn_pdrop}
    require(len(drops) == 1, "HF resid_pdrop, embd_pdrop, attn_pdrop must be equal (one dropout)")
    return ModelConfig(
        arch="gpt2",
        n_layers=hf.n_layer,
        d_model=hf.n_embd,
        n_heads=hf.n_head,
        n_kv_heads=hf.n_head,
        d_ff=hf.n_inner or 4 * hf.n_embd,
        vocab_size=hf.vocab_size,
        seq_len=hf.n_positions,
        tie_embeddings=bool(hf.tie_word_embeddings),
        dropout=float(drops.pop()),
        norm_eps=hf.layer_norm_epsilon,
    )


def _llama_config(hf, any_head_dim: bool = False) -> ModelConfig:
    require(hf.hidden_act in ("silu", "swish"), f"HF hidden_act={hf.hidden_act!r} unsupported")
    return _llama_layout(hf, any_head_dim, norm_eps=hf.rms_norm_eps)


def _llama_layout(
    hf, any_head_dim: bool, norm_eps: float, partial_rope: bool = False
) -> ModelConfig:
    """The fields of Llama's layout (its shapes, RoPE, no biases); `partial_rope`: the caller
    reads partial_rotary_factor itself (else one below 1 is refused)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if partial_rope:
        rope.pop("partial_rotary_factor", None)
    scaling = rope_fields(rope, hf.max_position_embeddings)  # models/rope.py: default, yarn
    require(not getattr(hf, "attention_bias", False), "HF attention_bias=True is unsupported")
    require(not getattr(hf, "mlp_bias", False), "HF mlp_bias=True is unsupported")
    require(not hf.attention_dropout, "HF attention_dropout != 0 is unsupported")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    require(
        any_head_dim or head_dim * hf.num_attention_heads == hf.hidden_size,
        f"HF head_dim={head_dim} must be hidden_size / num_attention_heads",
    )
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    return ModelConfig(
        arch="llama",
        n_layers=hf.num_hidden_layers,
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        d_ff=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        seq_len=hf.max_position_embeddings,  # sets no weights for llama; crops the sampling context
        tie_embeddings=bool(hf.tie_word_embeddings),
        dropout=0.0,
        norm_eps=norm_eps,
        rope_theta=float(theta),
        **scaling,
    )


@torch.no_grad()
def from_hf(model) -> GPT:
    """A GPT with the config and weights of an HF GPT2LMHeadModel or LlamaForCausalLM."""
    require(
        hasattr(model, "lm_head"), f"{type(model).__name__} has no lm_head; pass a *ForCausalLM"
    )
    cfg = config_from_hf(model.config)
    gpt = GPT(cfg)
    if cfg.arch == "deepseek_v3":
        return hf_deepseek.load_hf(gpt, model)
    hf_state = model.state_dict()
    for name, param in gpt.named_parameters():
        names, transpose = hf_names(table_of(cfg), name)
        parts = [hf_state[n].t() if transpose else hf_state[n] for n in names]
        value = torch.cat(parts, dim=0)
        require(
            value.shape == param.shape, f"HF {names} has shape {value.shape}, not {param.shape}"
        )
        param.copy_(value)
    return gpt.train(model.training)


# ---------------------------------------------------------------- export


def hf_config(cfg: ModelConfig, eos_id: int | None = None):
    """The transformers config of a ModelConfig; fields HF cannot represent raise ValueError."""
    from transformers import GPT2Config, LlamaConfig

    d = Config(model=cfg).derived
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings}
    common |= {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": None}
    if cfg.arch == "gpt2":
        require(d.n_kv_heads == cfg.n_heads, "model.n_kv_heads != n_heads: GPT-2 has no GQA")
        return GPT2Config(
            n_positions=cfg.seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=d.d_ff,
            activation_function="gelu_new",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps,
            **common,
        )
    require(
        cfg.arch in ("llama", "qwen3", "deepseek_v3", "nemotron"),
        f"model.arch={cfg.arch!r} has no HF export",
    )
    require(
        cfg.arch == "qwen3" or not cfg.sliding_window,
        "model.sliding_window: only the qwen3 export carries it; set it 0",
    )
    require(cfg.dropout == 0.0, "model.dropout != 0: HF Llama has no residual dropout; set it 0")
    require(
        cfg.arch == "nemotron" or cfg.partial_rotary_factor == 1.0,
        "model.partial_rotary_factor: only the nemotron export carries it; set it 1",
    )
    common |= {
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": d.n_kv_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "attention_dropout": 0.0,
        "rope_parameters": hf_rope_parameters(cfg),
    }
    if cfg.arch == "deepseek_v3":
        return hf_deepseek.hf_config(cfg, common | {"intermediate_size": d.d_ff})
    if cfg.arch == "qwen3":
        return qwen3_hf_config(cfg, expert_ffn(cfg, d.d_ff), d.d_ff, common)
    if cfg.arch == "nemotron":
        return nemotron_hf_config(cfg, d.d_ff, common)
    if cfg.n_experts:
        return _mixtral_hf_config(cfg, d, common)
    return LlamaConfig(intermediate_size=d.d_ff, attention_bias=False, mlp_bias=False, **common)


def _mixtral_hf_config(cfg: ModelConfig, d, common: dict):
    """MixtralConfig of a llama mixture of experts: every layer MoE, dropless, no shared
    experts (what Mixtral computes); `common`: the llama family's keys."""
    from transformers import MixtralConfig

    require(cfg.moe_every == 1, "model.moe_every != 1: every Mixtral layer is MoE; set it 1")
    require(cfg.moe_shared_experts == 0, "model.moe_shared_experts: Mixtral has none; set 0")
    require(cfg.norm_topk_prob, "model.norm_topk_prob=false: Mixtral renormalises; set it true")
    require(
        cfg.moe_capacity_factor == 0,
        "model.moe_capacity_factor > 0: Mixtral routes dropless; set it 0 to export",
    )
    return MixtralConfig(
        intermediate_size=expert_ffn(cfg, d.d_ff),
        sliding_window=None,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.moe_aux_coef,
        router_jitter_noise=0.0,
        **common,
    )


def _check_whole(gpt: GPT) -> None:
    n_blocks = gpt.cfg.n_layers + 2
    require(gpt.blocks == range(n_blocks), f"to_hf needs all {n_blocks} blocks, not {gpt.blocks}")
    require(gpt.embed.tok.tp.size == 1, "to_hf needs the tp=1 model; gather the shards first")


@torch.no_grad()
def to_hf(gpt: GPT, out_dir: str, eos_id: int | None = None):
    """Write `gpt` as an HF checkpoint (config.json + model.safetensors); returns the HF model."""
    from transformers import AutoModelForCausalLM

    _check_whole(gpt)
    cfg = gpt.cfg
    model = AutoModelForCausalLM.from_config(hf_config(cfg, eos_id), dtype=torch.float32)
    if cfg.arch == "deepseek_v3":
        hf_deepseek.write_hf(gpt, model)
        model.eval().save_pretrained(out_dir)
        return model
    hf_params = dict(model.named_parameters())  # a tied lm_head is listed once, as the embedding
    written = set()
    for name, param in gpt.named_parameters():
        names, transpose = hf_names(table_of(cfg), name)
        value = param.detach().float()
        sizes = [hf_params[n].shape[-1 if transpose else 0] for n in names]
        for n, part in zip(names, value.split(sizes, dim=0), strict=True):
            part = part.t() if transpose else part
            require(part.shape == hf_params[n].shape, f"{name} does not fit HF {n}")
            hf_params[n].copy_(part)
            written.add(n)
    require(written == set(hf_params), f"HF weights not written: {set(hf_params) - written}")
    model.eval().save_pretrained(out_dir)
    return model
