"""Expert-parallel dispatch and combine (parallel/expert/): on ep 2 and 4 gloo ranks, rows routed
to experts held elsewhere come back as the one-rank computation makes them (outputs and the
grads of the rows and of the expert weights), each expert sees its rows in the one-rank order,
and a routing that leaves ranks without rows still exchanges."""

import pytest
import torch
import torch.distributed as dist

from megapipe.distributed.local_world import spawn
from megapipe.parallel.expert.dispatch import combine, dispatch
from megapipe.parallel.expert.sharding import NO_EP, EPInfo

E, D, T, K = 8, 6, 10, 2  # experts, row width, tokens per rank, choices per token
WORLD = 4


def problem(ranks: int, skew: bool):
    """The global batch: tokens, their expert choices (top_k distinct), combine weights, expert
    weights and the output's cotangent, from a fixed seed."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ranks * T, D, generator=g)
    choice = torch.rand(ranks * T, E, generator=g).argsort(dim=1)[:, :K]
    if skew:  # every token to experts 0 and 1: one ep rank takes everything
        choice = torch.tensor([0, 1]).expand(ranks * T, K)
    weight = torch.rand(ranks * T, K, generator=g)
    w = torch.randn(E, D, D, generator=g)
    cot = torch.randn(ranks * T, D, generator=g)
    return x, choice, weight, w, cot


def moe(x, choice, weight, w, cot, ep: EPInfo):
    """y = Σ_k weight_k · x W[choice_k] through dispatch/combine, its loss ⟨y, cot⟩ backward;
    (y, dx, dW of the local experts, the local rows seen per local expert)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    rows = x.repeat_interleave(K, dim=0)
    local, counts, plan = dispatch(rows, choice.flatten(), E, ep)
    outs = [r @ w[e] for r, e in zip(local.split(counts.tolist()), ep.local_experts(E))]
    back = combine(torch.cat(outs), plan, ep)
    y = (back.view(-1, K, D) * weight.unsqueeze(-1)).sum(1)
    (y * cot).sum().backward()
    mine = list(ep.local_experts(E))
    return y.detach(), x.grad, w.grad[mine], [r.detach() for r in local.split(counts.tolist())]


def _ranks(ep: int) -> tuple[EPInfo, int]:
    """Every group of `ep` consecutive ranks made (all ranks make all, in order); this rank's."""
    rank, mine = dist.get_rank(), None
    for first in range(0, WORLD, ep):
        group = dist.new_group(list(range(first, first + ep)))
        if first <= rank < first + ep:
            mine = EPInfo(ep, rank - first, group), first
    return mine


def _cases() -> dict:
    out = {}
    for ep in (2, 4):
        info, first = _ranks(ep)
        for skew in (False, True):
            x, choice, weight, w, cot = problem(ep, skew)
            rows = slice(info.rank * T, (info.rank + 1) * T)
            out[ep, skew] = moe(x[rows], choice[rows], weight[rows], w, cot[rows], info)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(WORLD, _cases)


@pytest.mark.spawn
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_dispatch_combine_match_one_rank(results, ep, skew):
    y1, dx1, dw1, seen1 = moe(*problem(ep, skew), NO_EP)
    for rank, res in enumerate(results):
        r = rank % ep
        y, dx, dw, seen = res[ep, skew]
        rows = slice(r * T, (r + 1) * T)
        torch.testing.assert_close(y, y1[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, dx1[rows], rtol=1e-5, atol=1e-6)
        mine = list(EPInfo(ep, r).local_experts(E))
        torch.testing.assert_close(dw, dw1[mine], rtol=1e-5, atol=1e-6)
        for got, want in zip(seen, [seen1[e] for e in mine]):  # the one-rank order, exactly
            assert torch.equal(got, want)


def test_one_rank_is_a_sort_and_its_inverse():
    x, choice, weight, w, cot = problem(1, False)
    rows = x.repeat_interleave(K, dim=0)
    local, counts, plan = dispatch(rows, choice.flatten(), E, NO_EP)
    assert counts.tolist() == torch.bincount(choice.flatten(), minlength=E).tolist()
    assert torch.equal(combine(local, plan, NO_EP), rows)
