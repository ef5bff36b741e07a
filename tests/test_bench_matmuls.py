"""benchmarks/bench_matmuls.py (`python -m benchmarks.bench matmuls`): its per-matmul log
counts calls, FLOPs and out= as they happen, and with it the claim behind kept weight-grad
buffers (parallel/autograd/kept_buffers.py): once kept, a linear's weight-grad matmul on the CPU
writes into memory already touched (no page faults), step after step."""

import torch

from benchmarks import bench_matmuls
from megapipe.parallel.tensor.layers import ColumnParallelLinear


def test_matmul_log_counts_calls_flops_and_out():
    a, b, c = torch.randn(4, 8), torch.randn(8, 16), torch.empty(4, 16)
    with bench_matmuls.MatmulLog() as log:
        a @ b
        a @ b
        torch.mm(a, b, out=c)
        torch.addmm(torch.zeros(16), a, b)
    rows = {(name, out): r for (name, _, out), r in log.rows.items()}
    assert sorted(rows) == [("addmm", False), ("mm", False), ("mm", True)]
    calls, seconds, flops, faults = rows[("mm", False)]
    assert (calls, flops) == (2, 2 * 2 * 4 * 8 * 16) and seconds > 0 and faults >= 0


def test_kept_weight_grad_matmul_takes_no_page_faults():
    layer = ColumnParallelLinear(1024, 2048)  # a 8 MiB weight grad: 2048 pages if fresh
    x, gy = torch.randn(512, 1024), torch.randn(512, 2048)
    layer(x).backward(gy)  # the first step makes the kept buffer
    layer.weight.grad = None
    with bench_matmuls.MatmulLog() as log:
        for _ in range(3):
            layer(x).backward(gy)
            layer.weight.grad = None
    (wgrad,) = [r for (_, _, out), r in log.rows.items() if out]
    calls, _, _, faults = wgrad
    assert calls == 3 and faults < 64
