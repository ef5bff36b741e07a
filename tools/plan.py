"""Project a config onto a GPU cluster, and check the projection on Megatron-LM's Table 1.

    python tools/plan.py project --config FILE --gpu a100|h100|h200 --gpus-per-node 8 \\
        [--section.key=value ...] [--runtime megapipe|megatron2021] [--json]
    python tools/plan.py table1 [--refit] [--no-loo]

`project` prints the projected step (megapipe/perf/model.py): step time, model and hardware
TFLOP/s per GPU, MFU, bubble fraction, peak memory (max over ranks) and the breakdown; with
--json one JSON object. The world size is dp·pp·cp·tp from the config; `model.*`, `parallel.*`,
`train.*` and `recompute.*` keys mean what they mean for training. `table1` prints the ten rows
of Narayanan et al. 2021's Table 1, measured against projected hardware TFLOP/s per GPU, with
the error per row, mean and max, and the leave-one-out error of the calibrated constants
(megapipe/perf/table1.py; --refit fits the constants again first).
Bad input (an unknown GPU, a bad config or override) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megapipe.config import ConfigError, load_config
from megapipe.perf import RUNTIMES, ClusterError, cluster_names, load_cluster, project
from megapipe.perf import table1 as t1
from megapipe.perf.costs import CALIBRATION


class UsageError(ValueError):
    """Bad command-line input: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad input
        raise UsageError(message)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _Parser(prog="plan.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    proj = sub.add_parser("project", help="project one config onto a cluster")
    proj.add_argument("--config", help="YAML config file (see configs/)")
    proj.add_argument("--gpu", required=True, help=f"one of {', '.join(cluster_names())}")
    proj.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    proj.add_argument("--runtime", default="megapipe", help=f"one of {', '.join(RUNTIMES)}")
    proj.add_argument("--json", action="store_true", help="one JSON object")
    table = sub.add_parser("table1", help="Megatron-LM Table 1: paper vs projected")
    table.add_argument("--refit", action="store_true", help="fit the constants again first")
    table.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits")
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise UsageError(f"argument '{item}' is not --section.key=value")
    if args.command == "table1" and rest:
        raise UsageError("table1 takes no --section.key=value overrides")
    return args, rest


def run_project(args: argparse.Namespace, overrides: list[str]) -> int:
    cluster = load_cluster(args.gpu, args.gpus_per_node)
    if args.runtime not in RUNTIMES:
        raise UsageError(f"unknown --runtime {args.runtime!r}: choose one of {', '.join(RUNTIMES)}")
    cfg = load_config(args.config, overrides)
    began = time.perf_counter()
    proj = project(cfg, cluster, RUNTIMES[args.runtime])
    out = proj.to_dict()
    out["detail"]["projection_s"] = time.perf_counter() - began
    if args.json:
        print(json.dumps(out))
        return 0
    p = cfg.parallel
    print(
        f"{cluster.gpu} x {proj.world_size} ({cluster.gpus_per_node} per node), "
        f"dp={p.dp} pp={p.pp} cp={p.cp} tp={p.tp} vpp={p.vpp} {p.schedule}, "
        f"{p.microbatches} microbatches, runtime {args.runtime}"
    )
    fits = "fits" if proj.fits else "does NOT fit"
    print(f"step time        {proj.step_time_s:.4g} s")
    print(f"model TFLOP/s    {proj.tflops_per_gpu:.1f} per GPU (MFU {proj.mfu:.1%})")
    print(f"hardware TFLOP/s {proj.hw_tflops_per_gpu:.1f} per GPU (recompute counted)")
    print(f"bubble fraction  {proj.bubble_fraction:.1%}")
    print(
        f"peak memory      {proj.peak_memory_gib:.1f} GiB at (pp, tp) rank "
        f"{tuple(proj.memory_rank)}: {fits} in {cluster.hbm_gib:g} GiB"
    )
    print("breakdown (the busiest pp rank):")
    for key, value in proj.breakdown.items():
        print(f"  {key[:-2]:<22} {value:10.4g} s  {value / proj.step_time_s:6.1%}")
    return 0


def run_table1(args: argparse.Namespace) -> int:
    cal = CALIBRATION
    if args.refit:
        cal = t1.fit()
    print(
        f"constants: e_max={cal.gemm:.3f} kappa={cal.knee:.3f} mu={cal.memory:.3f} "
        "(megapipe/perf/costs.py; fitted on all ten rows)\n"
    )
    results = t1.compare(cal)
    loo = None if args.no_loo else t1.leave_one_out(start=cal)
    print(t1.markdown(results, loo))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse(argv)
        if args.command == "project":
            return run_project(args, overrides)
        return run_table1(args)
    except (UsageError, ConfigError, ClusterError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
