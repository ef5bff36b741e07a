"""A training step under pipeline parallelism (design.md, "One training step", with pp > 1).

This rank builds its chunks (`rank_blocks`), the runtime walks its action list, then: dp sum per
chunk (existing buckets), tp sum of partial grads, the tied embedding's grad summed between the
first and last stage (Megatron's shared word embeddings: the last stage keeps its own copy under
the same logical name), the global grad norm over pp × tp with every logical parameter counted
once, clip, AdamW. The loss, summed on the last stage, is all-reduced so every rank logs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megapipe.config import Config, ConfigError
from megapipe.data_parallel import finish_gradients
from megapipe.mesh import rank_at
from megapipe.optim import global_grad_norm
from megapipe.pipeline.p2p import StageLinks
from megapipe.pipeline.partition import rank_blocks
from megapipe.pipeline.runtime import MicroBatch, PipelineRuntime
from megapipe.pipeline.schedules import build_schedule, placement
from megapipe.tensor_parallel.grad_sync import grads_counted_once
from megapipe.trainer import (
    Parallel,
    StepResult,
    autocast,
    build_model,
    clip_and_step,
    split_inputs,
)

UNSUPPORTED = {  # schedules the runtime does not run yet: the feature each one still needs
    "seq1f1b": "sequence segments with the KV of earlier segments kept (Seq1F1B)",
    "pipedream_async": "weight versions and stashing without a flush (PipeDream)",
}
TIED_TAG = 1 << 30  # the tied-embedding grad exchange; activation/grad tags stay below it
TIED = "embed.tok.weight"


def check_pipeline(cfg: Config) -> None:
    """One-line ConfigError for what pipelined training cannot do yet (before any collective).

    Chunk counts (vpp) per schedule and stage counts are config checks (config_checks.py)."""
    p = cfg.parallel
    if p.pp == 1:
        return
    if p.schedule in UNSUPPORTED:
        raise ConfigError(f"parallel.schedule={p.schedule} is not supported by the pipeline "
                          f"runtime yet (needs {UNSUPPORTED[p.schedule]}); use gpipe, 1f1b, "
                          "interleaved_1f1b, zb_h1, zb_h2 or zb_v")
    if cfg.train.eval_interval:
        raise ConfigError("train.eval_interval > 0 with parallel.pp > 1: pipelined validation "
                          "is not implemented yet; set train.eval_interval=0")
    c = cfg.checkpoint
    if c.interval or cfg.train.stop_at_step or c.resume not in ("auto", "none"):
        raise ConfigError("checkpoints with parallel.pp > 1 are not implemented yet; set "
                          "checkpoint.interval=0, train.stop_at_step=0, checkpoint.resume=none")


@dataclass
class Pipeline:
    """This rank's chunks and everything a pipelined step needs; `model` holds all chunks."""

    cfg: Config
    mesh: object
    chunks: list[nn.Module]
    runtime: PipelineRuntime
    actions: list
    par: Parallel  # dp slice and dp sum
    reducers: list

    @property
    def model(self) -> nn.Module:
        return nn.ModuleList(self.chunks)

    @staticmethod
    def build(cfg: Config, mesh, device="cpu", bucket_mb: float = 25.0) -> Pipeline:
        p, m = cfg.parallel, cfg.model
        check_pipeline(cfg)
        place = placement(p.schedule, p.pp, p.vpp)
        pp_rank = mesh.coord("pp")
        chunks = [build_model(cfg, mesh, device, blocks)
                  for blocks in rank_blocks(cfg, pp_rank, place)]
        seq = m.seq_len // p.tp if p.sequence_parallel and p.tp > 1 else m.seq_len
        shape = (cfg.derived.micro_batch_size, seq, m.d_model)
        links = StageLinks(mesh, place, shape, device=device)
        runtime = PipelineRuntime(chunks, place, pp_rank, links, m.seq_len,
                                  partial(autocast, cfg, torch.device(device)))
        actions = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp)[pp_rank]
        # One dp reducer per chunk; chunk 0's Parallel also gives the dp slice and dp sum
        # (building another for that would hook a second, idle reducer onto chunk 0).
        pars = [Parallel.build(mesh, c, bucket_mb) for c in chunks]
        return Pipeline(cfg, mesh, chunks, runtime, actions, pars[0], [q.reducer for q in pars])

    def train_step(self, optimizer, batch: torch.Tensor, step: int) -> StepResult:
        cfg = self.cfg
        global_tokens = cfg.train.global_batch * cfg.model.seq_len
        rows = self.par.local_rows(batch).chunk(cfg.parallel.microbatches)
        micro = [MicroBatch(*split_inputs(r)) for r in rows]
        loss_sum = self.runtime.run(self.actions, micro, global_tokens, self.reducers)
        for chunk, reducer in zip(self.chunks, self.reducers):
            finish_gradients(chunk, reducer)
        self._sync_tied_grads()
        norm = global_grad_norm(self._grads_counted_once(), self.mesh.norm_group)
        params = [q for c in self.chunks for q in c.parameters()]
        lr = clip_and_step(optimizer, params, norm, step, cfg)
        dist.all_reduce(loss_sum, group=self.mesh.group("pp"))  # only the last stage's is not 0
        loss = self.par.dp_sum(loss_sum) / global_tokens
        return StepResult(loss=loss.item(), grad_norm=norm.item(), lr=lr)

    def _tied_copies(self) -> dict[int, nn.Parameter]:
        """{global stage: this rank's copy} of the tied embedding, for the first and last stage."""
        if not self.cfg.model.tie_embeddings:
            return {}
        last = self.runtime.last_stage
        return {s: c.embed.tok.weight for s, c in zip(self.runtime.stages, self.chunks)
                if s in (0, last)}

    def _sync_tied_grads(self) -> None:
        """Sum the tied embedding's grad over its two holders: local add or a p2p exchange."""
        copies, last = self._tied_copies(), self.runtime.last_stage
        if not copies or last == 0:
            return
        grads = {s: w.grad for s, w in copies.items()}
        if len(copies) == 1:
            (mine,) = copies
            other = last if mine == 0 else 0
            peer_pp = self.runtime.placement.locate(other)[0]
            peer = rank_at(self.mesh.sizes, **{**self.mesh.coords, "pp": peer_pp})
            grads[other] = torch.empty_like(grads[mine])
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, grads[mine], peer, tag=TIED_TAG),
                dist.P2POp(dist.irecv, grads[other], peer, tag=TIED_TAG),
            ])
            for work in works:
                work.wait()
        total = grads[0] + grads[last]  # one order on both holders: bitwise-equal copies
        for w in copies.values():
            w.grad = total.clone()

    def _grads_counted_once(self) -> list[torch.Tensor]:
        """Each logical grad once over pp × tp: the last stage's tied copy is left out."""
        out = []
        for stage, chunk in zip(self.runtime.stages, self.chunks):
            skip = (TIED,) if stage != 0 and chunk.embed is not None else ()
            out += grads_counted_once(chunk, skip)
        return out
