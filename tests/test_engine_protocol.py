"""Every engine the step core drives has every member of the `Engine` protocol
(pipeline/protocol.py), and the pipeline holds nothing of post-validation (a wrapper does)."""

from __future__ import annotations

import dataclasses

import pytest

from megapipe.pipeline.engine import Pipeline
from megapipe.pipeline.pipedream import PipeDreamPipeline
from megapipe.pipeline.protocol import Engine, Grads
from megapipe.train.build import build
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
    job = build(tiny_cfg(), None)
    assert isinstance(job.engine, Replica) and not job.post_validated
    assert job.engine.events == [] and job.settle(job.optimizer()) is None
