"""A pipeline rank's chunks under a schedule: an `Engine` (pipeline/protocol.py) that the train
step core (train/step.py) drives.

This rank builds its chunks from the partition training uses (stages.py), the runtime walks its
action list (runtime.py), and the step core then finishes the gradients: dp × cp sum per chunk,
tp partial sums, the tied embedding's two copies summed (tied.py), the global norm over pp × tp
with every logical parameter counted once, clip, AdamW. The loss, summed on the last stage, is
all-reduced over pp so every rank logs it. Evaluation is the same forward without a schedule:
each microbatch walks the stages in order (`forward_only`). See docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megapipe.config import Config
from megapipe.config.flops import segment_bounds
from megapipe.config.pipeline_split import schedule_of
from megapipe.config.states import replica_bucket_mb
from megapipe.parallel.data.levels import Sharding
from megapipe.parallel.fp8 import NO_FP8, Fp8
from megapipe.parallel.tensor.grad_sync import grads_counted_once
from megapipe.pipeline import timeline
from megapipe.pipeline.dual import counted_chunks, sync_twin_grads
from megapipe.pipeline.p2p import StageLinks
from megapipe.pipeline.protocol import SynchronousStep
from megapipe.pipeline.runtime import NO_HOOKS, Event, Hooks, MicroBatch, PipelineRuntime
from megapipe.pipeline.stages import Components, build_chunks, chunk_placement, weight_blocks
from megapipe.pipeline.tied import TiedEmbedding
from megapipe.plan.channels import arrival_order
from megapipe.plan.messages import Message
from megapipe.plan.schedules import SCHEDULES


@dataclass
class Pipeline(SynchronousStep):
    """This rank's chunks, its runtime and the schedule it runs."""

    cfg: Config
    mesh: object
    chunks: list[nn.Module]
    runtime: PipelineRuntime
    reducers: list  # one dp × cp GradReducer per chunk (None without replicas)
    tied: TiedEmbedding
    sharding: Sharding  # the ZeRO level (parallel/data/levels.py)
    actions: list = field(default_factory=list)  # this rank's
    arrivals: dict = field(default_factory=dict)  # {peer pp rank: its send order to us}
    # a schedule built for costs under parallel.schedule_costs=profile (zb_v, zb_auto): rebuild
    # from the costs measured in this many steps (0: never)
    profile_in: int = 0
    hooks: Hooks = NO_HOOKS  # additions to each action (an observer in tests; PipeDream's own)
    fp8: Fp8 = NO_FP8  # the FP8 policy the chunks were built with: its weight casts per step

    def __post_init__(self) -> None:  # a kind of pipeline sets up its own state here
        return None

    @property
    def norm_group(self):
        """pp × tp holds one copy of every parameter, unless the grads are spread over the
        replicas (the sharding's norm rule, parallel/data/levels.py): then every rank."""
        return self.sharding.norm_group(self.mesh)

    @property
    def device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    @property
    def events(self) -> list[Event]:
        """The last run's actions with their spans."""
        return self.runtime.events

    def params(self) -> list[nn.Parameter]:
        return [q for c in self.chunks for q in c.parameters()]

    def use_schedule(self, schedule: dict) -> None:
        """Run `schedule` ({pp rank: actions}, on this placement): this rank's actions and the
        order its peers send in (every rank must use the same schedule)."""
        pp_rank = self.mesh.coord("pp")
        self.actions = schedule[pp_rank]
        self.arrivals = arrival_order(schedule, self.runtime.placement, pp_rank)
        self.profile_in = 0  # a schedule given is the one to run

    def forward_backward(
        self, micro: list[MicroBatch], loss_scale: float, update=None, hooks: Hooks | None = None
    ) -> torch.Tensor:
        """This rank's actions over `micro`: gradients accumulated, the summed loss returned.
        `hooks`: this call's additions to each action in place of `self.hooks` (a wrapping
        engine's, train/post_validation.py). Under `profile` (a schedule built for costs) the
        second call also rebuilds the schedule from its costs."""
        hooks = self.hooks if hooks is None else hooks
        with self.fp8.step():  # no weight changes until the actions are done
            loss_sum = self.runtime.run(
                self.actions, micro, loss_scale, self.reducers, self.arrivals, hooks
            )
        if self.profile_in:
            self.profile_in -= 1
            if not self.profile_in:
                self._schedule_from_profile()
        return loss_sum

    def _schedule_from_profile(self) -> None:
        """The schedule (zb_v, zb_auto) rebuilt for the costs this step measured, agreed on by
        every rank (Zero Bubble §3 schedules with profiled T_F, T_B, T_W: with B > W the
        unit-time order idles)."""
        costs = timeline.agreed_costs(self.runtime.events, self.mesh, self.cfg.parallel.vpp)
        self.use_schedule(schedule_of(self.cfg, costs))

    def sync_shared_grads(self) -> None:
        self.tied.sync_grads()
        sync_twin_grads(self.chunks, self.runtime.placement, self.mesh)  # DualPipe (dual.py)

    def grads_counted_once(self) -> list[torch.Tensor]:
        """Each logical grad once over pp × tp: the last stage's tied copy is left out, and
        DualPipe's up copies (dual.py)."""
        chunks = counted_chunks(self.chunks, self.runtime.placement)
        keep = {id(c): self.sharding.counted(self.mesh, r)
                for c, r in zip(self.chunks, self.reducers)}  # fmt: skip
        return [
            g for c in chunks for g in grads_counted_once(c, c.tied_copy_names(), keep.get(id(c)))
        ]

    def stage_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss summed on the last stage, on every pp rank (the others add 0)."""
        dist.all_reduce(loss, group=self.mesh.group("pp"))
        return loss

    def forward_only(self, micro: list[MicroBatch]) -> list[float]:
        """Each microbatch's summed cross entropy (0 off the last stage), forward only."""
        losses = [self._walk(mb, m, _summed_loss, 0.0) for mb, m in enumerate(micro)]
        self.runtime.links.flush()  # every send done before its buffer could be reused
        return losses

    def token_logprobs(self, micro: list[MicroBatch]) -> list[torch.Tensor]:
        """Each microbatch's per-token target log-prob (b, T/cp) float64, forward only: made by
        the rank that runs the microbatch's last stage from its logits (gathered over tp), zeros
        on the others, then summed over pp so every pp rank holds them (one all-reduce)."""
        out = [
            self._walk(mb, m, _logprobs, m.targets.new_zeros(m.targets.shape, dtype=torch.float64))
            for mb, m in enumerate(micro)
        ]
        self.runtime.links.flush()
        if not out:
            return out
        joined = torch.stack(out)  # (microbatches, b, T/cp)
        dist.all_reduce(joined, group=self.mesh.group("pp"))
        return list(joined.unbind(0))

    def _walk(self, mb: int, m: MicroBatch, read, otherwise):
        """Microbatch `mb` through this rank's stages in ascending order (every rank walks the
        stages in one global order, so each receive's send is already posted or next); returns
        `read(last chunk, its input, m, runtime)` on the last stage, else `otherwise`."""
        rt, result = self.runtime, otherwise
        for c in sorted(range(len(self.chunks)), key=rt.stages.__getitem__):
            if not rt.placement.runs(mb, c):  # DualPipe: the copy of mb's direction only
                continue
            stage = rt.stages[c]
            x = m.inputs if stage == 0 else rt.links.take(Message(False, mb, stage - 1))
            if stage == rt.last_stage:
                result = read(self.chunks[c], x, m, rt)
                continue
            with rt.autocast():
                out = self.chunks[c](
                    x, positions=m.position_ids(rt.positions), documents=m.documents
                )
            rt.links.exchange([(Message(False, mb, stage), out)], [])
        return result


