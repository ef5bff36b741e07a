"""HF Mixtral (transformers' MixtralForCausalLM) import and export: logits equal both ways,
exact round trips, the stacked experts under their logical names, one-line refusals."""

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
VOCAB, SEQ = 100, 32


def mixtral(tie: bool = False, seed: int = 0, **kw) -> transformers.MixtralForCausalLM:
    """A small random Mixtral; everything perturbed so that a mixed-up name shows."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**(base | kw)))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_and_back_keep_the_logits(tie, tmp_path):
    hf = mixtral(tie)
    gpt = from_hf(hf)
    cfg = gpt.cfg
    assert (cfg.arch, cfg.n_experts, cfg.top_k, cfg.moe_every) == ("llama", 4, 2, 1)
    assert (cfg.moe_ffn, cfg.moe_capacity_factor, cfg.moe_shared_experts) == (48, 0.0, 0)
    assert gpt.layers["1"].mlp.experts.w_in.shape == (4, 96, 64)
    ids = tokens()
    with torch.no_grad():
        want = hf(ids).logits
        assert rel_error(gpt(ids), want) <= REL
        to_hf(gpt, str(tmp_path))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert type(reloaded) is transformers.MixtralForCausalLM
        assert rel_error(reloaded(ids).logits, want) <= REL


def test_export_of_a_trained_config_and_round_trip(tmp_path):
    cfg = ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=80,
                      vocab_size=VOCAB, seq_len=SEQ, tie_embeddings=False, n_experts=4, top_k=2,
                      moe_ffn=40, moe_aux_coef=0.02, rope_theta=321.0)  # fmt: skip
    gpt = GPT(cfg, seed=3)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = to_hf(gpt, str(tmp_path))
    got = json.loads((tmp_path / "config.json").read_text())
    assert got["model_type"] == "mixtral" and got["num_local_experts"] == 4
    assert got["intermediate_size"] == 40 and got["router_aux_loss_coef"] == 0.02
    ids = tokens(2)
    with torch.no_grad():
        assert rel_error(hf(ids).logits, gpt(ids)) <= REL
    back = dict(from_hf(hf).named_parameters())
    for name, param in gpt.named_parameters():
        assert torch.equal(back[name], param), name


@pytest.mark.parametrize(
    "override,words",
    [
        ({"moe_capacity_factor": 1.0}, "model.moe_capacity_factor > 0"),
        ({"moe_shared_experts": 1}, "model.moe_shared_experts"),
        ({"moe_every": 2}, "model.moe_every != 1"),
    ],
)
def test_unrepresentable_moe_is_a_one_line_error(override, words, tmp_path):
    cfg = ModelConfig(arch="llama", n_layers=2, d_model=32, n_heads=4, vocab_size=VOCAB,
                      seq_len=SEQ, n_experts=4, top_k=2, **override)  # fmt: skip
    with pytest.raises(ValueError, match=words) as err:
        to_hf(GPT(cfg, seed=0), str(tmp_path))
    assert "\n" not in str(err.value)


def test_unsupported_mixtral_field_is_a_one_line_error():
    with pytest.raises(ValueError, match="sliding_window"):
        from_hf(mixtral(sliding_window=8))
