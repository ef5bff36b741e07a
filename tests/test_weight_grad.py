"""Zero Bubble's B/W split in the linear layers: B (input grads, deferred weight grads) then W
gives the gradients of one full backward, and W does the queued matmuls. On the CPU a linear's
weight grad is written into a buffer kept from step to step (kept_buffers.py): the weight's
.grad without a copy, the same bits as a fresh matmul, never while anything still holds it."""

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
    with defer_weight_grads(split, ("mb", 0)):
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
        with defer_weight_grads(split, (i, 0)):
            split(x).sum().backward()
    for i in (1, 0):  # W in any order
        run_weight_grads(split, (i, 0))
    for name, grad in _grads(full).items():
        torch.testing.assert_close(_grads(split)[name], grad, msg=name)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_weight_grad_is_written_into_the_kept_buffer_only_while_it_is_free():
    layer = _model()[0]
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    gy = torch.randn(4, 12)

    def backward(i):
        layer(xs[i]).backward(gy)

    def expected(*ids):
        return sum(gy.t() @ xs[i] for i in ids)

    backward(0)
    kept = layer.kept_grads.kept
    assert len(kept) == 1 and _storage(layer.weight.grad) == _storage(kept[0])  # no copy
    assert torch.equal(layer.weight.grad, expected(0))  # the same kernel: the same bits
    backward(1)  # accumulation: .grad holds the kept buffer, so the second grad is a fresh one
    assert _storage(layer.weight.grad) == _storage(kept[0])
    torch.testing.assert_close(layer.weight.grad, expected(0, 1))
    layer.weight.grad = None  # what the optimizer's zero_grad does
    backward(2)
    assert _storage(layer.weight.grad) == _storage(kept[0])  # written again, not made anew
    assert torch.equal(layer.weight.grad, expected(2))
    held, before = layer.weight.grad, layer.weight.grad.clone()
    layer.weight.grad = None
    backward(3)  # `held` still holds the kept buffer: it is not overwritten
    assert _storage(layer.weight.grad) != _storage(held) and torch.equal(held, before)
    assert torch.equal(layer.weight.grad, expected(3))


def test_deferred_weight_grad_uses_the_kept_buffer_too():
    layer = _model()[0]
    x, gy = torch.randn(4, 8), torch.randn(4, 12)
    layer(x).backward(gy)
    layer.weight.grad = None
    with defer_weight_grads(layer, ("mb", 0)):
        layer(x).backward(gy)
    assert layer.weight.grad is None
    run_weight_grads(layer, ("mb", 0))
    assert _storage(layer.weight.grad) == _storage(layer.kept_grads.kept[0])
    assert torch.equal(layer.weight.grad, gy.t() @ x)
