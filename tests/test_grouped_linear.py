"""The experts' matmul (parallel/autograd/grouped_linear.py) as torch's grouped matmul against
its loop of per-expert matmuls: forward, grad_x, the stacked weight grad (now, deferred to a W
action, into a bf16 weight's float32 main grad), biases, empty groups and no rows at all. A spy
on the grouped kernel makes a silent fallback to the loop fail; the probe turns a kernel that
computes the wrong groups into the loop with a warning; the performance model's flag follows
the code's rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megapipe.config import load_config
from megapipe.parallel.autograd import grouped_linear as G
from megapipe.parallel.autograd.weight_grad import (
    WeightGradQueue,
    accumulate,
    defer_weight_grads,
    run_weight_grads,
)
from megapipe.parallel.precision import attach_main_grads
from megapipe.perf import MEGAPIPE, load_cluster
from megapipe.perf.software import resolved_for

COUNTS = [(3, 0, 5, 2), (0, 7, 0, 0), (0, 0, 0, 0)]  # empty groups first, inside, last; no rows


class Owner(nn.Module):
    """A stacked weight (E, out, in) and bias (E, out), as models/moe.Experts holds them."""

    def __init__(self, e: int, d_out: int, d_in: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(torch.randn(e, d_out, d_in, generator=gen).to(dtype))
        self.b = nn.Parameter(torch.randn(e, d_out, generator=gen).to(dtype)) if bias else None
        self.wgrad_queue = WeightGradQueue()

    def forward(self, x, counts):
        bias_name = None if self.b is None else "b"
        return G.grouped_linear(x, self.w, self.b, counts, self, "w", bias_name)

    @torch.no_grad()
    def deferred_weight_grad(self, name, x, grad_out, counts):
        grad = G.stacked_weight_grad(getattr(self, name), x, grad_out, counts)
        if grad is not None:
            accumulate(getattr(self, name), grad)


def _run(counts, dtype, bias, deferred, main):
    """(y, grad_x, weight grad, bias grad) of one forward and backward."""
    owner = Owner(len(counts), 24, 16, bias, torch.bfloat16 if main else dtype)
    grads = attach_main_grads(owner) if main else None
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), 16, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(sum(counts), 24, generator=gen).to(dtype)
    if deferred:
        with defer_weight_grads(owner, ("mb", 0)):
            y = owner(x, counts)
            y.backward(g)
        assert owner.w.grad is None and (grads is None or not owner.w.main_grad.any())
        assert run_weight_grads(owner, ("mb", 0)) == 1
    else:
        y = owner(x, counts)
        y.backward(g)
    wgrad = owner.w.main_grad if main else owner.w.grad
    bgrad = None if not bias else owner.b.main_grad if main else owner.b.grad
    return y.detach(), x.grad, wgrad, bgrad


@pytest.fixture
def spy(monkeypatch):
    """Calls of the grouped kernel, counted (the probes run before)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert G._probe(torch.device("cpu"), dtype)
    calls = []

    def counted(a, b, offs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return G.grouped_mm.__wrapped__(a, b, offs)

    counted.__wrapped__ = G.grouped_mm
    monkeypatch.setattr(G, "grouped_mm", counted)
    return calls


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(
    "dtype, bias, deferred, main",
    [
        (torch.float32, False, False, False),
        (torch.float32, True, True, False),
        (torch.bfloat16, False, True, False),
        (torch.bfloat16, True, False, False),
        (torch.bfloat16, True, True, True),  # bf16 weights: float32 main grads
        (torch.bfloat16, False, False, True),
    ],
)
def test_grouped_equals_the_loop(monkeypatch, spy, counts, dtype, bias, deferred, main):
    grouped = _run(counts, dtype, bias, deferred, main)
    # forward, grad_x, grad_W: each one grouped call, none falling back to the loop (but a
    # bf16 forward with a bias: F.linear's, the bias inside the matmul's sums)
    want = [3, 3, 2] if dtype == torch.float32 or not bias else [3, 2]
    assert [len(b) for _, b in spy] == want, spy
    with monkeypatch.context() as m:
        m.setattr(G, "grouped_mm_ok", lambda *a: False)
        loop = _run(counts, dtype, bias, deferred, main)
    assert len(spy) == len(want)
    # the groups' matmuls are torch's own per group, bit for bit; float32 with a bias: added
    # after the matmul instead of inside addmm (float32 round-off)
    rel = 1e-6 if dtype == torch.float32 else 0.0
    for what, a, b in zip(("y", "grad_x", "grad_W", "grad_b"), grouped, loop, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, what
        # the main grads are float32 sums of exact products either way
        bound = 1e-6 if (what in ("grad_W", "grad_b") and main) else rel
        if what == "y" and not bias:
            bound = 0.0  # the same per-group matmuls, bit for bit
        if b.numel():
            err = (a.float() - b.float()).abs().max().item()
            assert err <= bound * b.float().abs().max().item(), (what, err)
        if what == "grad_W":  # an expert without rows: a zero grad, exactly
            empty = [e for e, n in enumerate(counts) if n == 0]
            assert not a[empty].any() and not b[empty].any()


def test_expert_groups_are_the_right_ones():
    """Each group of rows meets its own expert: the rows of expert 2 alone change when only
    expert 2's weight does (a kernel pairing groups and experts wrongly moves other rows)."""
    counts = (3, 0, 5, 2)
    owner = Owner(4, 24, 16, False, torch.float32)
    x = torch.randn(10, 16)
    before = owner(x, counts).detach()
    with torch.no_grad():
        owner.w[2] += 1.0
    after = owner(x, counts).detach()
    moved = (after != before).any(1)
    assert moved.tolist() == [False] * 3 + [True] * 5 + [False] * 2
    torch.testing.assert_close(after[3:8], x[3:8] @ owner.w[2].detach().t(), rtol=1e-6, atol=0)


def test_rule_and_shapes():
    """Pinned: where the grouped kernel runs, and the shapes the MoE tests use take it."""
    assert G.grouped_mm_for("cpu", None, "float32") and G.grouped_mm_for("cpu", None, "bfloat16")
    assert G.grouped_mm_for("cuda", (9, 0), "bfloat16")
    assert G.grouped_mm_for("cuda", (10, 0), "bfloat16")
    assert not G.grouped_mm_for("cuda", (8, 0), "bfloat16")  # torch's kernel: sm90, sm100
    assert not G.grouped_mm_for("cuda", (12, 0), "bfloat16")
    assert not G.grouped_mm_for("cuda", None, "bfloat16")
    assert not G.grouped_mm_for("cuda", (9, 0), "float32")  # torch's fallback syncs
    assert not G.grouped_mm_for("mps", None, "float32")
    # tests/test_parity_moe.py, test_parity_ep.py: d 32, moe_ffn 48 (gpt2) or d_ff 64 (llama,
    # gate|up 128), float32 and bf16, 1 to 4 local experts
    for dtype in (torch.float32, torch.bfloat16):
        for d_in, d_out in ((32, 48), (48, 32), (32, 128), (64, 32)):
            for e in (1, 2, 4):
                assert G.grouped_mm_ok(torch.zeros(5, d_in, dtype=dtype), d_out, e)
    assert not G.grouped_mm_ok(torch.zeros(5, 6), 16, 2)  # 24 bytes a row
    assert not G.grouped_mm_ok(torch.zeros(5, 16, dtype=torch.bfloat16), 12, 2)  # 24 bytes
    assert not G.grouped_mm_ok(torch.zeros(5, 16), 16, 1024)
    assert G.grouped_mm_ok(torch.zeros(0, 16), 16, 2)


def test_unaligned_rows_run_the_loop(spy):
    owner = Owner(2, 6, 16, True, torch.float32)  # out 6 float32: 24 bytes
    x = torch.randn(5, 16, requires_grad=True)
    y = owner(x, (2, 3))
    y.sum().backward()
    assert spy == []
    torch.testing.assert_close(y[2:], x[2:] @ owner.w[1].t() + owner.b[1])


@pytest.mark.parametrize("fault", ["swapped", "raises"])
def test_probe_falls_back_to_the_loop_with_a_warning(monkeypatch, fault):
    def wrong(a, b, offs):
        if fault == "raises":
            raise RuntimeError("strides should be multiple of 16 bytes")
        return torch._grouped_mm(a, b.flip(0), offs=offs)  # experts in the wrong order

    monkeypatch.setattr(G, "grouped_mm", wrong)
    G._probe.cache_clear()
    try:
        with pytest.warns(UserWarning, match="loop of matmuls"):
            assert not G.grouped_mm_ok(torch.zeros(4, 16), 16, 2)
        assert not G.grouped_mm_ok(torch.zeros(4, 16), 16, 2)  # asked once
    finally:
        G._probe.cache_clear()
    monkeypatch.undo()
    assert G.grouped_mm_ok(torch.zeros(4, 16), 16, 2)


def test_performance_model_follows_the_code():
    """Runtime.moe_grouped_gemm of ours is grouped_mm_for of the profile's device and
    train.dtype (perf/software.resolved_for): pinned per profile."""
    tiny = "configs/tiny.yaml"
    moe = ["model.n_experts=4", "model.top_k=2"]
    bf16 = load_config(tiny, [*moe, "train.dtype=bfloat16"])
    fp32 = load_config(tiny, moe)
    want = [("h100", bf16, True), ("h200", bf16, True), ("a100", bf16, False),
            ("h100", fp32, False), ("cpu", fp32, True)]  # fmt: skip
    for name, cfg, grouped in want:
        cluster = load_cluster(name)
        rt = resolved_for(MEGAPIPE, cfg, cluster)
        assert rt.moe_grouped_gemm is grouped, name
        dtype = cfg.train.dtype
        assert G.grouped_mm_for(cluster.device, cluster.capability, dtype) is grouped
    assert MEGAPIPE.moe_grouped_gemm is None  # resolved per profile, never a fixed guess
