"""Sliding-window attention on global positions, and what it hides inside ring attention's tiles.

The window (`model.sliding_window`, Mistral 7B §2, Jiang et al. 2023): a query at position i
sees the keys j with i − window < j <= i, itself and the window − 1 keys before it. That is
transformers' rule (masking_utils.sliding_window_overlay: kv_idx > q_idx − sliding_window, and
causal), which tests/test_sliding_window_cp.py checks against Qwen3's own mask. Positions are
those of the whole row, before any cp split, so every cp layout (zigzag, contiguous, the
document-balanced chunks of balance.py) masks the same pairs as one process. Under document
masking the rule is the window AND the same document (positions differ by the same amount in
the row and in the document, so either gives the same window).

In the ring, a (q chunk, kv chunk) tile whose every pair lies window or more keys back is
skipped, as tiles above the causal diagonal are: no key that far back is ever read (the fact
behind Mistral's rolling buffer cache, §2, which keeps only the last window keys). A tile that
straddles the window's edge runs with its outside pairs hidden; a tile wholly inside it needs no
mask and keeps the fast kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def in_window(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """(…, Tq, Tk) bool, True where a query at q_pos (…, Tq) may see a key at k_pos (…, Tk):
    not after it and fewer than `window` positions before it."""
    gap = q_pos[..., :, None] - k_pos[..., None, :]
    return (gap >= 0) & (gap < window)


def chunk_positions(chunks, chunk: int, device=None) -> Tensor:
    """Row positions of the tokens of global chunks `chunks` (each `chunk` tokens), in order."""
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def window_tiles(n: int, chunk: int, window: int) -> list[list[bool]]:
    """(n, n): q chunk a has a key of kv chunk b in its window. Causal tiles only (b <= a); the
    nearest pair of an earlier tile is a's first token and b's last, (a − b − 1)·chunk + 1 apart."""
    return [[b <= a and (a - b - 1) * chunk + 1 < window for b in range(n)] for a in range(n)]


def and_tiles(a: list[list[bool]] | None, b: list[list[bool]]) -> list[list[bool]]:
    """Tiles visible under both tile masks (a None: every tile)."""
    return b if a is None else [[x and y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def straddles(q_chunks, kv_chunks, chunk: int, window: int) -> bool:
    """Whether some causal pair of the tile q_chunks × kv_chunks (global chunk ids) lies window
    or more keys back: its farthest pair is a's last token and b's first, (a − b + 1)·chunk − 1."""
    gaps = [(a - b + 1) * chunk - 1 for a in q_chunks for b in kv_chunks if b <= a]
    return bool(window) and max(gaps, default=0) >= window


@dataclass(frozen=True)
class TileMasks:
    """What hides keys of a ring tile besides causality, for every ring step: other documents
    (`q_ids`, `kv_ids[step]`: (B, T/cp) document ids) and the window (`q_chunks`,
    `kv_chunks[step]`: global chunk ids, each `chunk` tokens). Either part may be absent."""

    device: torch.device
    chunk: int
    q_chunks: tuple[int, ...]
    kv_chunks: list[tuple[int, ...]]
    window: int = 0
    q_ids: Tensor | None = None
    kv_ids: list[Tensor] | None = None

    def hide(self, step: int, tile) -> Tensor | None:
        """(B or 1, nq, nk) bool, True for the keys of ring tile `tile` (kernels.RingTile, local
        chunk indices) hidden from its queries; None where nothing but causality hides any."""
        qs, ks = tile.slices(self.chunk)
        hidden = None
        if self.q_ids is not None:
            q_ids, kv_ids = self.q_ids[:, qs], self.kv_ids[step][:, ks]
            hidden = q_ids[:, :, None] != kv_ids[:, None, :]
        q_chunks = self.q_chunks[tile.q0 : tile.q1]
        kv_chunks = self.kv_chunks[step][tile.k0 : tile.k1]
        if straddles(q_chunks, kv_chunks, self.chunk, self.window):
            q_pos = chunk_positions(q_chunks, self.chunk, self.device)
            k_pos = chunk_positions(kv_chunks, self.chunk, self.device)
            far = (q_pos[:, None] - k_pos[None, :] >= self.window).unsqueeze(0)  # (1, nq, nk)
            hidden = far if hidden is None else hidden | far
        return hidden