def _summed_loss(chunk: nn.Module, x: torch.Tensor, m: MicroBatch, rt) -> float:
    """The last stage's summed cross entropy of microbatch `m`."""
    with rt.autocast():
        out = chunk(x, targets=m.targets, positions=m.position_ids(rt.positions),
                    documents=m.documents)  # fmt: skip
    return out.item()


def _logprobs(chunk: nn.Module, x: torch.Tensor, m: MicroBatch, rt) -> torch.Tensor:
    """The last stage's per-token target log-probs of microbatch `m` (b, T/cp), float64."""
    with rt.autocast():
        logits = chunk(x, positions=m.position_ids(rt.positions), documents=m.documents)
    return m.target_logprobs(logits)


def build_pipeline(
    cfg: Config,
    mesh,
    sharding: Sharding,
    device="cpu",
    bucket_mb: float | None = None,
    kind: type[Pipeline] = Pipeline,
) -> Pipeline:
    """This rank's `kind` of Pipeline for cfg's schedule, on `mesh`, its grads reduced and
    sharded by `sharding` (parallel/data/levels.sharding_of) in dp buckets of `bucket_mb` MB
    (None: parallel/data/reducer.replica_bucket_mb's for dp · cp replicas), its chunks built
    and compiled here (training lists these steps in train/parallelize.py)."""
    parts = Components.of(cfg, mesh)
    chunks = build_chunks(cfg, mesh, device, chunk_placement(cfg), parts)
    reducers = chunk_reducers(cfg, mesh, chunks, bucket_mb, sharding)
    return pipeline_of(cfg, mesh, chunks, reducers, parts, sharding, kind)


