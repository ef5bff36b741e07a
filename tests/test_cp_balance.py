"""The document-balanced cp split (parallel.cp_balance=documents, parallel/context/balance.py):
equal tokens per rank, a permutation, the same on every call, the worst rank's work within 10%
of the mean on OWT-like and real packed text where the positional split is not; the ring's tile
plan computes every visible pair exactly once and skips hidden tiles; the loader's cut follows
the layout. The spawned parity runs are in tests/test_parity_cp.py and test_ring_attention.py.
"""

from pathlib import Path

import pytest
import torch

from benchmarks.bench_cp_balance import (
    imbalance,
    owt_like,
    rows_of_lengths,
    shakespeare_packed,
    visible_work,
    zen_packed,
)
from megapipe.config import ConfigError
from megapipe.parallel.context.balance import (
    chunks_per_rank,
    deal,
    document_layout,
    rank_work,
    take,
    zigzag_layout,
)
from megapipe.parallel.context.documents import document_ids, document_positions
from megapipe.parallel.context.hybrid import group_layout
from megapipe.parallel.context.kernels import plan_step
from megapipe.parallel.context.zigzag import CPInfo
from megapipe.train.batches import BatchSlice
from tests.conftest import ROOT
from tests.parity import tiny_config

SEQ = 1024


