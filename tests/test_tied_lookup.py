"""The tied table's lookup and head as one autograd node (parallel/autograd/tied_lookup.py):
the same grads as a plain lookup plus the head's use of the table, with one dense table grad
(no table of zeros made for the lookup), and the lookup's grad alone when the head is not in
the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.config import load_config
from megapipe.config.memory_terms import tied_lookup_with_head
from megapipe.config.pipeline_split import placement_of, rank_blocks
from megapipe.models.gpt import GPT
from megapipe.parallel.autograd.tied_lookup import tied_lookup
from megapipe.parallel.tensor.cross_entropy import linear_cross_entropy
from megapipe.parallel.tensor.sharding import NO_TP
from tests.conftest import TINY
from tests.util import assert_rel_close

V, D = 300, 16


def _problem():
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, D, generator=g) * 0.3
    ids = torch.randint(0, V, (2, 9), generator=g)
    ids[0, :3] = 7  # repeated rows: their grads add up
    return table, ids


def _loss(rows, table, ids, early):
    h = torch.tanh(rows) * 1.5  # something between the lookup and the head
    return linear_cross_entropy(h, table, ids.roll(1, 1), 0, V, NO_TP, 4, early)


class _Zeros(TorchDispatchMode):
    """Element counts of the tensors made or filled as zero tables (a plain lookup's backward,
    embedding_dense_backward, is one)."""

    OPS = ("zeros", "new_zeros", "zero_", "fill_", "embedding_dense_backward")

    def __init__(self):
        super().__init__()
        self.filled = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in self.OPS and isinstance(out, torch.Tensor):
            self.filled.append(out.numel())
        return out


def test_grads_equal_the_plain_lookup_and_head():
    table, ids = _problem()
    for early in (False, True):
        plain = table.clone().requires_grad_()
        with _Zeros() as zeros:
            _loss(F.embedding(ids, plain), plain, ids, early).backward()
        assert V * D in zeros.filled  # the plain lookup's table of zeros, seen
        fused = table.clone().requires_grad_()
        rows, head_table = tied_lookup(ids, fused)
        assert torch.equal(rows, F.embedding(ids, table)) and torch.equal(head_table, table)
        with _Zeros() as zeros:
            _loss(rows, head_table, ids, early).backward()
        assert_rel_close(fused.grad, plain.grad, rel=1e-6)
        assert V * D not in zeros.filled  # no zero table for the lookup


def test_lookup_alone_when_the_head_is_not_in_the_backward():
    table, ids = _problem()
    fused = table.clone().requires_grad_()
    rows, _ = tied_lookup(ids, fused)
    (rows * 2.0).sum().backward()
    plain = table.clone().requires_grad_()
    (F.embedding(ids, plain) * 2.0).sum().backward()
    assert torch.equal(fused.grad, plain.grad)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.tie_embeddings=false"],
        ["parallel.pp=2"],
        ["parallel.pp=2", "parallel.schedule=zb_v", "parallel.vpp=2"],  # rank 0: both ends
        ["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.vpp=2"],
    ],
)
def test_the_config_predicts_the_module_that_holds_both_tied_ends(overrides):
    """config/memory_terms.tied_lookup_with_head (what the cost model prices) says what the modules
    training builds do (GPT.holds_tied_ends): one graph for the lookup and the head only with
    no pipeline; ZB-V's first rank holds both ends as two chunks, two graphs."""
    cfg = load_config(TINY, ["run.dir=unused", "model.n_layers=4", *overrides])
    placement = placement_of(cfg)
    chunks = [
        GPT(cfg.model, blocks, init=False)
        for rank in range(cfg.parallel.pp)
        for blocks in rank_blocks(cfg, rank, placement)
    ]
    assert any(c.holds_tied_ends for c in chunks) == tied_lookup_with_head(cfg)
