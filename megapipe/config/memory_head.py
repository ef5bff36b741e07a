"""The fused LM head's transient: what `parallel/tensor/cross_entropy.linear_cross_entropy`
holds at one chunk's height beyond the tensors it saves (config/memory_terms.head_terms) and the
grads the memory plan counts, in forward and in backward, as the code allocates it.

Pure arithmetic (no torch). R = the chunk's rows (config/memory_terms.head_chunk_rows with the
arguments the code passes: this rank's padded vocabulary slice V = ⌈V/tp⌉, the kernels'
device, the microbatch's (or Seq1F1B segment's) N tokens, the device's memory), d = d_model,
c = bytes of the compute dtype, r = bytes of the residual stream (the head's input):

  float32 (c = 4): the chunk's logits, one float32 buffer of R·V·4 that every chunk's matmul
      writes into (exp and the softmax in place). Backward adds the grads it returns, the input
      grad N·d·4 and the float32 weight grad V·d·4 (before autograd adds it into .grad), and
      the folded one-hot's (R, d) operands: the targets' rows of W, h/Σexp and the −h that
      index_add_ scales (3·R·d·4; under tp a fourth, the masked h).
  bf16 autocast (c = 2): autocast's weight cast V·d·2 (float32 weights only: the forward and
      the backward each recast it); per chunk the bf16 product R·V·2 and its float32 copy
      R·V·4 (6 B per logit), then the float32 probabilities, their bf16 copy R·V·2 and the
      chunk's bf16 weight-grad product V·d·2 at once. Backward adds the input grad N·d·2 and
      the float32 weight grad V·d·4; as it returns, the input grad cast to the stream's dtype
      (N·d·r). Under bf16 weights the chunk's weight grad goes into the main grad instead
      (no V·d product, float32 grad or cast of it): the chunk's input scaled by the loss's
      grad R·d·2 and what the fused add makes (`_into_main`: CUDA's float32 product V·d·4,
      the CPU's widened operands R·(V + d)·4, nothing into a bf16 main grad).
  grads made in forward (config/memory_terms.head_grad_in_forward): forward holds the chunk as
      backward does, but the input and weight grads are saved (head_terms) and the head's
      input in the compute dtype (its bf16 copy N·d·2 under float32 weights) is not, so it is
      transient here; backward only scales the grads and casts them as above.

Left out: the per-token (R,) vectors of a chunk (its maxima, sums, picked logits). On the CPU
the float32 buffer is kept from call to call (cross_entropy.HeadBuffers); counted here, at the
head, only. config/memory_plan.RankMemory.peak adds the larger of forward's and backward's to
the activation peak of the ranks holding the head; tests/test_dry_run_allocations.py measures
it, alone and in runs' peaks.
"""

from __future__ import annotations

from megapipe.config.memory_terms import (
    compute_bytes,
    head_chunk_rows,
    head_grad_in_forward,
    rank_dims,
    residual_bytes,
    segments,
    tied_lookup_with_head,
)
from megapipe.config.schema import Config
from megapipe.config.states import FLOAT32, main_grad_bytes


def head_transient_bytes(cfg: Config, device: str = "cuda", memory: float | None = None) -> float:
    """Bytes the fused head + loss holds at its height (module docstring), the larger of its
    forward and its backward, over the Seq1F1B segments (each a call of its own), on a rank
    holding the head, for a job on `device`'s kernels ("cuda" or "cpu") with `memory` bytes
    of device memory (None: the CPU's 256-row chunks)."""
    return max(_transient(cfg, device, memory, i) for i in segments(cfg))


def _transient(cfg: Config, device: str, memory: float | None, segment: int | None) -> float:
    x, d = rank_dims(cfg, segment), cfg.model.d_model
    c, r = compute_bytes(cfg), residual_bytes(cfg)
    rows = head_chunk_rows(x.vocab, device, x.n, memory)
    logits = rows * x.vocab
    early = head_grad_in_forward(cfg)
    returned = x.n * d * r * (r != c) + x.vocab * d * 2 * (r != FLOAT32)  # the final casts
    if c == FLOAT32:
        folded = rows * d * FLOAT32 * (4 if cfg.parallel.tp > 1 else 3)
        chunk = logits * FLOAT32 + folded
        grads = x.n * d * FLOAT32 + x.vocab * d * FLOAT32
        if early:
            return max(chunk, returned)
        return max(logits * FLOAT32, chunk + grads)
    cast = x.vocab * d * c if r == FLOAT32 else 0  # autocast's copy of the float32 weight
    chunk = cast + logits * (c + FLOAT32) + x.vocab * d * c
    grads = x.n * d * c + x.vocab * d * FLOAT32
    if early:  # the head input's bf16 copy is not saved here
        return max(chunk + x.n * d * c * (r != c), returned)
    forward = cast + logits * (c + FLOAT32)
    if r != FLOAT32 and not tied_lookup_with_head(cfg):  # bf16 weights: each chunk's weight
        # grad into the head weight's main grad (a tied table's lookup in the same graph takes
        # the grad back from the head instead: parallel/autograd/tied_lookup.py)
        into = logits * (c + FLOAT32) + rows * d * c + _into_main(cfg, device, rows, x.vocab)
        return max(forward, into + x.n * d * c)
    return max(forward, chunk + grads, cast + grads + returned)


def _into_main(cfg: Config, device: str, rows: int, vocab: int) -> float:
    """What parallel/precision.fused_weight_grad makes to add one chunk's (V, rows)·(rows, d)
    weight grad into the main grad: a bf16 main grad adds the bf16 product in place; a
    float32 one takes CUDA's float32-output matmul (V·d·4), or on the CPU the operands
    widened (rows·(V + d)·4)."""
    d = cfg.model.d_model
    if main_grad_bytes(cfg) != FLOAT32:
        return 0.0
    return vocab * d * FLOAT32 if device == "cuda" else rows * (vocab + d) * FLOAT32
