"""`tools/plan.py`'s two validation commands, which tools/plan.py hands to this package
(`python -m benchmarks.validation`, run from the repo root): the projection checked on
published runs, kept apart from the model in megapipe/perf/.

    python tools/plan.py table1 [--refit] [--no-loo]
    python tools/plan.py validate [--refit] [--no-loo] [--megapipe] [--moe] [--a100]
    python tools/plan.py validate --picks [--max-gpus N]

`table1` prints the ten rows of Narayanan et al. 2021's Table 1, measured against projected
hardware TFLOP/s per GPU, with the error per row, mean and max, and the leave-one-out error of
the calibrated constants (table1.py; --refit fits the constants again first). `validate`
projects the published H100/H200 runs (published.py's data) with the runtime of the code base
that ran each (megatron_core, torchtitan) against their measured tokens/s per GPU, with the
error per row, mean and max, and the leave-one-out error of the H100 profile's e_max, fitted on
those rows (h100_validation.py, h100_fit.py; --refit fits it again first, from the profile's
value); --megapipe adds megapipe's own runtime (bf16 weights) projected on the Megatron-Core
rows beside Megatron-Core's, and the seconds each of its differing facts adds; --moe instead
projects the published MoE runs (published_moe.py); --a100 instead projects the other published
2021-2022 Megatron-LM runs on A100 (megatron_runs.py, held out of every fit), under the
megatron2021 runtime and under the runtime of each run's code; --picks instead runs the planner
on each published H100 run's GPUs and model and prints its pick beside the published mesh
(picks.py; --max-gpus N: the rows of at most N GPUs). The fitted values themselves
stay with the model: Table 1's in megapipe/perf/cost_terms.py, the H100's e_max in
megapipe/perf/clusters/h100.yaml. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.validation import h100_fit, megatron_runs, picks, published, published_moe, table1
from benchmarks.validation import h100_validation as h100
from megapipe.config import ConfigError
from megapipe.perf.cluster import ClusterError, load_cluster
from megapipe.perf.cost_terms import CALIBRATION


class UsageError(ValueError):
    """Bad command-line input: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad input
        raise UsageError(message)


def parse(argv: list[str]) -> argparse.Namespace:
    # prog as the user typed it: these are tools/plan.py's commands
    parser = _Parser(prog="plan.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    table = sub.add_parser("table1", help="Megatron-LM Table 1: paper vs projected")
    table.add_argument("--refit", action="store_true", help="fit the constants again first")
    table.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits")
    check = sub.add_parser("validate", help="published H100/H200 runs: measured vs projected")
    check.add_argument("--megapipe", action="store_true", help="megapipe's runtime beside")
    check.add_argument("--refit", action="store_true", help="fit the H100 e_max again first")
    check.add_argument("--no-loo", action="store_true", help="skip the leave-one-out fits")
    check.add_argument("--moe", action="store_true", help="the published MoE runs instead")
    check.add_argument("--a100", action="store_true", help="2021-2022 Megatron runs instead")
    check.add_argument("--picks", action="store_true", help="the planner against each mesh")
    check.add_argument("--max-gpus", type=int, default=0, help="--picks: rows up to N GPUs")
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise UsageError(f"argument '{item}' is not --section.key=value")
    if rest:
        raise UsageError(f"{args.command} takes no --section.key=value overrides")
    return args


def run_table1(args: argparse.Namespace) -> int:
    cal = CALIBRATION
    if args.refit:
        cal = table1.fit()
    print(
        f"constants: e_max={cal.gemm:.3f} kappa={cal.knee:.3f} mu={cal.memory:.3f} "
        "(megapipe/perf/cost_terms.py; fitted on all ten rows)\n"
    )
    results = table1.compare(cal)
    loo = None if args.no_loo else table1.leave_one_out(start=cal)
    print(table1.markdown(results, loo))
    return 0


def run_validate(args: argparse.Namespace) -> int:
    if args.moe:  # published_moe.py: no constant fitted on these rows
        print(f"published MoE runs (benchmarks/validation/data/{published_moe.SOURCE}), H100 "
              "profile as fitted on the dense rows:\n")  # fmt: skip
        print(published_moe.markdown(published_moe.compare()))
        return 0
    if args.a100:
        return run_validate_a100()
    if args.picks:
        return run_picks(args.max_gpus)
    results = h100.compare()
    cal = h100.refit(results) if args.refit else None
    if cal is not None:
        results = h100.compare(cal=cal)
    shown = cal or h100_fit.constants(load_cluster("h100"))
    print(
        f"H100 constants: e_max={shown.gemm:.3f} kappa={shown.knee:.3f} mu={shown.memory:.3f} "
        f"({'fitted again' if args.refit else 'megapipe/perf/clusters/h100.yaml'}; e_max fitted "
        "on the fitted rows, kappa and mu from kernel benchmarks)\n"
    )
    loo = None if args.no_loo else h100.leave_one_out(results, cal=cal)
    print(h100.markdown(results, loo))
    print("\npublished FP8 runs (held out of every fit: "
          f"benchmarks/validation/data/{published.FP8_SOURCES[0]}):\n")  # fmt: skip
    print(h100.fp8_markdown(h100.compare_fp8(cal)))
    if args.megapipe:
        beside = h100.beside_megapipe()
        print("\nmegapipe's runtime (bf16 weights) beside megatron_core's, same configs:\n")
        print(h100.beside_markdown(beside))
        print("\nseconds each of megapipe's facts adds (share of megatron_core's step):\n")
        print(h100.attribution_markdown(beside))
    return 0


def run_picks(max_gpus: int) -> int:
    print("the planner's pick beside each published mesh (same GPUs, model, global batch, "
          "runtime and memory; both projected by the model):\n")  # fmt: skip
    print(picks.HEADER, flush=True)
    results = []
    for row in picks.rows(max_gpus):  # a row a line as searched: large runs take minutes
        results.append(picks.pick(row))
        print(picks.row_line(results[-1]), flush=True)
    print("\n" + picks.summary(results))
    return 0


def run_validate_a100() -> int:
    print(f"other 2021-2022 Megatron-LM runs on A100 ({megatron_runs.DATA.name}), held out; "
          "the A100 profile and Table 1's constants:\n")  # fmt: skip
    print("under the megatron2021 runtime (the 2021 code):\n")
    print(megatron_runs.markdown(megatron_runs.compare()))
    print("\nunder the runtime of each run's code (megatron2022: Korthikanti et al. 2022's):\n")
    print(megatron_runs.markdown(megatron_runs.compare(None)))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        return run_validate(args) if args.command == "validate" else run_table1(args)
    except (UsageError, ConfigError, ClusterError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
