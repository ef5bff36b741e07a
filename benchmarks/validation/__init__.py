"""The performance model checked on published runs, apart from the model (Calculon's
`validation/`): the runs' data (data/*.csv, each file's header names its source), their configs
and the fits of the model's calibrated constants. The fitted values stay with the model
(megapipe/perf/cost_terms.py, megapipe/perf/clusters/*.yaml); `python tools/plan.py validate`
and `table1` run cli.py. Above the library: it imports megapipe, never the reverse."""
