"""Rotary position embedding (RoPE, Su et al. 2021) and YaRN's context extension of it
(Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"),
model.rope_type: default | yarn.

`Rope` is built once per attention layer from the model config and the rotated width, and gives
the cos/sin tables of a step's positions (models/attention.py, models/mla.py). Positions shared
by every row (the run's T/cp positions, or a Seq1F1B segment's slice of them) give tables made
once per process and read by every layer, chunk and microbatch (`SharedTables`), as Megatron-Core
caches its rotary frequencies (RotaryEmbedding.forward's lru_cache): autograd keeps the one pair
where each layer's own would be kept for every microbatch in flight. Per-row positions
(document masking) differ per microbatch and are made per call.

YaRN (Sec. 3.2, "NTK-by-parts"; Sec. 3.4, the temperature), with s = model.rope_factor and
L = model.original_max_position_embeddings, the context the model was pretrained on:
- Each frequency θ_i = theta^(-2i/|D|) is kept (extrapolated), divided by s (interpolated), or
  mixed linearly between, by how many turns its wavelength makes over L: dimension pairs that
  turn more than beta_fast times over L keep θ_i, those turning fewer than beta_slow times take
  θ_i / s. The ramp runs over the pair index i between the two boundary dimensions
  d(r) = |D| ln(L / (2π r)) / (2 ln theta), rounded outwards (floor, ceil) and clipped to
  [0, |D| − 1], as the authors' code and transformers' `_compute_yarn_parameters` take it.
- The softmax temperature √(1/t) = 0.1 ln s + 1 (Sec. 3.4) multiplies cos and sin, so every
  rotated q·k product is scaled by its square. With model.mscale and model.mscale_all_dim both
  set (DeepSeek-V2/V3's configs) the factor is m(s, mscale) / m(s, mscale_all_dim), with
  m(s, k) = 0.1 k ln s + 1; model.rope_attention_factor > 0 replaces it.
- DeepSeek-V3's attention (transformers' DeepseekV3Attention, `yarn_apply_mscale`) also
  multiplies the softmax scale 1/√(qk width) by m(s, mscale_all_dim)², on every query dim, the
  rope-free ones too: `softmax_gain` (models/mla.py applies it to the query). Qwen3 and Llama
  keep 1/√head_dim (transformers' Qwen3Attention.scaling).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from megapipe._torch_compat import view_base
from megapipe.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """m(s, k) = 0.1 k ln s + 1 for s > 1, else 1 (YaRN Sec. 3.4; DeepSeek-V2's mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(m: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for default RoPE)."""
    if m.rope_type != "yarn":
        return 1.0
    if m.rope_attention_factor > 0:
        return m.rope_attention_factor
    if m.mscale and m.mscale_all_dim:
        return yarn_mscale(m.rope_factor, m.mscale) / yarn_mscale(m.rope_factor, m.mscale_all_dim)
    return yarn_mscale(m.rope_factor)


def softmax_gain(m: ModelConfig) -> float:
    """DeepSeek-V3's extra softmax scale under YaRN: m(s, mscale_all_dim)² (1: none)."""
    if m.rope_type != "yarn" or not m.mscale_all_dim:
        return 1.0
    return yarn_mscale(m.rope_factor, m.mscale_all_dim) ** 2


def _boundary(turns: float, dim: int, theta: float, context: int) -> float:
    """The dimension whose wavelength makes `turns` turns over `context` positions."""
    return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(m: ModelConfig, dim: int) -> torch.Tensor:
    """NTK-by-parts inverse frequencies (dim/2,) float32 (YaRN Sec. 3.2)."""
    L, s = m.original_max_position_embeddings, m.rope_factor
    low = max(math.floor(_boundary(m.beta_fast, dim, m.rope_theta, L)), 0)
    high = min(math.ceil(_boundary(m.beta_slow, dim, m.rope_theta, L)), dim - 1)
    high = high if high != low else high + 0.001  # one boundary: a step, not 0/0
    theta = 1.0 / m.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    # 1 below `low` (fast pairs: extrapolated), 0 above `high` (slow pairs: interpolated)
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return theta / s * (1 - keep) + theta * keep


class SharedTables:
    """cos, sin per (positions, RoPE) made once and handed to every caller: keyed by the
    positions' base tensor (held here, so its identity stays its own), their place in it and
    the RoPE's own key; the newest `size` entries are kept (a run has one, or one per Seq1F1B
    segment, plus validation's and generation's)."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()

    def get(self, positions: torch.Tensor, rope_key: tuple, make) -> tuple:
        base = view_base(positions)
        base = positions if base is None else base
        key = (id(base), positions.storage_offset(), tuple(positions.shape),
               positions.stride(), positions.device, rope_key)  # fmt: skip
        if key not in self.entries:
            tables = make(positions)
            for t in tables:  # activation offload leaves them in place (parallel/recompute.py)
                t.kept_in_place = True
            self.entries[key] = (base, tables)
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return self.entries[key][1]


SHARED_TABLES = SharedTables()


class Rope:
    """The RoPE of one attention layer: `tables(positions)` gives its cos, sin."""

    def __init__(self, m: ModelConfig, dim: int) -> None:
        self.cfg, self.dim = m, dim
        self.scale = attention_factor(m)
        # what the tables depend on besides the positions
        rope = (m.rope_type, m.rope_theta, m.rope_factor, m.original_max_position_embeddings)
        self.key = (dim, self.scale, *rope, m.beta_fast, m.beta_slow)

    def inv_freq(self) -> torch.Tensor:
        """(dim/2,) float32; made per call, as plain tensors of the caller's mode (fake, meta)."""
        if self.cfg.rope_type == "yarn":
            return yarn_inv_freq(self.cfg, self.dim)
        return 1.0 / self.cfg.rope_theta ** (
            torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
        )

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, dim) for positions (T,), made once and shared (module
        docstring; made anew inside a compiled graph), or (b, 1, T, dim) for per-row positions
        (b, T) (document masking restarts them per document) (RoPE eq. 34)."""
        made_apart = torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
        if positions.dim() > 1 or made_apart:
            return self._tables(positions)
        return SHARED_TABLES.get(positions, self.key, self._tables)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq()  # ([b,] T, dim/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, dim): HF Llama's rotate-half layout
        if angles.dim() == 3:  # (b, T, dim) -> (b, 1, T, dim): one row's positions, all heads
            angles = angles.unsqueeze(1)
        if self.scale == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.scale, angles.sin() * self.scale


def rope_fields(rope: dict, max_positions: int) -> dict:
    """ModelConfig fields of transformers' rope_parameters (rope_scaling) dict; ValueError for
    what is not built. `max_positions`: the config's max_position_embeddings."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(
            f"HF rope_parameters/rope_scaling type {kind!r} unsupported (default, yarn are built)"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("HF partial_rotary_factor != 1 is unsupported")
    fields = {"rope_type": kind}
    if kind == "default":
        return fields
    if rope.get("truncate", True) is False:
        raise ValueError("HF rope_parameters truncate=false is unsupported (yarn rounds outwards)")
    original = int(rope.get("original_max_position_embeddings") or max_positions)
    factor = rope.get("factor") or max_positions / original  # transformers' own fallback
    return fields | {
        "rope_factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        "mscale": float(rope.get("mscale") or 0.0),
        "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
    }


def hf_rope_parameters(m: ModelConfig) -> dict:
    """transformers' rope_parameters of a ModelConfig (what rope_fields reads back)."""
    params = {"rope_type": m.rope_type, "rope_theta": m.rope_theta}
    if m.rope_type != "yarn":
        return params
    params |= {
        "factor": m.rope_factor,
        "original_max_position_embeddings": m.original_max_position_embeddings,
        "beta_fast": m.beta_fast,
        "beta_slow": m.beta_slow,
    }
    optional = {"mscale": m.mscale, "mscale_all_dim": m.mscale_all_dim}
    optional["attention_factor"] = m.rope_attention_factor
    return params | {k: v for k, v in optional.items() if v}
