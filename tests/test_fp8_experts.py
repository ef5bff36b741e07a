"""The routed experts in FP8 (parallel/fp8_experts.py), single process: each recipe's grouped
forward and backward against a float64 reference of the same quantization, part by part (an
expert's rows from two sources cast apart, an empty part among them), the deferred W, and
train.fp8_keep_bf16 keeping the experts."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import load_config
from megapipe.config.flops import expert_ffn
from megapipe.config.fp8_weights import expert_deferred_fp8
from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads
from megapipe.parallel.expert.sharding import NO_EP
from megapipe.parallel.fp8 import GRANULARITY, RECIPES, Fp8
from megapipe.parallel.fp8_experts import fp8_grouped_linear
from megapipe.parallel.fp8_scaling import E4M3, E5M2, quantize
from megapipe.parallel.tensor.sharding import NO_TP
from megapipe.perf.cluster import load_cluster
from megapipe.perf.model import project
from megapipe.pipeline.stages import build_model
from models.moe import Experts
from tests.test_fp8 import _close, _rand, _ref_mm

E, D, FF = 3, 160, 136  # d_model and ffn not multiples of 128: blockwise's padded edges
PARTS = (5, 9, 0, 0, 7, 3)  # rows per (expert, source), two sources: expert 1 has none


def _experts(recipe: str) -> Experts:
    cfg = load_config(
        "configs/tiny.yaml",
        ["model.arch=gpt2", f"model.d_model={D}", f"model.n_experts={E}", "model.top_k=1"],
    ).model
    experts = Experts(cfg, FF, NO_TP, NO_EP)
    gen = torch.Generator().manual_seed(1)
    torch.nn.init.normal_(experts.w_in, std=0.05, generator=gen)
    torch.nn.init.normal_(experts.in_bias, generator=gen)
    Fp8(recipe).apply(experts)
    return experts


def _run(experts, x, g, defer=False):
    y = fp8_grouped_linear(x, experts.w_in, experts.in_bias, PARTS, experts, "w_in", "in_bias")
    if defer:
        with defer_weight_grads(experts, "B0"):
            y.backward(g)
        assert experts.w_in.grad is None
        assert run_weight_grads(experts, "B0") == 1
    else:
        y.backward(g)
    return y


@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_experts_against_float64(recipe):
    """y, grad_x, the stacked grad_W and grad_b, each part cast with its own scales (as the
    dense linear casts a whole operand) and its expert's weight with its own."""
    experts = _experts(recipe)
    act, wgt = GRANULARITY[recipe]
    n = sum(PARTS)
    x = _rand(n, D, seed=3).requires_grad_()
    g = _rand(n, FF, seed=4)
    y = _run(experts, x, g)
    w, b = experts.w_in.detach(), experts.in_bias.detach()
    starts = [sum(PARTS[:i]) for i in range(len(PARTS))]
    grad_w = experts.w_in.grad
    for e in range(E):
        rows = sum(PARTS[2 * e : 2 * e + 2])
        want_w, scale_w = torch.zeros(FF, D, dtype=torch.float64), 0.0
        for i in (2 * e, 2 * e + 1):
            lo, hi = starts[i], starts[i] + PARTS[i]
            if lo == hi:
                continue
            xs, gs = x.detach()[lo:hi], g[lo:hi]
            want, scale = _ref_mm(quantize(xs, E4M3, act), quantize(w[e], E4M3, wgt), act, wgt)
            _close(y.detach()[lo:hi] - b[e], want, scale, D)
            want, scale = _ref_mm(quantize(gs, E5M2, act), quantize(w[e].t(), E4M3, wgt), act, wgt)
            _close(x.grad[lo:hi], want, scale, FF)
            want, scale = _ref_mm(
                quantize(gs.t(), E5M2, act), quantize(xs.t(), E4M3, act), act, act
            )
            want_w, scale_w = want_w + want, scale_w + scale
        if rows:  # the parts' float32 products summed: one more rounding per part
            _close(grad_w[e], want_w, scale_w, rows + 2)
        else:
            assert not grad_w[e].any()
        torch.testing.assert_close(experts.in_bias.grad[e], g[starts[2 * e] :][:rows].sum(0))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_deferred_weight_grad_is_the_same(recipe):
    """Zero Bubble's W on the FP8 operands kept from B gives B's stacked grad bit for bit."""
    grads = []
    for defer in (False, True):
        experts = _experts(recipe)
        x = _rand(sum(PARTS), D, seed=6)
        _run(experts, x, _rand(sum(PARTS), FF, seed=7), defer)
        grads.append(experts.w_in.grad)
    assert torch.equal(grads[0], grads[1])


