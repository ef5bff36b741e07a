"""`parallelize(cfg, mesh)`: what one rank trains, the stack listed in the order it is applied
(picotron's train.py; torchtitan's parallelize_llama), wired the same way for train.py and the
tests.

Each feature is resolved once into a component that what uses it is built with (Components:
the cp ring, the ep axis, the precision policy; the tp layers per chunk), so nothing below
`train/` re-reads the config keys they own: the compute and weight dtypes are read where the
precision policy is made (parallel/precision.Precision.of), the expert-parallel size where the
mesh is (distributed/mesh.MeshSizes.of). tests/test_component_reads.py counts the files that
read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megapipe.config import Config
from megapipe.config.states import reduces_per_microbatch, replica_bucket_mb
from megapipe.distributed.progress import NO_PROGRESS, Progress
from megapipe.parallel.data.levels import Sharding, full_weights, sharding_of
from megapipe.pipeline.engine import Pipeline, chunk_reducers, pipeline_of
from megapipe.pipeline.pipedream import PipeDreamPipeline
from megapipe.pipeline.protocol import Engine
from megapipe.pipeline.stages import (
    Components,
    chunk_placement,
    compile_chunks,
    model_chunks,
    weight_blocks,
)
from megapipe.train.batches import BatchSlice, document_eos
from megapipe.train.evaluate import evaluate
from megapipe.train.hf_init import load_hf_weights
from megapipe.train.hooks import NO_HOOKS, TrainHooks
from megapipe.train.moe_balance import BiasBalancing
from megapipe.train.optim import build_optimizer
from megapipe.train.post_validation import PostValidatedEngine
from megapipe.train.replica import Replica
from megapipe.train.step import StepResult, train_step


@dataclass
class Job:
    """This rank's model (its chunks under pp), the engine that runs them and its batch slice."""

    cfg: Config
    model: nn.Module  # the GPT, or an nn.ModuleList of this pp rank's chunks
    engine: Engine  # Replica | Pipeline | PipeDreamPipeline | PostValidatedEngine
    slice: BatchSlice
    mesh: object = None  # None: one process
    balance: BiasBalancing | None = None  # model.moe_bias_update_rate (train/moe_balance.py)

    @property
    def progress(self) -> Progress:
        """This rank's record of what it is doing (distributed/progress.py; none: one process)."""
        return self.mesh.progress if self.mesh is not None else NO_PROGRESS

    def train_step(
        self,
        optimizer,
        batch: torch.Tensor,
        step: int,
        hooks: TrainHooks = NO_HOOKS,
        loss_limit: float = math.inf,
    ) -> StepResult:
        """One training step (train/step.train_step); a loss above `loss_limit` is skipped."""
        result = train_step(
            self.engine,
            self.slice,
            optimizer,
            batch,
            step,
            self.cfg,
            hooks,
            loss_limit,
            self.progress,
        )
        if self.balance is not None:
            self.balance.after_step(result.skipped)
        return result

    @property
    def post_validated(self) -> bool:
        """Zero Bubble §4 post-validation is on: no collective joins the ranks between steps."""
        return self.engine.post_validated

    def settle(self, optimizer, hooks: TrainHooks = NO_HOOKS) -> StepResult | None:
        """Post-validation: validate the pending step now; its final result (None: none)."""
        return self.engine.settle(optimizer, self.cfg, hooks)

    def optimizer(self):
        """AdamW over this rank's parameters; under a sharded ZeRO level, over its shard of
        each gradient bucket (the engine's sharding: parallel/data/levels.py)."""
        group = self.mesh.stage_group if self.mesh is not None else None
        sharding = self.engine.sharding
        return build_optimizer(self.model, self.cfg.train, self.engine.reducers, group, sharding)

    def full_weights(self, write_back: bool = False):
        """Within: every local parameter holds its whole, current value (ZeRO-1 and up
        gathers weights after the step, or on use: parallel/data/levels.full_weights)."""
        return full_weights([r for r in self.engine.reducers if r is not None], write_back)

    def evaluate(self, data) -> float:
        return evaluate(self.engine, self.slice, data, self.cfg)