def chunk_reducers(
    cfg: Config, mesh, chunks: list[nn.Module], bucket_mb: float | None, sharding: Sharding
) -> list:
    """One dp × cp gradient reducer per chunk, of `sharding`'s level (None without replicas)."""
    p = cfg.parallel
    if p.dp * p.cp == 1:
        return [None for _ in chunks]
    bucket_mb = bucket_mb or replica_bucket_mb(p.dp * p.cp)
    return [sharding.reducer(c, mesh, bucket_mb, c.tied_table, weight_blocks(c)) for c in chunks]


def pipeline_of(
    cfg: Config,
    mesh,
    chunks: list[nn.Module],
    reducers: list,
    parts: Components,
    sharding: Sharding,
    kind: type[Pipeline] = Pipeline,
) -> Pipeline:
    """The `kind` of Pipeline over this rank's built `chunks` and their `reducers` (of
    `sharding`'s level), running cfg's schedule."""
    p = cfg.parallel
    place = chunk_placement(cfg)
    runtime = _runtime(cfg, mesh, chunks, place, parts)
    tied = TiedEmbedding(chunks, runtime.stages, place, mesh)
    pipe = kind(cfg, mesh, chunks, runtime, reducers, tied, sharding, fp8=parts.fp8)
    pipe.use_schedule(schedule_of(cfg))
    # the second step is profiled: the first pays one-off costs (allocations, lazy init)
    built_for_costs = SCHEDULES[p.schedule].built_for_costs
    pipe.profile_in = 2 if built_for_costs and p.schedule_costs == "profile" else 0
    return pipe


def _runtime(cfg: Config, mesh, chunks: list[nn.Module], place, parts: Components):
    """The runtime over this rank's chunks: message shapes from the config, the segments."""
    p, m = cfg.parallel, cfg.model
    device = next(chunks[0].parameters()).device
    seq = m.seq_len // p.cp  # cp: every stage passes this rank's zigzag slice
    seq = seq // p.tp if p.sequence_parallel and p.tp > 1 else seq
    shape = (cfg.derived.micro_batch_size, seq, m.d_model)  # (b, T/cp[/tp], d)
    segments = segment_bounds(cfg)  # Seq1F1B: [(s_i, e_i)]; [(0, T)] otherwise
    lengths = tuple((e - s) * shape[1] // m.seq_len for s, e in segments)  # local n_i
    dtype = parts.precision.weight_dtype  # the residual stream's: bf16 weights make it bf16
    links = StageLinks(mesh, place, shape, dtype, device=device, segments=lengths)
    precision = parts.precision
    return PipelineRuntime(
        chunks,
        place,
        mesh.coord("pp"),
        links,
        parts.cp.positions(m.seq_len),
        lambda: precision.autocast(device),
        segments,
        mesh.progress,
    )
