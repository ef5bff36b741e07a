"""What each model.arch is built from, in one table: the model (models/gpt.py, attention.py)
and the plans (FLOPs, memory, time) read these traits, never the arch's name.

- gpt2 (Radford et al. 2019): LayerNorm, tanh GeLU, learned positions, biases.
- llama (Touvron et al. 2023): RMSNorm, SwiGLU, RoPE, no biases; qwen3 and deepseek_v3 are
  llama's traits with QK-norm (models/qk_norm.py) and latent attention (models/mla.py).
- nemotron (Nemotron-4, Parmar et al. 2024 §2): LayerNorm1p (LayerNorm whose gain is held
  zero-centred, 1 + w: Megatron's apply_layernorm_1p, transformers' NemotronLayerNorm1P),
  squared ReLU (So et al. 2021, Primer) in an MLP of two matrices, RoPE on a fraction of each
  head (model.partial_rotary_factor), no biases in the linears (the norms keep theirs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    norm: str  # layernorm | rmsnorm | layernorm1p
    mlp: str  # gelu (tanh) | swiglu (fc1 = [gate | up]) | relu2 (squared ReLU)
    rope: bool  # RoPE on q and k; else learned absolute positions added in the embedding
    biases: bool  # the linears carry biases

    @property
    def gated(self) -> bool:
        """A gated MLP: fc1 is [gate | up], three matrices a layer."""
        return self.mlp == "swiglu"

    @property
    def learned_positions(self) -> bool:
        return not self.rope

    @property
    def rms(self) -> bool:
        """RMSNorm: no mean, no bias (else a LayerNorm with bias)."""
        return self.norm == "rmsnorm"


_LLAMA = Arch(norm="rmsnorm", mlp="swiglu", rope=True, biases=False)
ARCHS: dict[str, Arch] = {
    "gpt2": Arch(norm="layernorm", mlp="gelu", rope=False, biases=True),
    "llama": _LLAMA,
    "qwen3": _LLAMA,
    "deepseek_v3": _LLAMA,
    "nemotron": Arch(norm="layernorm1p", mlp="relu2", rope=True, biases=False),
}


def arch_of(name: str) -> Arch:
    """The traits of model.arch `name` (checked against ARCHS by config/checks.py)."""
    return ARCHS[name]


def rotary_dims(m, head_dim: int) -> int:
    """The dims of a head RoPE rotates, the first ones: model.partial_rotary_factor of
    `head_dim`, truncated as transformers does (`m`: a ModelConfig)."""
    return int(head_dim * m.partial_rotary_factor)
