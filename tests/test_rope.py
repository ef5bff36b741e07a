"""RoPE and YaRN (models/rope.py) against transformers' own functions, at the shapes released
configs carry: DeepSeek-V3's (qk_rope_head_dim 64, theta 1e4, factor 40 over 4096 positions,
mscale = mscale_all_dim = 1) and a long-context Qwen3's (head_dim 128, theta 1e6, factor 4 over
32768); the default tables unchanged; the keys' one-line refusals. Logits against transformers'
models: tests/test_hf_deepseek.py and tests/test_hf_qwen3.py ("yarn" cases)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from megapipe.config import ConfigError, ModelConfig
from megapipe.models.hf_deepseek import config_from_hf as deepseek_config
from megapipe.models.rope import Rope, attention_factor, hf_rope_parameters, softmax_gain
from tests.parity import tiny_config

DEEPSEEK_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096}  # fmt: skip
QWEN3_LONG = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
              "original_max_position_embeddings": 32768}  # fmt: skip
V2_LITE = DEEPSEEK_V3 | {"mscale": 0.707, "mscale_all_dim": 0.5}  # cos/sin's factor != 1 too


def _deepseek(rope: dict) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(rope)
    )


@pytest.mark.parametrize("rope", [DEEPSEEK_V3, V2_LITE], ids=["deepseek_v3", "mscales"])
def test_deepseek_yarn_frequencies_factors_and_softmax_scale(rope):
    hf = _deepseek(rope)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = deepseek_config(hf)
    ours = Rope(cfg, cfg.qk_rope_head_dim)
    torch.testing.assert_close(ours.inv_freq(), want, rtol=1e-6, atol=0)
    assert attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    scale = yarn_apply_mscale(hf.rope_parameters, qk**-0.5)
    assert softmax_gain(cfg) * qk**-0.5 == pytest.approx(scale, rel=1e-12)
    # teeth: YaRN moved the low frequencies and the softmax scale
    default = Rope(ModelConfig(rope_theta=1e4), 64).inv_freq()
    assert (ours.inv_freq() / default).min() == pytest.approx(1 / 40, rel=1e-5)
    assert softmax_gain(cfg) > 1.4


def test_qwen3_yarn_tables_equal_transformers_rotary_embedding():
    hf = transformers.Qwen3Config(head_dim=128, max_position_embeddings=131072,
                                  rope_parameters=dict(QWEN3_LONG))  # fmt: skip
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(hf)
    cfg = ModelConfig(arch="qwen3", head_dim=128, rope_theta=1e6, rope_type="yarn",
                      rope_factor=4.0, original_max_position_embeddings=32768)  # fmt: skip
    positions = torch.tensor([0, 1, 7, 4095, 32767, 100000])
    cos, sin = Rope(cfg, 128).tables(positions)
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-5, atol=1e-5)
    assert cos.abs().max() > 1.1  # m(4) = 1.139 scales the tables
    assert hf_rope_parameters(cfg) == {k: v for k, v in QWEN3_LONG.items()} | {
        "beta_fast": 32.0, "beta_slow": 1.0,
    }  # fmt: skip


def test_default_tables_are_the_plain_formula_bitwise():
    positions = torch.arange(40).view(2, 20)  # per-row positions (document masking)
    cos, sin = Rope(ModelConfig(arch="llama", rope_theta=321.0), 12).tables(positions)
    inv = 1.0 / 321.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12)
    angles = positions.float()[..., None] * inv
    angles = torch.cat([angles, angles], -1).unsqueeze(1)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.rope_factor=4"], "model.rope_factor is read only under model.rope_type=yarn"),
        (["model.rope_type=yarn", "model.rope_factor=4"], "original_max_position_embeddings"),
        (["model.rope_type=ntk"], "model.rope_type='ntk' is not one of default, yarn"),
        (["model.rope_type=yarn", "model.original_max_position_embeddings=8",
          "model.arch=gpt2"], "gpt2 has no RoPE"),
        (["model.rope_type=yarn", "model.original_max_position_embeddings=8",
          "model.beta_fast=0.5"], "model.beta_fast=0.5 must be at least"),
    ],
)  # fmt: skip
def test_bad_rope_config_is_one_line_error(tmp_path, overrides, match):
    base = ["model.arch=llama", "model.tie_embeddings=false"]
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config([*base, *overrides], str(tmp_path))
    assert "\n" not in str(err.value)
