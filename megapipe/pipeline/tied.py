"""The tied embedding under pipelining: one logical table, two copies, one gradient.

With `model.tie_embeddings` the LM head reuses the token table. The first stage holds it in its
embedding, the last stage keeps its own copy under the same logical name (Megatron's shared word
embeddings, Shoeybi et al. 2019); after backward the two grads are summed so both copies take the
same step. Which parameter is the copy is the model's knowledge (models/gpt.py: TIED_EMBEDDING).
"""

from __future__ import annotations

from torch import nn

from megapipe.parallel.precision import grad_of, set_grad
from megapipe.pipeline.p2p import TIED_TAG, swap_with_pp_peer
from megapipe.plan.actions import Placement


class TiedEmbedding:
    """This rank's copies of the tied table: {global stage: parameter} for stages 0 and last."""

    def __init__(
        self, chunks: list[nn.Module], stages: list[int], placement: Placement, mesh
    ) -> None:
        self.placement, self.mesh = placement, mesh
        self.last = placement.num_stages - 1
        self.copies: dict[int, nn.Parameter] = {}
        for stage, chunk in zip(stages, chunks):
            table = chunk.shared_table  # the tied head's or MTP's (models/gpt.py)
            if table is not None and stage in (0, self.last):
                self.copies[stage] = table

    def sync_grads(self) -> None:
        """Sum the tied embedding's grad over its two holders: local add or a p2p exchange."""
        if not self.copies or self.last == 0:
            return
        grads = {s: grad_of(w) for s, w in self.copies.items()}
        if len(self.copies) == 1:
            (mine,) = self.copies
            other = self.last if mine == 0 else 0
            grads[other] = swap_with_pp_peer(
                grads[mine], self.placement.locate(other)[0], self.mesh, TIED_TAG
            )
        total = grads[0] + grads[self.last]  # one order on both holders: bitwise-equal copies
        for w in self.copies.values():
            set_grad(w, total.clone())
