"""HF DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) import and export (models/hf_deepseek.py):
logits equal both ways, with and without a query LoRA, interleaved and plain RoPE, YaRN, grouped
routing with a nonzero selection bias, shared experts and a first dense layer; exact round
trips; one-line refusals."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from megapipe.config import ModelConfig
from megapipe.models.gpt import GPT
from megapipe.models.hf import from_hf, to_hf
from tests.util import rel_error

REL = 1e-5
VOCAB, SEQ = 100, 24


def deepseek(seed: int = 0, **kw) -> transformers.DeepseekV3ForCausalLM:
    """A small random DeepSeek-V3; every weight and the selection bias perturbed so that a
    mixed-up name or a forgotten permutation shows."""
    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=56, moe_intermediate_size=20,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.7,
                kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10,
                v_head_dim=14, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None, num_mtp_layers=0)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**(base | kw)))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


# YaRN as DeepSeek-V3 configs carry it, mscale != mscale_all_dim so that both the cos/sin factor
# and the softmax's m(s, mscale_all_dim)² differ from 1 (models/rope.py)
YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "beta_fast": 8.0,
                            "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.7},
        "max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [{}, {"q_lora_rank": None}, {"rope_interleave": False, "norm_topk_prob": False}, YARN],
    ids=["q-lora", "no-q-lora", "plain-rope", "yarn"],
)
def test_from_hf_and_back_keep_the_logits(kw, tmp_path):
    hf = deepseek(**kw)
    gpt = from_hf(hf)
    cfg = gpt.cfg
    assert (cfg.arch, cfg.n_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == (
        "deepseek_v3", 8, 3, 4, 2,
    )  # fmt: skip
    assert cfg.q_lora_rank == (0 if "q_lora_rank" in kw else 20)
    assert not hasattr(gpt.layers["0"].mlp, "router")  # the first layer dense
    bias = gpt.layers["2"].mlp.routing.bias
    assert torch.equal(bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)
    ids = tokens()
    with torch.no_grad():
        want = hf(ids).logits
        assert rel_error(gpt(ids), want) <= REL
        to_hf(gpt, str(tmp_path))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert type(reloaded) is transformers.DeepseekV3ForCausalLM
        assert rel_error(reloaded(ids).logits, want) <= REL


def test_the_selection_bias_changes_the_experts_not_the_gates():
    """A bias large enough to flip choices changes the logits (so the bias is read), and
    ours follow transformers' with it."""
    hf = deepseek(seed=2)
    ids = tokens(3)
    with torch.no_grad():
        before = hf(ids).logits
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
        after = hf(ids).logits
        assert rel_error(after, before) > 1e-3
        assert rel_error(from_hf(hf)(ids), after) <= REL


def test_export_of_a_trained_config_and_round_trip(tmp_path):
    cfg = ModelConfig(arch="deepseek_v3", n_layers=2, d_model=32, n_heads=2, d_ff=40,
                      vocab_size=VOCAB, seq_len=SEQ, tie_embeddings=False, n_experts=4, top_k=2,
                      moe_ffn=16, moe_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=8,
                      kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                      first_k_dense_replace=1, routed_scaling_factor=2.5,
                      mtp_layers=1)  # fmt: skip
    gpt = GPT(cfg, seed=3)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
        gpt.layers["1"].mlp.routing.bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    hf = to_hf(gpt, str(tmp_path))
    got = json.loads((tmp_path / "config.json").read_text())
    assert got["model_type"] == "deepseek_v3" and got["n_routed_experts"] == 4
    assert got["rope_interleave"] is False and got["first_k_dense_replace"] == 1
    ids = tokens(2)
    with torch.no_grad():
        assert rel_error(hf(ids).logits, gpt(ids)) <= REL
    back = from_hf(hf)
    assert back.mtp is None  # transformers keeps no MTP modules: export leaves ours out
    for name, param in back.named_parameters():
        assert torch.equal(dict(gpt.named_parameters())[name], param), name
    assert torch.equal(back.layers["1"].mlp.routing.bias, gpt.layers["1"].mlp.routing.bias)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
         "rope_scaling type 'linear'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ],
)  # fmt: skip
def test_unsupported_hf_fields_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        from_hf(deepseek(**kw))
    assert "\n" not in str(err.value)