def test_kept_experts():
    """The routed experts take FP8 with the linears; `experts` in train.fp8_keep_bf16 keeps
    them in high precision."""

    def cast(*over):
        over = ["model.n_experts=4", "model.top_k=2", "train.fp8=tensorwise", *over]
        model = build_model(load_config("configs/tiny.yaml", over))
        return [n for n, m in model.named_modules() if getattr(m, "fp8_experts", None)]

    assert cast() and all(n.endswith("experts") for n in cast())
    assert cast("train.fp8_keep_bf16=head,experts") == []


@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_deferred_bytes_are_the_plans(recipe):
    """What W keeps of the experts' FP8 operands, as config/fp8_weights.expert_deferred_fp8
    counts it: the one-byte values exactly, the scales exactly (tensorwise, rowwise) or within
    the plan's bound (blockwise's tiles, a part's last one partial)."""
    over = ["model.n_experts=3", "model.top_k=1", f"train.fp8={recipe}", "model.arch=llama"]
    cfg = load_config("configs/tiny.yaml", over)
    experts = Experts(cfg.model, expert_ffn(cfg.model, cfg.derived.d_ff), NO_TP, NO_EP)
    torch.nn.init.normal_(experts.w_in, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(experts.w_out, generator=torch.Generator().manual_seed(2))
    Fp8(recipe).apply(experts)
    counts = [200, 0, 57]
    x = _rand(sum(counts), cfg.model.d_model, seed=3)
    with defer_weight_grads(experts, "B0"):
        experts(x, counts).backward(_rand(sum(counts), cfg.model.d_model, seed=4))
    values = scales = 0
    for _, (pairs, _, _), _ in experts.wgrad_queue["B0"]:
        for (qg, sg), (qx, sx), _ in pairs:
            values, scales = (
                values + qg.numel() + qx.numel(),
                scales + 4 * (sg.numel() + sx.numel()),
            )
    saved, plan_scales = expert_deferred_fp8(cfg, 1, sum(counts), 2)
    assert values == saved  # element 2: one byte saved per value
    assert scales == plan_scales if recipe != "blockwise" else 0 < scales <= plan_scales


def test_performance_model_prices_fp8_experts():
    """The routed experts' GEMMs at the profile's FP8 rate (perf/fp8_costs.fp8_gemms) unless
    train.fp8_keep_bf16 keeps them: keeping them costs step time, which FP8 still beats."""

    def step(*over):
        over = ["train.dtype=bfloat16", "model.n_experts=8", "model.top_k=2", *over]
        cfg = load_config("configs/gpt2_1.3b.yaml", over)
        return project(cfg, load_cluster("h100", 8), memory=False).step_time_s

    fp8 = step("train.fp8=rowwise")
    kept = step("train.fp8=rowwise", "train.fp8_keep_bf16=embed,head,experts")
    assert fp8 < kept < step()


@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_padded_tokens_give_the_same_weight_grad(recipe):
    """The weight grad's contraction zero-padded to 16 tokens (CUDA's kernels) changes nothing
    but the order of float32 sums."""
    experts = _experts(recipe)
    fp8 = experts.fp8_experts
    x, g = _rand(sum(PARTS), D, seed=8), _rand(sum(PARTS), FF, seed=9)
    plain, padded = (fp8.weight_grad_operands(x, g, PARTS, E, a) for a in (1, 16))
    assert all(ops[0][0].shape[1] % 16 == 0 for ops in padded[0])
    torch.testing.assert_close(fp8.weight_grad(padded), fp8.weight_grad(plain))
