"""HF import/export: logit parity with transformers' GPT-2 and Llama, and exact round trips."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from megapipe.config import Config, ModelConfig
from megapipe.models.gpt import GPT
from megapipe.models.hf import from_hf, to_hf

TOL = 1e-5
VOCAB, SEQ = 100, 32
NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def gpt2_config(**kw) -> transformers.GPT2Config:
    base = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": 96}
    base |= {"vocab_size": VOCAB, "n_positions": SEQ}
    return transformers.GPT2Config(**(base | NO_SPECIAL | kw))


def llama_config(**kw) -> transformers.LlamaConfig:
    base = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-5,
    }
    base |= {"num_attention_heads": 4, "num_key_value_heads": 2}
    base |= {"vocab_size": VOCAB, "max_position_embeddings": SEQ}
    base |= {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    return transformers.LlamaConfig(**(base | NO_SPECIAL | kw))


def hf_model(arch: str, tie: bool, seed: int = 0):
    """A small random HF model; norms and biases perturbed so that a mixed-up name shows."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(gpt2_config(tie_word_embeddings=tie))
    else:
        model = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=tie))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def tokens(batch: int = 3, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


CASES = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)]


@pytest.mark.parametrize("arch,tie", CASES)
def test_from_hf_matches_hf_logits(arch, tie):
    hf = hf_model(arch, tie)
    gpt = from_hf(hf)
    assert not gpt.training
    assert gpt.cfg.arch == arch and gpt.cfg.tie_embeddings == tie
    assert (gpt.cfg.n_kv_heads, gpt.cfg.d_ff) == ((2, 96) if arch == "llama" else (4, 96))
    ids = tokens()
    with torch.no_grad():
        assert max_diff(gpt(ids), hf(ids).logits) <= TOL


def test_from_hf_reads_config_fields():
    cfg = from_hf(hf_model("llama", False)).cfg
    assert (cfg.rope_theta, cfg.norm_eps, cfg.seq_len, cfg.vocab_size) == (500.0, 1e-5, SEQ, VOCAB)
    cfg = from_hf(transformers.GPT2LMHeadModel(gpt2_config(layer_norm_epsilon=1e-3))).cfg
    assert (cfg.norm_eps, cfg.dropout, cfg.n_layers, cfg.d_model) == (1e-3, 0.1, 2, 64)


@pytest.mark.parametrize("arch,tie", CASES)
def test_export_reloads_with_same_logits(arch, tie, tmp_path):
    hf = hf_model(arch, tie)
    gpt = from_hf(hf)
    to_hf(gpt, str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(hf)
    ids = tokens(seed=2)
    with torch.no_grad():
        logits = reloaded(ids).logits
        assert max_diff(logits, hf(ids).logits) <= TOL
        assert max_diff(logits, gpt(ids)) <= TOL


def test_exported_config_fields(tmp_path):
    cfg = ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        vocab_size=VOCAB,
        seq_len=48,
        tie_embeddings=False,
        norm_eps=1e-6,
        rope_theta=321.0,
    )
    to_hf(GPT(cfg, seed=0), str(tmp_path / "llama"))
    got = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert got["num_key_value_heads"] == 2 and got["intermediate_size"] == 96
    assert got["hidden_act"] == "silu" and got["rms_norm_eps"] == 1e-6
    assert got["max_position_embeddings"] == 48 and got["tie_word_embeddings"] is False
    assert got["rope_parameters"]["rope_theta"] == 321.0
    cfg = ModelConfig(arch="gpt2", d_ff=0, dropout=0.2, tie_embeddings=True, vocab_size=VOCAB)
    to_hf(GPT(cfg, seed=0), str(tmp_path / "gpt2"))
    got = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert got["n_inner"] == 4 * cfg.d_model and got["activation_function"] == "gelu_new"
    assert got["resid_pdrop"] == got["embd_pdrop"] == got["attn_pdrop"] == 0.2
    assert got["tie_word_embeddings"] is True and got["n_positions"] == cfg.seq_len


@pytest.mark.parametrize("arch,tie", CASES)
def test_round_trip_gives_identical_parameters(arch, tie, tmp_path):
    cfg = ModelConfig(
        arch=arch,
        n_layers=2,
        d_model=64,
        n_heads=4,
        vocab_size=VOCAB,
        seq_len=SEQ,
        tie_embeddings=tie,
        n_kv_heads=2 if arch == "llama" else 0,
        dropout=0.1 if arch == "gpt2" else 0.0,
        norm_eps=1e-6,
        rope_theta=777.0,
    )
    gpt = GPT(cfg, seed=7).eval()
    with torch.no_grad():  # init has zero biases and unit norms: make every tensor distinct
        for param in gpt.parameters():
            param.add_(0.05 * torch.randn_like(param))
    to_hf(gpt, str(tmp_path))
    back = from_hf(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    ours, theirs = dict(gpt.named_parameters()), dict(back.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name
    d, d_back = Config(model=cfg).derived, Config(model=back.cfg).derived
    assert (d.n_kv_heads, d.d_ff) == (d_back.n_kv_heads, d_back.d_ff)
    for field in (
        "arch",
        "n_layers",
        "d_model",
        "n_heads",
        "vocab_size",
        "seq_len",
        "tie_embeddings",
        "dropout",
        "norm_eps",
    ):
        assert getattr(back.cfg, field) == getattr(cfg, field), field
    if arch == "llama":
        assert back.cfg.rope_theta == cfg.rope_theta
    ids = tokens(seed=3)
    with torch.no_grad():
        assert max_diff(back(ids), gpt(ids)) <= TOL


UNSUPPORTED = [
    (lambda: gpt2_config(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (lambda: gpt2_config(activation_function="relu"), "activation_function"),
    (lambda: gpt2_config(attn_pdrop=0.0), "attn_pdrop"),
    (lambda: llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    (lambda: llama_config(attention_bias=True), "attention_bias"),
    (lambda: llama_config(mlp_bias=True), "mlp_bias"),
    (lambda: llama_config(hidden_act="gelu"), "hidden_act"),
]


@pytest.mark.parametrize("make_config,field", UNSUPPORTED)
def test_unsupported_hf_config_is_a_one_line_error(make_config, field):
    config = make_config()
    cls = (
        transformers.GPT2LMHeadModel
        if config.model_type == "gpt2"
        else transformers.LlamaForCausalLM
    )
    with pytest.raises(ValueError, match=field) as err:
        from_hf(cls(config))
    assert "\n" not in str(err.value)


def test_base_model_without_lm_head_is_rejected():
    with pytest.raises(ValueError, match="lm_head"):
        from_hf(transformers.GPT2Model(gpt2_config()))


@pytest.mark.parametrize(
    "cfg,field",
    [
        (ModelConfig(arch="gpt2", n_heads=4, n_kv_heads=2), "n_kv_heads"),
        (ModelConfig(arch="llama", dropout=0.1), "dropout"),
    ],
)
def test_unrepresentable_model_config_is_a_one_line_error(cfg, field, tmp_path):
    with pytest.raises(ValueError, match=field) as err:
        to_hf(GPT(cfg, seed=0), str(tmp_path))
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_export_needs_the_whole_model(tmp_path):
    stage = GPT(ModelConfig(arch="llama", tie_embeddings=False), blocks=range(2))
    with pytest.raises(ValueError, match="blocks"):
        to_hf(stage, str(tmp_path))
