"""Every engine the step core drives has every member of the `Engine` protocol
(pipeline/protocol.py), and the pipeline holds nothing of post-validation (a wrapper does);
every optimizer shape has every member of the one optimizer interface that checkpoints use
(parallel/data/optimizer_interface.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megapipe.parallel.data.levels import LEVELS
from megapipe.parallel.data.optimizer_interface import Optimizer
from megapipe.parallel.precision import MainParamOptimizer
from megapipe.pipeline.engine import Pipeline
from megapipe.pipeline.pipedream import PipeDreamPipeline
from megapipe.pipeline.protocol import Engine, Grads
from megapipe.train.optim import AdamW
from megapipe.train.parallelize import parallelize
from megapipe.train.post_validation import PostValidatedEngine
from megapipe.train.replica import Replica

MEMBERS = sorted({n for c in (Engine, Grads) for n in vars(c) if not n.startswith("_")})


def _has(cls: type, name: str) -> bool:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return hasattr(cls, name) or name in fields


@pytest.mark.parametrize("cls", [Replica, Pipeline, PipeDreamPipeline, PostValidatedEngine])
def test_engines_have_every_protocol_member(cls):
    assert {"forward_backward", "forward_only", "stage_loss", "events", "params"} <= set(MEMBERS)
    assert [n for n in MEMBERS if not _has(cls, n)] == []


def test_the_pipeline_takes_no_validator():
    names = {f.name for f in dataclasses.fields(Pipeline)}
    assert not any("valid" in n for n in names)


def test_one_process_job_is_a_replica_and_not_post_validated(tiny_cfg):
    job = parallelize(tiny_cfg(), None)
    assert isinstance(job.engine, Replica) and not job.post_validated
    assert job.engine.events == [] and job.settle(job.optimizer()) is None


OPTIMIZER_MEMBERS = sorted(
    {n for n in vars(Optimizer) if not n.startswith("_")} | set(Optimizer.__annotations__)
)
SHARDED = [s.optimizer_kind for s in LEVELS.values() if s.optimizer_kind is not None]


@pytest.mark.parametrize("cls", [AdamW, MainParamOptimizer, *SHARDED], ids=lambda c: c.__name__)
def test_optimizers_have_every_interface_member(cls):
    assert {"shards_state", "param_state", "owned_state", "full_weights"} <= set(OPTIMIZER_MEMBERS)
    if cls in SHARDED:  # its state is kept by owned range, never whole per parameter
        assert cls.shards_state
        members = [n for n in OPTIMIZER_MEMBERS if n != "param_state"]
    else:
        assert not cls.shards_state
        members = [n for n in OPTIMIZER_MEMBERS if n not in ("owned_state", "step_count",
                                                             "set_step_count")]  # fmt: skip
    assert [n for n in members if not hasattr(cls, n) and n != "stage_group"] == []


def test_the_plain_optimizer_offers_the_interface(tiny_cfg):
    job = parallelize(tiny_cfg(), None)
    optimizer = job.optimizer()
    param = next(job.model.parameters())
    assert not optimizer.shards_state and optimizer.main_weights() == {}
    assert set(optimizer.param_state(param)) == {"step", "exp_avg", "exp_avg_sq"}
    with optimizer.full_weights():
        pass
