"""Which tokens of the global batch this rank trains on (docs/architecture.md, step 1).

DP rank r takes rows [r·B/dp, (r+1)·B/dp) of the global batch (`rows`: the loop reads only
those), cut into microbatches; CP rank c takes its zigzag slice of every row's inputs and
targets; tp ranks see the same rows. So the summed loss and the token count over dp × cp are
those of the whole batch.

Under `data.document_mask` each microbatch also carries its rows' document ids and per-document
positions (parallel/context/documents.py), computed on the whole rows before the cp slice: a
document may cross the zigzag chunks, and ring attention masks every key block with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.config.blend import parse_blend
from megapipe.data.layout import read_meta
from megapipe.parallel.context.documents import document_ids, document_positions
from megapipe.parallel.context.zigzag import NO_CP, CPInfo, cp_info
from megapipe.pipeline.runtime import MicroBatch


def split_inputs(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) token rows -> inputs (B, T) and next-token targets (B, T)."""
    return batch[:, :-1], batch[:, 1:]


def document_eos(cfg: Config) -> int | None:
    """The EOS id that ends documents under data.document_mask (None: masking off): the
    dataset's meta.json eos_id (a blend's datasets share one tokenizer, data/loader.py checks
    it: the first one's). Synthetic tokens have no documents; they take model.vocab_size - 1 as
    their EOS, so random rows hold random documents (about one per vocab_size tokens) and the
    masked paths run in tests and benchmarks exactly as on real data."""
    d = cfg.data
    if not d.document_mask:
        return None
    if d.source == "synthetic":
        return cfg.model.vocab_size - 1
    path = parse_blend(d.blend)[0][0] if d.blend else d.path
    return int(read_meta(Path(path))["eos_id"])


@dataclass(frozen=True)
class BatchSlice:
    """This rank's rows (dp) and sequence slice (cp), and the sum over the dp × cp replicas."""

    dp_size: int = 1
    dp_rank: int = 0
    cp: CPInfo = NO_CP
    group: object = None  # dp × cp: the ranks that hold the same weights, different tokens
    global_batch: int = 0  # train.global_batch (0: unknown; every batch given is the global one)
    eos_id: int | None = None  # document masking: the token that ends a document; None: off

    @staticmethod
    def of(
        mesh, global_batch: int = 0, eos_id: int | None = None, balance: str = "position"
    ) -> BatchSlice:
        if mesh is None:
            return BatchSlice(global_batch=global_batch, eos_id=eos_id)
        dp, rank, cp = mesh.size("dp"), mesh.coord("dp"), cp_info(mesh, balance=balance)
        return BatchSlice(dp, rank, cp, mesh.replica_group, global_batch, eos_id)

    def rows(self, size: int) -> slice:
        """This dp rank's rows of a global batch of `size`: what it reads (TokenData.batch)."""
        share = size // self.dp_size
        return slice(self.dp_rank * share, (self.dp_rank + 1) * share)

    def microbatches(self, batch: torch.Tensor, count: int) -> list[MicroBatch]:
        """This rank's `count` microbatches of `batch`: the global (B, T+1) batch, or exactly
        this rank's rows of it (B/dp, read alone: `rows`)."""
        rows = batch
        if self.dp_size > 1 and len(batch) != self.global_batch // self.dp_size:
            if self.global_batch and len(batch) != self.global_batch:
                raise ValueError(
                    f"batch of {len(batch)} rows is neither the global batch "
                    f"({self.global_batch}) nor this dp rank's {self.global_batch // self.dp_size}"
                )
            rows = batch.chunk(self.dp_size)[self.dp_rank]
        out = []
        for micro in rows.chunk(count):
            inputs, targets = split_inputs(micro)
            out.append(self._micro(inputs, targets))  # (b, T/cp)
        return out

    def _micro(self, inputs: torch.Tensor, targets: torch.Tensor) -> MicroBatch:
        """(b, T) inputs and targets cut for cp, (b, T/cp); under document masking with the
        rows' document ids (whole rows) and this rank's slice of their per-document positions,
        cut by the microbatch's document-balanced layout under parallel.cp_balance=documents
        (the ring computes the same layout from the same ids)."""
        if self.eos_id is None:
            return MicroBatch(self.cp.shard(inputs), self.cp.shard(targets))
        ids = document_ids(inputs, self.eos_id)  # (b, T): on the whole rows, before the cut
        layout = self.cp.layout(ids)
        inputs, targets, pos = (
            self.cp.shard(x, 1, layout) for x in (inputs, targets, document_positions(ids))
        )
        return MicroBatch(inputs, targets, pos, ids)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values of this rank's cp slice of its rows, (b, T/cp), as the whole rows
        (b, T): gathered over cp and put back in order (the inverse of `microbatches`' cut)."""
        return self.cp.unshard(x, dim=1)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over dp × cp: every rank's share of the loss and the token count."""
        if self.dp_size * self.cp.size > 1:
            dist.all_reduce(x, group=self.group)
        return x
