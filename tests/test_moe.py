"""The mixture-of-experts layer in one process (models/moe.py): routing, capacity, the balance
and z losses and their grads against a token-by-token reference; deferred expert weight grads;
the config rules; the metrics a training run writes."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ConfigError, ModelConfig
from megapipe.models.activations import gelu_tanh
from megapipe.models.gpt import GPT
from megapipe.models.moe import MoE, set_loss_scale
from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads

ARCHS = ("gpt2", "llama")


def _model_cfg(arch: str, **kw) -> ModelConfig:
    base = dict(arch=arch, n_layers=2, d_model=16, n_heads=2, d_ff=24, vocab_size=32, seq_len=12)
    base.update(dict(n_experts=4, top_k=2, moe_aux_coef=0.1, moe_z_coef=0.01))
    base.update(kw)
    return ModelConfig(**base)


def _layer(arch: str, **kw) -> MoE:
    torch.manual_seed(0)
    moe = GPT(_model_cfg(arch, **kw), seed=3).layers["1"].mlp
    with torch.no_grad():
        for p in moe.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # biases away from 0, routers away from ties
    return moe


def _ffn(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = moe.experts
    if ex.swiglu:
        gate, up = F.linear(x, ex.w_in[e]).chunk(2, -1)
        return F.linear(F.silu(gate) * up, ex.w_out[e])
    return F.linear(gelu_tanh(F.linear(x, ex.w_in[e], ex.in_bias[e])), ex.w_out[e], ex.out_bias[e])


def _reference(moe: MoE, x: torch.Tensor):
    """Token by token: (output, Σ_b T·aux_b, Σ_t lse², dropped rows)."""
    b, t, _ = x.shape
    k, e_count, cf = moe.top_k, moe.n_experts, moe.capacity_factor
    cap = math.ceil(cf * t * k / e_count) if cf > 0 else None
    logits = x.float() @ moe.router.weight.t()
    probs = logits.softmax(-1)
    rows, aux, dropped = [], 0.0, 0
    for s in range(b):
        taken = [0] * e_count
        for i in range(t):
            top_p, top_i = probs[s, i].topk(k)
            y = torch.zeros_like(x[s, i])
            for p, e in zip(top_p / top_p.sum(), top_i.tolist()):
                taken[e] += 1
                if cap is not None and taken[e] > cap:
                    dropped += 1
                    continue
                y = y + p * _ffn(moe, e, x[s, i])
            rows.append(y)
        share = torch.tensor(taken, dtype=torch.float32) / (t * k)
        aux = aux + t * e_count * (share * probs[s].mean(0)).sum()
    out = torch.stack(rows).view_as(x)
    if moe.shared is not None:
        out = out + moe.shared(x)
    z = torch.logsumexp(logits, -1).pow(2).sum()
    return out, aux, z, dropped


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("capacity", [0.0, 0.75])
def test_layer_matches_token_by_token_reference(arch, capacity):
    moe = _layer(arch, moe_capacity_factor=capacity, moe_shared_experts=1)
    x = torch.randn(3, 12, 16, requires_grad=True)
    c = torch.randn(3, 12, 16)
    out = moe(x)
    (out * c).sum().backward()
    got = {n: p.grad.clone() for n, p in moe.named_parameters()} | {"x": x.grad.clone()}
    stats = moe.stats.take()
    for p in [*moe.parameters(), x]:
        p.grad = None
    ref, aux, z, dropped = _reference(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    ((ref * c).sum() + moe.aux_coef * aux + moe.z_coef * z).backward()
    want = {n: p.grad for n, p in moe.named_parameters()} | {"x": x.grad}
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert stats[-3].item() == dropped and (dropped > 0) == (capacity > 0)
    assert stats[-2].item() == pytest.approx(aux.item(), rel=1e-5)
    assert stats[-1].item() == pytest.approx(z.item(), rel=1e-5)
    assert stats[:-3].sum().item() == 3 * 12 * 2  # every (token, choice) routed


def _segmented(moe: MoE, x, c, bounds, recompute: bool):
    """The layer over Seq1F1B segments as the pipeline runs them (parallel/autograd/segment_kv):
    forwards in order, backwards last segment first, each under full recompute if asked."""
    from torch.utils.checkpoint import checkpoint

    from megapipe.parallel.autograd.segment_kv import SegmentKV

    kv, outs = SegmentKV(len(bounds), x.shape[1]), []
    for j, (s, e) in enumerate(bounds):
        scope = kv.scope(j)
        if recompute:
            outs.append(checkpoint(moe, x[:, s:e], scope, use_reentrant=False))
        else:
            outs.append(moe(x[:, s:e], scope))
    for j in reversed(range(len(bounds))):
        s, e = bounds[j]
        kv.backward(j, outs[j], c[:, s:e])
    return torch.cat(outs, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("capacity", [0.0, 0.75])
@pytest.mark.parametrize("recompute", [False, True])
def test_segments_route_like_the_whole_sequence(arch, capacity, recompute):
    """Seq1F1B segments of a sequence: the same drops (the earlier segments' counts carried),
    outputs, grads (the balance loss's f over the whole sequence) and figures as the whole."""
    moe = _layer(arch, moe_capacity_factor=capacity)
    x = torch.randn(3, 12, 16, requires_grad=True)
    c = torch.randn(3, 12, 16)
    whole = moe(x)
    (whole * c).sum().backward()
    want = {n: p.grad.clone() for n, p in moe.named_parameters()} | {"x": x.grad.clone()}
    want_stats = moe.stats.take()
    for p in [*moe.parameters(), x]:
        p.grad = None
    out = _segmented(moe, x, c, [(0, 5), (5, 8), (8, 12)], recompute)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    got = {n: p.grad for n, p in moe.named_parameters()} | {"x": x.grad}
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    stats = moe.stats.take()
    assert stats[:-2].tolist() == want_stats[:-2].tolist()  # load and drops
    assert (want_stats[-3] > 0) == (capacity > 0)
    torch.testing.assert_close(stats[-2:], want_stats[-2:], rtol=1e-6, atol=0)


def test_a_segment_backward_before_a_later_forward_is_refused():
    from megapipe.parallel.autograd.segment_kv import SegmentKV

    moe = _layer("gpt2")
    kv = SegmentKV(2, 12)
    out = moe(torch.randn(2, 6, 16), kv.scope(0))
    with pytest.raises(RuntimeError, match="before all 2 segments"):
        kv.backward(0, out, torch.ones_like(out))


def test_losses_scaled_like_the_lm_loss():
    moe = _layer("llama")
    x = torch.randn(2, 12, 16, requires_grad=True)
    grads = []
    for scale in (1.0, 8.0):
        set_loss_scale(moe, scale)
        moe.router.weight.grad = None
        moe(x).mul(0).sum().backward()  # only the aux and z losses reach the router
        grads.append(moe.router.weight.grad.clone())
    torch.testing.assert_close(grads[1] * 8, grads[0])
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_deferred_expert_weight_grads(arch):
    moe = _layer(arch)
    x = torch.randn(2, 12, 16)
    moe(x).square().sum().backward()
    now = {n: p.grad.clone() for n, p in moe.experts.named_parameters()}
    moe.zero_grad(set_to_none=True)
    with defer_weight_grads(moe, "mb0"):
        moe(x).square().sum().backward()
    assert moe.experts.w_in.grad is None and moe.experts.w_out.grad is None
    assert run_weight_grads(moe, "mb0") == 2
    for name, p in moe.experts.named_parameters():
        torch.testing.assert_close(p.grad, now[name], rtol=1e-6, atol=1e-7, msg=name)


def test_moe_every_and_names():
    model = GPT(_model_cfg("gpt2", n_layers=4, moe_every=2), seed=1)
    kinds = [type(layer.mlp).__name__ for layer in model.layers.values()]
    assert kinds == ["MLP", "MoE", "MLP", "MoE"]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "layers.1.mlp" in n}
    assert shapes == {
        "layers.1.mlp.router.weight": (4, 16),
        "layers.1.mlp.experts.w_in": (4, 24, 16),
        "layers.1.mlp.experts.w_out": (4, 16, 24),
        "layers.1.mlp.experts.in_bias": (4, 24),
        "layers.1.mlp.experts.out_bias": (4, 16),
    }


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("model.top_k=5", "model.top_k=5 exceeds model.n_experts=4"),
        ("model.moe_every=3", "model.moe_every=3 exceeds model.n_layers=2"),
        ("parallel.ep=2", "parallel.ep=2 must divide parallel.dp=1"),
    ],
)
def test_config_rules(tiny_cfg, override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        tiny_cfg("model.n_experts=4", override)
    assert "\n" not in str(err.value)


def test_router_stays_float32_under_bf16_weights(tiny_cfg):
    from megapipe.pipeline.stages import build_model

    cfg = tiny_cfg("model.n_experts=4", "train.params_dtype=bfloat16", "train.dtype=bfloat16")
    model = build_model(cfg)
    moe = model.layers["0"].mlp
    assert moe.router.weight.dtype == torch.float32
    assert moe.experts.w_in.dtype == torch.bfloat16
    assert moe.loss_scale == cfg.derived.tokens_per_step


def test_training_run_logs_moe_metrics(tiny_cfg, tmp_path):
    from megapipe.train.loop import run

    cfg = tiny_cfg(
        "model.n_experts=4", "model.moe_capacity_factor=0.5", "model.moe_z_coef=0.001",
        "train.steps=2", "checkpoint.interval=0", "parallel.microbatches=2",
    )  # fmt: skip
    run(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    load = record["moe_load"]
    tokens = cfg.derived.tokens_per_step
    assert len(load) == 2 and all(sum(row) == tokens * 2 for row in load)
    assert 0 < record["moe_dropped"] < tokens * 2 * 2
    assert 0.5 < record["moe_aux"] < 2  # E·Σ f·P is 1 under even routing
    assert record["moe_z"] > 0 and math.isfinite(record["loss"])


@pytest.mark.parametrize("arch", ARCHS)
def test_flops_count_active_experts_and_the_dry_run_all(tiny_cfg, arch):
    from megapipe.config.flops import matmul_params
    from megapipe.train.dry_run import as_json

    overrides = [f"model.arch={arch}", "model.n_layers=4", "model.n_experts=8", "model.top_k=2",
                 "model.moe_every=2", "model.moe_shared_experts=1", "model.moe_ffn=40"]  # fmt: skip
    cfg = tiny_cfg(*overrides)
    model = GPT(cfg.model, seed=1)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    dense = cfg.model.d_model * cfg.model.vocab_size  # the LM head (tied table)
    for name, n in numel.items():
        if name.endswith("weight") and ("attn." in name or "fc" in name or "router" in name):
            dense += n  # attention, dense and shared MLPs, routers
    experts = sum(n for name, n in numel.items() if ".experts.w_" in name)
    assert matmul_params(cfg) == dense + experts * 2 // 8  # top_k of E experts' matrices
    figures = as_json(cfg, "cpu")
    assert figures["params"] == sum(numel.values())
    stacked = sum(n for name, n in numel.items() if ".experts." in name)
    assert figures["moe"]["expert_params"] == stacked
    assert figures["moe"]["active_params"] == matmul_params(cfg)
    assert "moe" not in as_json(tiny_cfg(f"model.arch={arch}"), "cpu")


def test_checkpoint_resumes_with_logical_expert_names(tiny_cfg, tmp_path):
    """A run cut at step 2 and resumed trains as the uninterrupted one, bit for bit; the
    checkpoint holds the stacked experts under their logical names and shapes."""
    from megapipe.train import checkpoint
    from megapipe.train.loop import run

    base = ["model.n_experts=4", "model.moe_capacity_factor=1.0", "model.moe_shared_experts=1",
            "train.steps=4", "checkpoint.interval=2", "log.progress=false"]  # fmt: skip

    def losses(where, *extra):
        return [r["loss"] for r in run(tiny_cfg(*base, f"run.dir={tmp_path / where}", *extra))]

    full = losses("full")
    split = losses("split", "train.stop_at_step=2") + losses("split")
    assert split == full
    _, model = checkpoint.load_for_inference(str(tmp_path / "split"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["layers.1.mlp.experts.w_in"] == (4, 128, 32)
    assert shapes["layers.1.mlp.router.weight"] == (4, 32)
    assert "layers.1.mlp.shared.fc1.weight" in shapes


def test_compiled_layers_train_like_eager():
    """train.compile: the MoE MLP stays eager inside the compiled layer (its row counts are
    data-dependent), attention and norms compile; losses and weights as eager."""
    from tests.parity import reference_case, train_case
    from tests.util import assert_state_close

    moe = ["model.n_experts=4", "model.moe_capacity_factor=1.0", "model.moe_z_coef=0.001"]
    eager = reference_case(moe, steps=2)
    compiled = train_case([*moe, "train.compile=true"], steps=2)
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert_state_close(
        compiled["weights"], eager["weights"], reach=eager["adam_reach"], exact=eager["exact"]
    )
