"""GPT-2's tanh GeLU computed as x·σ(2u) on the CPU (models/activations.py): the same function
as aten's tanh GeLU to float32 round-off, eager and compiled, with aten's backward."""

import pytest
import torch
import torch.nn.functional as F

from megapipe.models.activations import gelu_tanh


def _inputs() -> torch.Tensor:
    torch.manual_seed(0)
    wide = torch.randn(64, 256) * 4  # both tails: σ saturates, the cubic term dominates
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 88.0, -88.0, 1e4, -1e4])
    return torch.cat([wide.flatten(), edges])


def test_forward_is_aten_tanh_gelu_to_round_off_and_backward_is_atens_own():
    x = _inputs().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    y, ref = gelu_tanh(x), F.gelu(ref_x, approximate="tanh")
    scale = ref.detach().abs().clamp_min(1.0)
    assert ((y - ref).abs() / scale).max().item() < 1e-6
    assert torch.isfinite(y).all()
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, ref_x.grad)  # the same aten kernel on the same input


def test_compiled_gelu_matches_aten_forward_and_backward():
    x = _inputs().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    y = torch.compile(gelu_tanh, backend="inductor", fullgraph=True)(x)
    ref = F.gelu(ref_x, approximate="tanh")
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    for got, want in ((y.detach(), ref.detach()), (x.grad, ref_x.grad)):
        assert ((got - want).abs() / want.abs().clamp_min(1.0)).max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_run_atens_kernel(dtype):
    x = _inputs().to(dtype)
    assert torch.equal(gelu_tanh(x), F.gelu(x, approximate="tanh"))


def test_the_float32_cpu_forward_is_not_atens_kernel():
    """The fast path is really taken: on some input its rounding differs from aten's."""
    x = _inputs()
    assert not torch.equal(gelu_tanh(x), F.gelu(x, approximate="tanh"))