def test_chunks_per_rank_keeps_chunks_whole_and_not_tiny():
    assert chunks_per_rank(4096, 8) == 16
    assert chunks_per_rank(1024, 8) == 8  # 16 per rank would be 8-token chunks
    assert chunks_per_rank(64, 4) == 2  # never coarser than zigzag's two
    assert chunks_per_rank(96, 2) == 2  # 4 per rank: 12-token chunks


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_layout_is_an_equal_split_permutation_the_same_every_time(cp):
    ids = owt_like(SEQ, 2, seed=cp)
    layout = document_layout(ids, cp)
    held = [c for r in layout.ranks for c in r]
    assert sorted(held) == list(range(layout.n))  # every chunk once
    assert {len(r) for r in layout.ranks} == {layout.n // cp}  # equal tokens per rank
    assert all(list(r) == sorted(r) for r in layout.ranks)  # ascending: the ring's own block
    assert document_layout(ids.clone(), cp) == layout  # a function of the ids alone
    tokens = torch.arange(SEQ).expand(2, -1)
    pieces = torch.cat([take(tokens, layout, r) for r in range(cp)], dim=1)
    assert torch.equal(pieces.sort(dim=1).values, tokens)


def test_deal_gives_heaviest_first_to_the_lightest_rank_with_room():
    assert deal([5, 1, 4, 2], 2) == ((0, 1), (2, 3))
    assert deal([1, 1, 1, 1], 2) == ((0, 2), (1, 3))  # ties: lower chunk, lower rank


@pytest.mark.parametrize("seq", [1024, 4096])
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("rows", ["owt-like", "zen-lines", "shakespeare"])
def test_worst_rank_within_ten_percent_of_the_mean(rows, seq, cp):
    """OWT-like rows and Shakespeare's rows across a play boundary: the positional split's
    visible work is off by more than 10% (measured first); zen lines (~40-token documents,
    many per row) spread evenly by position already, and there the positional split's cost
    is the waste: every masked tile computed."""
    ids = _rows(rows, seq, cp)
    worst_zigzag = worst_docs = 0.0
    computed = {"zigzag": 0, "documents": 0}
    for row in ids.split(1):
        docs = document_layout(row, cp)
        worst_docs = max(worst_docs, imbalance(rank_work(docs, seq, 1)))
        worst_zigzag = max(worst_zigzag, imbalance(visible_work(row, zigzag_layout(cp))))
        computed["zigzag"] += sum(rank_work(zigzag_layout(cp), seq, 1))
        computed["documents"] += sum(rank_work(docs, seq, 1))
    if rows != "zen-lines":
        assert worst_zigzag > 1.1, worst_zigzag
    assert worst_docs <= 1.1, worst_docs
    assert computed["documents"] < computed["zigzag"] / (2 if rows == "zen-lines" else 1)


def _rows(name: str, seq: int, cp: int) -> torch.Tensor:
    if name == "owt-like":
        return owt_like(seq, 8, seed=seq + cp)
    if name == "zen-lines":
        return zen_packed(seq, 8)
    data = Path(ROOT, "data", "shakespeare")
    if not (data / "train.docs.npy").is_file():
        pytest.skip("the quick-start data (data/shakespeare) is not prepared")
    return shakespeare_packed(data, seq, 8)


@pytest.mark.parametrize("cp,k", [(4, 2), (8, 2), (8, 4)])
def test_hybrid_ring_groups_hold_every_chunk_once_and_balanced_work(cp, k):
    """Under cp_comm=hybrid the ring over the cp/k a2a groups holds each group's chunks: a
    partition of the row, k ranks' tokens per group, and the worst group within 10% of the
    mean (the sum of its members', each near the mean)."""
    ids = owt_like(4096, 8, seed=cp + k)
    layout = document_layout(ids, cp)
    groups = group_layout(layout, k)
    assert sorted(c for held in groups.ranks for c in held) == list(range(layout.n))
    assert {len(held) for held in groups.ranks} == {k * layout.n // cp}
    work = rank_work(groups, 4096, ids.shape[0])
    assert max(work) <= 1.10 * sum(work) / len(work)


def test_one_document_keeps_zigzag_balance_and_computes_the_causal_triangle():
    ids = torch.zeros(1, SEQ, dtype=torch.int64)
    layout = document_layout(ids, 4)
    work = rank_work(layout, SEQ, 1)
    assert sum(work) == SEQ * (SEQ + 1) // 2  # nothing hidden, nothing skipped
    assert imbalance(work) <= 1.01


def _computed(layout, rank, src, chunk):
    """(Tq, Tk) count of the pairs the plan computes for rank's queries and src's keys."""
    q_ids, kv_ids = list(layout.ranks[rank]), list(layout.ranks[src])
    hits = torch.zeros(len(q_ids) * chunk, len(kv_ids) * chunk, dtype=torch.long)
    for b in plan_step(q_ids, kv_ids, True, layout.visible):
        block = torch.ones((b.q1 - b.q0) * chunk, (b.k1 - b.k0) * chunk, dtype=torch.long)
        qs, ks = b.slices(chunk)
        hits[qs, ks] += block.tril() if b.causal else block
    return hits


@pytest.mark.parametrize("cp", [2, 4])
def test_plan_computes_each_visible_pair_once_and_skips_hidden_tiles(cp):
    ids = rows_of_lengths([40, 3, 70, 9, 20, 60, 5, 200], 128, 1)
    layout = document_layout(ids, cp)
    chunk = 128 // layout.n
    pos = torch.arange(128)
    computed = 0
    for rank in range(cp):
        for src in range(cp):
            hits = _computed(layout, rank, src, chunk)
            q, k = take(pos[None], layout, rank)[0], take(pos[None], layout, src)[0]
            q_ids, k_ids = ids[0, q], ids[0, k]
            visible = (q_ids[:, None] == k_ids[None, :]) & (k[None, :] <= q[:, None])
            assert hits.max() <= 1 and torch.equal(hits.bool() | visible, hits.bool())
            assert not (hits.bool() & (k[None, :] > q[:, None])).any()  # never a future key
            computed += int(hits.sum())
    assert computed == sum(rank_work(layout, 128, 1))
    assert computed < 128 * 129 // 2  # hidden tiles skipped: less than the causal triangle


def test_loader_cuts_tokens_targets_and_positions_by_the_layout():
    eos = 7
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, eos, (2, 129), generator=gen)
    batch[:, [10, 11, 30, 90, 100]] = eos
    cp = 2
    parts = [
        BatchSlice(cp=CPInfo(cp, r, balance="documents"), eos_id=eos).microbatches(batch, 1)[0]
        for r in range(cp)
    ]
    ids = document_ids(batch[:, :-1], eos)
    layout = document_layout(ids, cp)
    assert layout.ranks != zigzag_layout(cp).ranks or layout.n != 2 * cp
    for r, micro in enumerate(parts):
        assert torch.equal(micro.inputs, take(batch[:, :-1], layout, r))
        assert torch.equal(micro.targets, take(batch[:, 1:], layout, r))
        assert torch.equal(micro.positions, take(document_positions(ids), layout, r))
    zig = BatchSlice(cp=CPInfo(cp, 0), eos_id=eos).microbatches(batch, 1)[0]  # position: as before
    assert torch.equal(zig.inputs, CPInfo(cp, 0).shard(batch[:, :-1]))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["parallel.cp_balance=docs"], r"parallel.cp_balance='docs' is not one of position"),
        (["parallel.cp_balance=documents"], r"needs data.document_mask=true"),
        (
            ["parallel.cp_balance=documents", "data.document_mask=true", "model.n_experts=4"],
            r"model.n_experts=4: MoE capacity",
        ),
        (
            ["parallel.cp_balance=documents", "data.document_mask=true", "parallel.cp_comm=a2a"],
            r"parallel.cp_comm=a2a: the split is for the ring",
        ),
    ],
)
def test_bad_cp_balance_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)
