"""HF Qwen3 and Qwen3-MoE (transformers' Qwen3ForCausalLM, Qwen3MoeForCausalLM) import and
export: logits equal both ways at head_dim != d_model / n_heads (and with YaRN), the QK-norm
gains and sparse layers under their logical names, one-line refusals of what the model cannot
compute."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from megapipe.config import ModelConfig
from megapipe.models.gpt import GPT
from megapipe.models.hf import from_hf, to_hf
from tests.util import rel_error

REL = 1e-5  # fp32 round-off of one forward (design.md's parity bound)
VOCAB, SEQ = 100, 32
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            max_position_embeddings=SEQ, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)


def qwen3(moe: bool = False, tie: bool = False, **kw):
    """A small random Qwen3 (or Qwen3-MoE); every weight perturbed (the norm gains too) so
    that a mixed-up name shows."""
    torch.manual_seed(0)
    fields = BASE | {"tie_word_embeddings": tie} | (MOE if moe else {}) | kw
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed))


def round_trip(hf, tmp_path, kind) -> GPT:
    """Import `hf`, compare logits; export, reload with transformers, compare again."""
    gpt = from_hf(hf)
    ids = tokens()
    with torch.no_grad():
        want = hf(ids).logits
        assert rel_error(gpt(ids), want) <= REL
        to_hf(gpt, str(tmp_path))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert type(reloaded) is kind
        assert rel_error(reloaded(ids).logits, want) <= REL
    return gpt


# a long-context Qwen3's YaRN (factor 4 over the pretrained context), scaled down to SEQ
YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}  # fmt: skip


@pytest.mark.parametrize("tie,rope", [(False, None), (True, None), (False, YARN)],
                         ids=["untied", "tied", "yarn"])  # fmt: skip
def test_qwen3_logits_both_ways(tie, rope, tmp_path):
    kw = {"rope_parameters": rope, "max_position_embeddings": 64} if rope else {}
    gpt = round_trip(qwen3(tie=tie, **kw), tmp_path, transformers.Qwen3ForCausalLM)
    assert (gpt.cfg.arch, gpt.cfg.head_dim, gpt.cfg.tie_embeddings) == ("qwen3", 24, tie)
    want = ("yarn", 4.0) if rope else ("default", 1.0)
    assert (gpt.cfg.rope_type, gpt.cfg.rope_factor) == want
    assert gpt.layers["0"].attn.q_norm.weight.shape == (24,)
    assert gpt.layers["0"].attn.qkv.weight.shape == ((4 + 2 * 2) * 24, 64)


@pytest.mark.parametrize("step, norm", [(1, True), (2, False)])
def test_qwen3_moe_logits_both_ways(step, norm, tmp_path):
    hf = qwen3(moe=True, decoder_sparse_step=step, norm_topk_prob=norm, num_hidden_layers=3)
    gpt = round_trip(hf, tmp_path, transformers.Qwen3MoeForCausalLM)
    cfg = gpt.cfg
    assert (cfg.n_experts, cfg.top_k, cfg.moe_ffn, cfg.moe_every) == (4, 2, 40, step)
    assert (cfg.d_ff, cfg.norm_topk_prob) == (48, norm)
    dense = [i for i in range(3) if (i + 1) % step]  # transformers' decoder_sparse_step rule
    assert [i for i in range(3) if hasattr(gpt.layers[str(i)].mlp, "fc1")] == dense


@pytest.mark.parametrize("moe, first", [(False, 1), (True, 0)])
def test_sliding_window_logits_both_ways(moe, first, tmp_path):
    """Qwen3 slides the layers from max_window_layers on, Qwen3-MoE all; a window of 5 keys
    over 32 tokens changes the logits (checked against full attention)."""
    window = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    hf = qwen3(moe=moe, **window)
    kind = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    gpt = round_trip(hf, tmp_path, kind)
    assert (gpt.cfg.sliding_window, gpt.cfg.max_window_layers) == (5, first)
    assert [gpt.layers[str(i)].attn.window for i in range(2)] == [
        5 * (i >= first) for i in range(2)
    ]
    full = GPT(ModelConfig(**(vars(gpt.cfg) | {"sliding_window": 0})))
    full.load_state_dict(gpt.state_dict())
    with torch.no_grad():
        assert rel_error(full(tokens()), gpt(tokens())) > 1e-3


def test_qwen3_without_qk_norm_differs():
    """The QK-norm gains are read: a llama with the same weights gives other logits."""
    gpt = from_hf(qwen3())
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            assert not torch.equal(getattr(gpt.layers["0"].attn, name).weight, torch.ones(24))
        llama = GPT(ModelConfig(**(vars(gpt.cfg) | {"arch": "llama"})))
        llama.load_state_dict(gpt.state_dict(), strict=False)
        ids = tokens()
        assert rel_error(llama(ids), gpt(ids)) > 1e-3


@pytest.mark.parametrize(
    "moe, kw, key",
    [
        (
            False,
            {
                "layer_types": ["sliding_attention", "full_attention"],
                "use_sliding_window": True,
                "sliding_window": 8,
            },
            "layer_types",
        ),  # fmt: skip
        (True, {"mlp_only_layers": [0]}, "mlp_only_layers"),
        (False, {"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_qwen3_fields_are_one_line(moe, kw, key):
    with pytest.raises(ValueError, match=key) as err:
        from_hf(qwen3(moe=moe, **kw))
    assert "\n" not in str(err.value)
