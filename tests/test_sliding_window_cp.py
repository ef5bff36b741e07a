"""Sliding-window attention's mask and the ring's tiles under it (parallel/context/window.py),
without process groups: the mask is transformers' (Qwen3's own, alone and on packed documents),
the tile-skip and tile-mask decisions are the mask's, and the ring's plan with its tile masks
covers exactly the windowed pairs on every cp layout. The spawned ring runs are
tests/test_ring_attention.py's; the training parity under cp, tests/test_parity_cp.py's.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config
from transformers.masking_utils import create_sliding_window_causal_mask

from megapipe.models.attention import attention_core
from megapipe.parallel.context.balance import document_layout, positional_layout, take
from megapipe.parallel.context.documents import document_positions, visible_keys
from megapipe.parallel.context.kernels import plan_step
from megapipe.parallel.context.ring import ring_attention
from megapipe.parallel.context.window import (
    TileMasks,
    and_tiles,
    chunk_positions,
    in_window,
    straddles,
    window_tiles,
)
from tests.parity import tiny_config

WINDOWS = (1, 2, 3, 5, 8, 13, 40)


def qwen3_mask(window: int, positions: torch.Tensor) -> torch.Tensor:
    """transformers' sliding-window mask of Qwen3's sliding layers (T, T) for one row whose
    position ids are `positions` (T,): restarting ids mark packed documents."""
    cfg = Qwen3Config(
        vocab_size=8, hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
        num_hidden_layers=1, intermediate_size=8, use_sliding_window=True, sliding_window=window,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"  # a boolean (1, 1, T, T) mask
    x = torch.zeros(1, positions.numel(), 8)
    mask = create_sliding_window_causal_mask(
        cfg, x, None, None, position_ids=positions[None], allow_is_causal_skip=False
    )
    return mask[0, 0]


@pytest.mark.parametrize("window", WINDOWS)
def test_window_mask_is_qwen3s_own(window):
    """Off by none: a query sees itself and window − 1 keys back, as transformers' Qwen3."""
    pos = torch.arange(24)
    assert torch.equal(in_window(pos, pos, window), qwen3_mask(window, pos))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([7, 2, 11, 4]))[None]  # (1, 24)
    ours = in_window(pos, pos, window) & visible_keys(ids, 24, 24)[0]  # window AND document
    assert torch.equal(ours, qwen3_mask(window, document_positions(ids)[0]))


def _brute(q_chunks, kv_chunks, chunk, window):
    """(any pair visible, any causal pair outside the window) of a tile, pair by pair."""
    q_pos, k_pos = chunk_positions(q_chunks, chunk), chunk_positions(kv_chunks, chunk)
    causal = k_pos[None, :] <= q_pos[:, None]
    near = in_window(q_pos, k_pos, window)
    return bool(near.any()), bool((causal & ~near).any())


@pytest.mark.parametrize("chunk", [1, 3, 4, 8])
def test_tile_skip_and_mask_decisions_are_the_masks(chunk):
    n = 8
    for window in WINDOWS:
        tiles = window_tiles(n, chunk, window)
        for a in range(n):
            for b in range(n):
                seen, cut = _brute([a], [b], chunk, window)
                assert tiles[a][b] == seen, (a, b, chunk, window)
                assert straddles([a], [b], chunk, window) == cut, (a, b, chunk, window)
    assert straddles([3, 5], [0, 1], 4, 16) and not straddles([3], [2], 4, 16)
    assert and_tiles(None, tiles) is tiles
    assert and_tiles([[True, False]], [[False, True]]) == [[False, False]]


def _computed(layout, rank, src, chunk, window, ids):
    """(Tq, Tk) pairs the ring plan computes unmasked for rank's queries against src's block."""
    held = (layout.ranks[rank], layout.ranks[src])
    visible = and_tiles(layout.visible, window_tiles(layout.n, chunk, window))
    docs = (
        {}
        if ids is None
        else {"q_ids": take(ids, layout, rank), "kv_ids": [take(ids, layout, src)]}
    )
    masks = TileMasks(torch.device("cpu"), chunk, held[0], [held[1]], window, **docs)
    hits = torch.zeros(len(held[0]) * chunk, len(held[1]) * chunk, dtype=torch.long)
    for t in plan_step(list(held[0]), list(held[1]), True, visible):
        qs, ks = t.slices(chunk)
        block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.long)
        block = block.tril() if t.causal else block
        hide = masks.hide(0, t)
        hits[qs, ks] += block if hide is None else block * ~hide[0]
    assert hits.max() <= 1  # no pair twice
    return hits.bool()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("balanced", [False, True])
def test_ring_plan_with_tile_masks_computes_exactly_the_window(cp, balanced):
    """Every rank against every kv block: the pairs computed are the window's (and the
    document's, under the document-balanced layout), each once; skipped tiles lose none."""
    seq = 64
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([20, 5, 30, 9]))[None]
    layout = document_layout(ids, cp) if balanced else positional_layout(cp, True)
    chunk = seq // layout.n
    for window in WINDOWS:
        want_all = in_window(torch.arange(seq), torch.arange(seq), window)
        if balanced:
            want_all = want_all & visible_keys(ids, seq, seq)[0]
        for rank in range(cp):
            for src in range(cp):
                q_pos = chunk_positions(layout.ranks[rank], chunk)
                k_pos = chunk_positions(layout.ranks[src], chunk)
                got = _computed(layout, rank, src, chunk, window, ids if balanced else None)
                assert torch.equal(got, want_all[q_pos][:, k_pos]), (window, rank, src)


def _reference(q, k, v, mask):
    """float64 attention with an explicit (…, T, S) boolean mask."""
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), mask, enable_gqa=k.shape[1] != q.shape[1]
    ).float()


@pytest.mark.parametrize("window", [3, 40])
@pytest.mark.parametrize("S", [24, 32])  # S > T: a later Seq1F1B segment's keys
def test_one_process_core_is_window_and_document(window, S):
    g = torch.Generator().manual_seed(window + S)
    T = 24
    q = torch.randn(2, 4, T, 8, generator=g)
    k, v = (torch.randn(2, 2, S, 8, generator=g) for _ in range(2))
    lengths = [[9, 3, S - 12], [S]]
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    )
    pos = torch.arange(S)
    mask = (in_window(pos[S - T :], pos, window) & visible_keys(ids, T, S)).unsqueeze(1)
    want = _reference(q, k, v, mask)
    got = attention_core(q, k, v, 0.0, ids, window)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    if S == T:  # the ring's one-rank path is the same attention
        ring = ring_attention(q, k, v, None, documents=ids, window=window)
        assert ((ring - want).norm() / want.norm()).item() <= 1e-5


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.cp=2", "model.sliding_window=4"],
        ["parallel.cp=2", "parallel.cp_comm=a2a", "model.sliding_window=4"],
        ["data.document_mask=true", "model.sliding_window=4"],
    ],
)
def test_window_under_cp_and_documents_is_accepted(tmp_path, overrides):
    assert tiny_config(overrides, str(tmp_path)).model.sliding_window == 4
