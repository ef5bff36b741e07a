"""A training step under pipeline parallelism (design.md, "One training step", with pp > 1).

This rank builds its chunks (`rank_blocks`), the runtime walks its action list, then: dp sum per
chunk (existing buckets), tp sum of partial grads, the tied embedding's grad summed between the
first and last stage (Megatron's shared word embeddings: the last stage keeps its own copy under
the same logical name), the global grad norm over pp × tp with every logical parameter counted
once, clip, AdamW. The loss, summed on the last stage, is all-reduced so every rank logs it.
Validation (`Pipeline.evaluate`) is the same forward pass without a schedule: each microbatch
walks the stages in order, and the last stage's summed cross entropy is all-reduced likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megapipe.config import Config
from megapipe.parallel.data.reducer import finish_gradients
from megapipe.distributed.mesh import rank_at
from megapipe.train.optim import global_grad_norm
from megapipe.pipeline import timeline
from megapipe.plan.channels import arrival_order
from megapipe.pipeline.p2p import Message, StageLinks
from megapipe.plan.partition import rank_blocks
from megapipe.pipeline.pipedream import PipeDream
from megapipe.pipeline.runtime import MicroBatch, PipelineRuntime
from megapipe.plan.schedules import build_schedule, placement
from megapipe.parallel.autograd.segment_kv import segment_bounds
from megapipe.plan.simulate import Costs
from megapipe.parallel.tensor.grad_sync import grads_counted_once
from megapipe.train.step import (
    Parallel,
    StepResult,
    autocast,
    build_model,
    clip_and_step,
)

TIED_TAG = 1 << 30  # the tied-embedding grad exchange (pipeline messages go untagged, 0)
TIED = "embed.tok.weight"


@dataclass
class Pipeline:
    """This rank's chunks and everything a pipelined step needs; `model` holds all chunks."""

    cfg: Config
    mesh: object
    chunks: list[nn.Module]
    runtime: PipelineRuntime
    actions: list  # this rank's
    arrivals: dict  # {peer pp rank: messages in its send order} (channels.arrival_order)
    par: Parallel  # dp slice and dp sum
    reducers: list
    pipedream: PipeDream | None = None  # pipedream_async: weight versions, per-microbatch steps
    profile_in: int = 0  # zb_v: rebuild from the costs measured in this many steps (0: never)

    @property
    def model(self) -> nn.Module:
        return nn.ModuleList(self.chunks)

    @staticmethod
    def build(cfg: Config, mesh, device="cpu", bucket_mb: float = 25.0) -> Pipeline:
        p, m = cfg.parallel, cfg.model
        place = placement(p.schedule, p.pp, p.vpp)
        pp_rank = mesh.coord("pp")
        chunks = [build_model(cfg, mesh, device, blocks)
                  for blocks in rank_blocks(cfg, pp_rank, place)]
        seq = m.seq_len // p.cp  # cp: every stage passes this rank's zigzag slice
        seq = seq // p.tp if p.sequence_parallel and p.tp > 1 else seq
        shape = (cfg.derived.micro_batch_size, seq, m.d_model)
        segments = segment_bounds(cfg)  # Seq1F1B: [(s_i, e_i)]; [(0, T)] otherwise
        lengths = tuple((e - s) * shape[1] // m.seq_len for s, e in segments)  # local n_i
        links = StageLinks(mesh, place, shape, device=device, segments=lengths)
        positions = mesh.cp_info().positions(m.seq_len)
        runtime = PipelineRuntime(chunks, place, pp_rank, links, positions,
                                  partial(autocast, cfg, torch.device(device)), segments)
        opts = {"weight_sync": p.weight_sync} if p.schedule == "pipedream_async" else {}
        if p.schedule == "zb_v" and p.schedule_costs not in ("profile", "unit"):
            opts = {"costs": Costs.parse(p.schedule_costs)}
        schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp, p.seq_segments,
                                  **opts)
        # One dp reducer per chunk; chunk 0's Parallel also gives the dp slice and dp sum
        # (building another for that would hook a second, idle reducer onto chunk 0).
        pars = [Parallel.build(mesh, c, bucket_mb) for c in chunks]
        pipe = Pipeline(cfg, mesh, chunks, runtime, [], {}, pars[0], [q.reducer for q in pars])
        pipe.use_schedule(schedule)
        # the second step is profiled: the first pays one-off costs (allocations, lazy init)
        pipe.profile_in = 2 if p.schedule == "zb_v" and p.schedule_costs == "profile" else 0
        return pipe

    def _schedule_from_profile(self) -> None:
        """ZB-V from the costs this step measured (Zero Bubble §3.2 schedules with profiled
        T_F, T_B, T_W: with B > W the unit-time order idles), agreed on by every rank."""
        p = self.cfg.parallel
        costs = timeline.agreed_costs(self.runtime.events, self.mesh, p.vpp)
        self.use_schedule(build_schedule(p.schedule, p.pp, p.microbatches, p.vpp, costs=costs))

    def use_schedule(self, schedule: dict) -> None:
        """Run `schedule` ({pp rank: actions}, on this placement): this rank's actions and the
        order its peers send in (every rank must use the same schedule)."""
        pp_rank = self.mesh.coord("pp")
        self.actions = schedule[pp_rank]
        self.arrivals = arrival_order(schedule, self.runtime.placement, pp_rank)
        self.profile_in = 0  # a schedule given is the one to run
        if self.cfg.parallel.schedule == "pipedream_async":
            self.pipedream = PipeDream(self.runtime, self.actions)

    def forward_backward(self, micro: list[MicroBatch], loss_scale: float) -> torch.Tensor:
        """This rank's actions over `micro`: gradients accumulated, the summed loss returned.
        Under zb_v's `profile` the second call also rebuilds the schedule from its costs."""
        loss_sum = self.runtime.run(self.actions, micro, loss_scale, self.reducers, self.arrivals)
        if self.profile_in:
            self.profile_in -= 1
            if not self.profile_in:
                self._schedule_from_profile()
        return loss_sum

    def train_step(self, optimizer, batch: torch.Tensor, step: int) -> StepResult:
        if self.pipedream is not None:  # an optimizer step per microbatch, inside the run
            return self.pipedream.train_step(self, optimizer, batch, step)
        cfg = self.cfg
        global_tokens = cfg.train.global_batch * cfg.model.seq_len
        rows = self.par.local_rows(batch).chunk(cfg.parallel.microbatches)
        micro = [MicroBatch(*self.par.local_inputs(r)) for r in rows]
        loss_sum = self.forward_backward(micro, global_tokens)
        for chunk, reducer in zip(self.chunks, self.reducers):
            finish_gradients(chunk, reducer)
        self._sync_tied_grads()
        norm = global_grad_norm(self._grads_counted_once(), self.mesh.norm_group)
        params = [q for c in self.chunks for q in c.parameters()]
        lr = clip_and_step(optimizer, params, norm, step, cfg)
        dist.all_reduce(loss_sum, group=self.mesh.group("pp"))  # only the last stage's is not 0
        loss = self.par.dp_sum(loss_sum) / global_tokens
        return StepResult(loss=loss.item(), grad_norm=norm.item(), lr=lr)

    @torch.no_grad()
    def evaluate(self, data) -> float:
        """Mean validation loss, as trainer.evaluate on one process: forward only, each
        microbatch through the stages in order over the links; the last stage sums the cross
        entropy, summed over pp (other stages add 0) and dp × cp so every rank returns it."""
        cfg, device = self.cfg, next(self.chunks[0].parameters()).device
        loss, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
        for chunk in self.chunks:
            chunk.eval()
        for i in range(cfg.train.eval_batches):
            batch = data.batch(i, cfg.train.global_batch, split="val").to(device)
            for mb, rows in enumerate(self.par.local_rows(batch).chunk(cfg.parallel.microbatches)):
                inputs, targets = self.par.local_inputs(rows)
                loss += self._forward_only(mb, inputs, targets)
                tokens += targets.numel()
            self.runtime.links.flush()  # every send done before its buffer could be reused
        for chunk in self.chunks:
            chunk.train()
        dist.all_reduce(loss, group=self.mesh.group("pp"))
        total = self.par.dp_sum(torch.stack([loss, loss.new_tensor(tokens)]))
        return (total[0] / total[1]).item()

    def _forward_only(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Microbatch `mb` through this rank's stages in ascending order (every rank walks the
        stages in one global order, so each receive's send is already posted or next); returns
        its summed cross entropy on the last stage, else 0."""
        rt, loss = self.runtime, 0.0
        for c in sorted(range(len(self.chunks)), key=rt.stages.__getitem__):
            stage = rt.stages[c]
            x = inputs if stage == 0 else rt.links.take(Message(False, mb, stage - 1))
            last = stage == rt.last_stage
            with rt.autocast():
                out = self.chunks[c](x, targets=targets if last else None,
                                     positions=rt.positions)
            if last:
                loss += out.item()
            else:
                rt.links.exchange([(Message(False, mb, stage), out)], [])
        return loss

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
