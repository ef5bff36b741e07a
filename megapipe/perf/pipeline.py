"""The configured schedule's compiled DAG (plan/dag.py, the one timing engine that
plan/simulate.py also times), cached per schedule: perf/model.py prices it with projected costs,
perf/memory.py replays it with the schedule's own (plan/simulate.cost_table).
"""

from __future__ import annotations

from collections.abc import Callable

from megapipe.config import Config
from megapipe.config.stages import placement_of, schedule_of
from megapipe.plan.dag import Dag, compile_schedule
from megapipe.plan.schedules import SCHEDULES

_DAGS: dict[tuple, Dag] = {}


_PLAIN_OPTIONS = {"weight_sync", "microbatch_group", "memory_limit", "costs"}


def schedule_key(cfg: Config) -> tuple:
    """What config/stages.schedule_of(cfg) depends on: the schedule's own keys, or, for a
    schedule whose options read more of the config, all of what might matter."""
    p = cfg.parallel
    key = (p.schedule, p.pp, p.microbatches, p.vpp, p.seq_segments, p.weight_sync,
           p.schedule_costs)  # fmt: skip
    if set(SCHEDULES[p.schedule].options) <= _PLAIN_OPTIONS:
        return key
    return (*key, repr(p), repr(cfg.model), repr(cfg.recompute), cfg.train.dtype,
            cfg.train.global_batch)  # fmt: skip


def config_dag(cfg: Config) -> Dag:
    """The Dag of the configured schedule (pp > 1), cached per schedule."""
    return cached_dag(schedule_key(cfg), lambda: (schedule_of(cfg), placement_of(cfg)))


def cached_dag(key: tuple, build: Callable[[], tuple]) -> Dag:
    """compile_schedule(*build()) once per schedule key (build returns schedule, placement)."""
    if key not in _DAGS:
        if len(_DAGS) >= 256:
            _DAGS.clear()
        _DAGS[key] = compile_schedule(*build())
    return _DAGS[key]
