"""model.arch=nemotron (Nemotron-4's layout, config/archs.py) and its HF twin (transformers'
NemotronForCausalLM): logits equal both ways with partial RoPE, LayerNorm1P's zero-centred
gains and squared ReLU; each of those traits is read (dropping one changes the logits); a
fake tp2 rank's FLOPs are the plan's and the dry run's parameters the model's; one-line
refusals. (Parity with one process: test_parity_tp_dp; saved bytes: test_memory_model.)"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from megapipe.config import ModelConfig
from megapipe.config.checks import validate
from megapipe.config.load import load_config
from megapipe.models.gpt import GPT
from megapipe.models.hf import from_hf
from megapipe.train.dry_run import as_json
from megapipe.train.fake_ranks import fake_ranks
from tests.conftest import TINY
from tests.test_hf_qwen3 import SEQ, VOCAB, round_trip, tokens
from tests.util import rel_error

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip


def rope(fraction: float) -> dict:
    return {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": fraction}


def nemotron(fraction: float = 0.5, tie: bool = False, **kw):
    """A small random Nemotron; every weight perturbed (the norms' offsets and biases too, which
    start at 0) so that a mixed-up name shows."""
    torch.manual_seed(0)
    fields = BASE | {"tie_word_embeddings": tie, "rope_parameters": rope(fraction)} | kw
    model = transformers.NemotronForCausalLM(transformers.NemotronConfig(**fields))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


@pytest.mark.parametrize("fraction,tie", [(0.5, False), (0.25, True), (1.0, False)])
def test_nemotron_logits_both_ways(fraction, tie, tmp_path):
    gpt = round_trip(nemotron(fraction, tie), tmp_path, transformers.NemotronForCausalLM)
    assert (gpt.cfg.arch, gpt.cfg.partial_rotary_factor) == ("nemotron", fraction)
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert reloaded.rope_parameters["partial_rotary_factor"] == fraction


@pytest.mark.parametrize(
    "change",
    [{"partial_rotary_factor": 1.0}, {"arch": "gpt2", "partial_rotary_factor": 1.0}],
    ids=["whole-rope", "gpt2"],
)
def test_each_nemotron_trait_is_read(change):
    """The same weights with RoPE on the whole head, or as gpt2 (LayerNorm's plain gain, GeLU,
    learned positions from their init), give other logits."""
    gpt = from_hf(nemotron())
    other = GPT(ModelConfig(**(vars(gpt.cfg) | change)))
    other.load_state_dict(gpt.state_dict(), strict=False)
    with torch.no_grad():
        ids = tokens()
        assert rel_error(other(ids), gpt(ids)) > 1e-3


def test_layernorm1p_gains_start_at_zero_and_scale_by_one_plus():
    """A fresh nemotron's norms hold w = 0 (gain 1); the forward uses 1 + w."""
    gpt = GPT(ModelConfig(arch="nemotron", d_model=32, n_heads=4, partial_rotary_factor=0.5))
    norm = gpt.layers["0"].norm1
    assert torch.equal(norm.weight, torch.zeros(32))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        norm.weight.fill_(0.5)
        want = torch.nn.functional.layer_norm(x, (32,), torch.full((32,), 1.5), norm.bias)
        assert torch.equal(norm(x), want)


@pytest.mark.parametrize(
    "kw, key",
    [({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
     ({"mlp_bias": True}, "mlp_bias")],
)  # fmt: skip
def test_unsupported_nemotron_fields_are_one_line(kw, key):
    with pytest.raises(ValueError, match=key) as err:
        from_hf(nemotron(**kw))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.partial_rotary_factor=0.2"], "model.partial_rotary_factor=0.2 rotates 3"),
        (["model.n_experts=4"], "model.arch=nemotron is dense"),
    ],
)
def test_nemotron_config_refusals_are_one_line(overrides, key):
    base = ["model.arch=nemotron", "model.d_model=64", "model.n_heads=4"]
    with pytest.raises(Exception, match=key) as err:
        validate(load_config(None, base + overrides))
    assert "\n" not in str(err.value)


NEMOTRON = ["--model.arch=nemotron", "--model.partial_rotary_factor=0.5", "--model.n_kv_heads=2",
            "--model.tie_embeddings=false"]  # fmt: skip


@pytest.mark.parametrize("mesh", [["--parallel.tp=2"], ["--parallel.pp=2"]], ids=["tp2", "pp2"])
def test_fake_rank_flops_are_the_plans(mesh, tmp_path):
    """relu²'s MLP (two matrices, no biases) and no position table: FlopCounterMode's count on
    each rank equals config/flops.py's."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", *NEMOTRON, *mesh])
    out = fake_ranks(cfg, "all")
    assert len(out["ranks"]) == 2
    for r in out["ranks"]:
        assert r["flops"] == r["plan_flops"] > 0, r["rank"]


def test_dry_run_params_are_the_models(tmp_path):
    """The norms' biases counted, no linear biases, no position table."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", *NEMOTRON])
    built = GPT(cfg.model, seed=1)
    assert as_json(cfg)["params"] == sum(p.numel() for p in built.parameters())
    names = [n for n, _ in built.named_parameters()]
    assert not any(n.endswith("bias") and ".norm" not in f".{n}" for n in names)
    assert "embed.pos.weight" not in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_grads_are_autograds_and_it_keeps_relus_output_alone(dtype):
    """models/activations.relu2: output and input grad bitwise autograd's relu(h).square(),
    with one saved tensor of h's size (relu's output)."""
    from megapipe.models.activations import relu2

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(16, 96, generator=gen).to(dtype)
    h[0, :4] = 0.0  # relu's kink
    g = torch.randn(16, 96, generator=gen).to(dtype)
    plain = h.clone().requires_grad_()
    torch.nn.functional.relu(plain).square().backward(g)
    ours, saved = h.clone().requires_grad_(), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = relu2(ours)
    y.backward(g)
    assert torch.equal(y.detach(), torch.nn.functional.relu(h).square())
    assert torch.equal(ours.grad, plain.grad)
    assert [t.shape for t in saved] == [h.shape]
