"""Zero Bubble's B/W split in the linear layers: B (input grads, deferred weight grads) then W
gives the gradients of one full backward, and W does the queued matmuls."""

import torch

from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads
from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def _model():
    model = torch.nn.Sequential(
        ColumnParallelLinear(8, 12), torch.nn.GELU(), RowParallelLinear(12, 8)
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_deferred_weight_grads_equal_full_backward():
    x = torch.randn(2, 5, 8)
    full = _model()
    xf = x.clone().requires_grad_()
    full(xf).square().sum().backward()

    split = _model()
    xs = x.clone().requires_grad_()
    with defer_weight_grads(("mb", 0)):
        split(xs).square().sum().backward()  # B
    assert split[0].weight.grad is None and split[2].weight.grad is None
    assert split[0].bias.grad is not None  # biases stay in B
    torch.testing.assert_close(xs.grad, xf.grad)
    assert run_weight_grads(split, ("other", 0)) == 0
    assert run_weight_grads(split, ("mb", 0)) == 2  # W
    for name, grad in _grads(full).items():
        torch.testing.assert_close(_grads(split)[name], grad, msg=name)
    assert all(not m.wgrad_queue for m in (split[0], split[2]))


def test_two_microbatches_accumulate_in_w():
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    full, split = _model(), _model()
    for x in (x1, x2):
        full(x).sum().backward()
    for i, x in enumerate((x1, x2)):
        with defer_weight_grads((i, 0)):
            split(x).sum().backward()
    for i in (1, 0):  # W in any order
        run_weight_grads(split, (i, 0))
    for name, grad in _grads(full).items():
        torch.testing.assert_close(_grads(split)[name], grad, msg=name)
