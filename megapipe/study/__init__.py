"""Scaling studies: a sweep of node counts and meshes, launched locally, under SLURM or by a
user's command, and reported beside the performance model's projection
(`python tools/scaling_study.py run|collect|report`; docs/scaling-studies.md).

- `spec.py`: the study file (base config, points, weak or strong, steps, launcher) read into
  resolved points, each with its overrides, or its one-line error; `auto` meshes from the
  planner (perf/search.py).
- `launchers.py`: the commands of a point: torchrun agents on localhost with c10d rendezvous,
  an sbatch script, a user's template; each runs `train.py ... --log.profile=true`.
- `runner.py`: runs, submits or writes each point and records its outcome (point.json);
  `collect` for points that ran elsewhere.
- `results.py`: one point's numbers from its run dir (metrics.jsonl, study_profile.json) and
  its projection (perf/model.py); scaling efficiency against the first point.
- `report.py`: results.csv, results.json, report.md and the PNG plots.

This package sits above every layer (it reads perf and config); nothing in the library imports
it. tools/scaling_study.py is its command line and names what each point runs (`Entry`).
"""

from megapipe.study.spec import Point, Study, StudyError, load_study

__all__ = ["Point", "Study", "StudyError", "load_study"]