def parallelize(cfg: Config, mesh, device="cpu", bucket_mb: float | None = None) -> Job:
    """This rank's Job, its stack built in the order it is applied; mesh None is one process.
    dp buckets of `bucket_mb` MB (None: the reducer's size for dp · cp replicas,
    parallel/data/reducer.replica_bucket_mb)."""
    parts = Components.of(cfg, mesh)  # the cp axis and variant, the ep axis, the precision
    place = chunk_placement(cfg) if cfg.parallel.pp > 1 else None  # the pipeline's stages
    # the model: this rank's chunks, their tp/sp, cp and ep layers, recompute, weights' dtype
    chunks = model_chunks(cfg, mesh, device, parts, place)
    if cfg.train.init_from_hf:  # a transformers directory's weights, each rank its own shard
        load_hf_weights(chunks, cfg.train.init_from_hf, cfg.model)
    compile_chunks(cfg, mesh, chunks, parts.precision)  # train.compile
    sharding = _sharding(cfg, mesh)  # data-parallel sharding: the ZeRO level's strategy
    if place is None:  # no pipeline: the one replica and its dp × cp reducer
        engine: Engine = replica(cfg, chunks[0], mesh, bucket_mb, parts, sharding)
        balance = BiasBalancing.of(cfg, chunks[0], mesh)
        return Job(cfg, chunks[0], engine, _slice(cfg, mesh), mesh, balance)
    reducers = chunk_reducers(cfg, mesh, chunks, bucket_mb, sharding)  # dp × cp, per chunk
    model = nn.ModuleList(chunks)
    balance = BiasBalancing.of(cfg, model, mesh, place)  # aux-loss-free bias of the stages
    engine = _pipeline(cfg, mesh, chunks, reducers, parts, sharding, balance)  # the stages
    return Job(cfg, model, engine, _slice(cfg, mesh), mesh, balance)  # + optimizer()


def _sharding(cfg: Config, mesh) -> Sharding:
    """The ZeRO level's strategy (parallel.zero, read here once): nothing is sharded without
    dp × cp replicas."""
    p = cfg.parallel
    replicas = mesh is not None and mesh.size("dp") * mesh.size("cp") > 1
    per_microbatch = reduces_per_microbatch(cfg)  # parallel.grad_reduce resolved
    dtype = getattr(torch, p.grad_reduce_dtype)
    return sharding_of(p.zero, replicas, per_microbatch, dtype, cfg.train.fp8_params)


def _pipeline(
    cfg: Config, mesh, chunks, reducers: list, parts: Components, sharding, balance=None
) -> Engine:
    """The pipeline engine of cfg's schedule: PipeDream's, else the flushing one, post-validated
    under parallel.post_validation (Zero Bubble §4: no global reduction before the optimizer;
    `balance`, the aux-loss-free bias, rolled back with the weights)."""
    if cfg.parallel.schedule == "pipedream_async":
        return pipeline_of(cfg, mesh, chunks, reducers, parts, sharding, PipeDreamPipeline)
    pipe = pipeline_of(cfg, mesh, chunks, reducers, parts, sharding, Pipeline)
    return PostValidatedEngine.of(pipe, balance) if cfg.parallel.post_validation else pipe


def _slice(cfg: Config, mesh) -> BatchSlice:
    """This rank's rows and sequence slice; with the EOS id under data.document_mask."""
    return BatchSlice.of(mesh, cfg.train.global_batch, document_eos(cfg), cfg.parallel.cp_balance)


def replica(
    cfg: Config,
    model: nn.Module,
    mesh=None,
    bucket_mb: float | None = None,
    parts: Components | None = None,
    sharding: Sharding | None = None,
) -> Replica:
    """The plain engine over `model`: dp × cp buckets, reduced and sharded by `sharding`
    (None: the config's), when there are replicas. `parts`: what `model` was built with (None:
    resolved here)."""
    parts = parts or Components.of(cfg, mesh)
    sharding = sharding or _sharding(cfg, mesh)
    if mesh is None:
        return Replica(cfg, model, precision=parts.precision, fp8=parts.fp8)
    if mesh.size("dp") * mesh.size("cp") == 1:
        return Replica(cfg, model, None, mesh, sharding, mesh.progress, parts.precision, parts.fp8)
    bucket_mb = bucket_mb or replica_bucket_mb(cfg.parallel.dp * cfg.parallel.cp)
    reducer = sharding.reducer(model, mesh, bucket_mb, None, weight_blocks(model))
    return Replica(cfg, model, reducer, mesh, sharding, mesh.progress, parts.precision, parts.fp8)
