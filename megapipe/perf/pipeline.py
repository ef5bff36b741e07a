"""The configured schedule's compiled DAG (plan/dag.py, the one timing engine that
plan/simulate.py also times), cached per `ScheduleKey`: perf/model.py prices it with projected
costs, perf/memory_cache.py replays it with the schedule's own (plan/simulate.cost_table).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megapipe.config import Config
from megapipe.config.pipeline_split import schedule_options
from megapipe.plan.actions import Schedule
from megapipe.plan.dag import Dag, compile_schedule
from megapipe.plan.schedules import build_schedule, placement


@dataclass(frozen=True)
class ScheduleKey:
    """What a configured schedule's Dag depends on: the arguments config/pipeline_split.schedule_of
    passes to plan's build_schedule (the options as sorted pairs) and the placement's."""

    schedule: str
    pp: int
    microbatches: int
    vpp: int
    seq_segments: int
    options: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(cfg: Config) -> ScheduleKey:
        p = cfg.parallel
        options = tuple(sorted(schedule_options(cfg).items()))
        return ScheduleKey(p.schedule, p.pp, p.microbatches, p.vpp, p.seq_segments, options)

    def build(self) -> Schedule:
        """The schedule, as config/pipeline_split.schedule_of builds it."""
        return build_schedule(self.schedule, self.pp, self.microbatches, self.vpp,
                              self.seq_segments, **dict(self.options))  # fmt: skip


def config_dag(cfg: Config) -> Dag:
    """The Dag of the configured schedule (pp > 1), cached per ScheduleKey."""
    return schedule_dag(ScheduleKey.of(cfg))


@functools.lru_cache(maxsize=256)
def schedule_dag(key: ScheduleKey) -> Dag:
    """compile_schedule of the schedule `key` names, built from the key alone."""
    return compile_schedule(built_schedule(key), placement(key.schedule, key.pp, key.vpp))


@functools.lru_cache(maxsize=256)
def built_schedule(key: ScheduleKey) -> Schedule:
    """`key.build()`, cached: the planner's memory bound (perf/bounds.py) and its projection
    (schedule_dag) ask for the same schedules, and ZB's automatic and the V-shaped
    controllable-memory builders take a tenth of a second or more each. Read, never mutated."""
    return key.build()
