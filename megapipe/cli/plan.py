"""`tools/plan.py`'s command line: project a config onto a GPU cluster and search the meshes
that fit.

    python tools/plan.py project --config FILE --gpu a100|h100|h200 --gpus-per-node 8 \\
        [--section.key=value ...] [--runtime megapipe|megatron2021] [--json]
    python tools/plan.py search --config FILE --gpus N --gpu a100|h100|h200 \\
        [--gpus-per-node G] [--out PATH] [--top 10] [--section.key=value ...]

`project` prints the projected step (megapipe/perf/model.py): step time, model and hardware
TFLOP/s per GPU, MFU, bubble fraction, peak memory (max over ranks) and the breakdown; with
--json one JSON object. The world size is dp·pp·cp·tp from the config; `model.*`, `parallel.*`,
`train.*` and `recompute.*` keys mean what they mean for training. `search` prints the fastest
meshes and schedules that fit and writes the best config. The model's check on published runs
(`tools/plan.py table1` and `validate`) is not the library's: tools/plan.py hands those two
commands to benchmarks/validation/. This machine's CPU profile and the local truth are
benchmarks' too (python -m benchmarks.bench calibrate | local). Bad input (an unknown GPU, a bad
config or override, a mesh that cannot make --gpus, a model that fits nowhere) is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import yaml

from megapipe.config import ConfigError, load_config
from megapipe.config.fp8_checks import FP8_RECIPES
from megapipe.perf import search as plan_search
from megapipe.perf.cluster import ClusterError, cluster_names, load_cluster
from megapipe.perf.model import project
from megapipe.perf.software import RUNTIMES

# The model's check on published runs is not the library's (it lives above it, in benchmarks/)
VALIDATION = "table1, validate: published runs, measured vs projected (tools/plan.py runs them)"


class UsageError(ValueError):
    """Bad command-line input: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad input
        raise UsageError(message)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _Parser(prog="plan.py", description=__doc__.split("\n\n")[0], epilog=VALIDATION)
    sub = parser.add_subparsers(dest="command", required=True)
    proj = sub.add_parser("project", help="project one config onto a cluster")
    proj.add_argument("--config", help="YAML config file (see configs/)")
    proj.add_argument("--gpu", required=True, help=f"one of {', '.join(cluster_names())}")
    proj.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    proj.add_argument("--runtime", default="megapipe", help=f"one of {', '.join(RUNTIMES)}")
    proj.add_argument("--json", action="store_true", help="one JSON object")
    add_search_parser(sub)
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise UsageError(f"argument '{item}' is not --section.key=value")
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


def add_search_parser(sub) -> None:
    s = sub.add_parser("search", help="the fastest meshes and schedules that fit on N GPUs")
    s.add_argument("--config", help="YAML config file (see configs/)")
    s.add_argument("--gpus", type=int, required=True, help="GPUs in all (the world size)")
    s.add_argument("--gpu", required=True, help=f"one of {', '.join(cluster_names())}")
    s.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's")
    s.add_argument("--runtime", default="megapipe", help=f"one of {', '.join(RUNTIMES)}")
    s.add_argument("--top", type=int, default=plan_search.TOP, help="rows to print")
    s.add_argument("--out", help="where to write the best config (default runs/plan/...)")
    s.add_argument(
        "--fp8", default=None,
        help="train.fp8 recipes to search, comma-separated (e.g. none,tensorwise,rowwise); "
        "default: the config's",
    )  # fmt: skip
    s.add_argument(
        "--memory-margin", type=float, default=0.0,
        help="GiB per GPU kept free (CUDA context, NCCL buffers, fragmentation); default 0",
    )  # fmt: skip


def default_out(config: str | None, gpus: int, gpu: str) -> str:
    stem = Path(config).stem if config else "default"
    return str(Path("runs") / "plan" / f"{stem}_{gpus}x{Path(gpu).stem}.yaml")


def write_plan(result: plan_search.SearchResult, path: str, command: str) -> None:
    """The best config as YAML train.py loads, headed by how it was chosen (written to a
    temporary name and renamed, as config/load.write_config does)."""
    best = result.best
    p = best.projection
    head = [
        f"# written by: {command}",
        f"# {plan_search.describe(best.candidate)}",
        f"# projected on {result.gpus} x {result.cluster.gpu}: step {p.step_time_s:.4g} s, "
        f"{p.tflops_per_gpu:.1f} model TFLOP/s per GPU (MFU {p.mfu:.1%}), peak "
        f"{p.peak_memory_gib:.1f} GiB of {result.cluster.hbm_gib:g}",
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(head) + "\n")
        yaml.safe_dump(best.config.to_dict(), f, sort_keys=False)
    os.replace(tmp, path)


def fp8_recipes(listed: str | None) -> tuple[str, ...] | None:
    """--fp8's recipes (None: the config's train.fp8, held)."""
    if listed is None:
        return None
    recipes = tuple(r.strip() for r in listed.split(",") if r.strip())
    unknown = [r for r in recipes if r not in FP8_RECIPES]
    if unknown or not recipes:
        raise UsageError(f"--fp8 {listed!r}: list recipes among {', '.join(FP8_RECIPES)}")
    return recipes


def run_search(args: argparse.Namespace, overrides: list[str], argv: list[str]) -> int:
    cluster = load_cluster(args.gpu, args.gpus_per_node)
    if args.runtime not in RUNTIMES:
        raise UsageError(f"unknown --runtime {args.runtime!r}: choose one of {', '.join(RUNTIMES)}")
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    if not 0 <= args.memory_margin < cluster.hbm_gib:
        raise UsageError(
            f"--memory-margin {args.memory_margin:g}: must be at least 0 and below the "
            f"{cluster.hbm_gib:g} GiB of a {args.gpu} GPU"
        )
    # the search fits every candidate into what the margin leaves of the device's memory
    cluster = dataclasses.replace(cluster, hbm_gib=cluster.hbm_gib - args.memory_margin)
    base, fixed = plan_search.base_config(args.config, overrides)
    result = plan_search.search(base, args.gpus, cluster, RUNTIMES[args.runtime],
                                fixed=fixed, top=args.top, fp8s=fp8_recipes(args.fp8))  # fmt: skip
    command = "python tools/plan.py " + " ".join(argv)
    print(
        f"`{command}`: {args.gpus} x {cluster.gpu} ({cluster.gpus_per_node} per node, "
        f"{cluster.hbm_gib:g} GiB usable), runtime {args.runtime}, best first\n"
    )
    print(plan_search.markdown(result))
    print(f"\n{plan_search.summary(result)}")
    out = args.out or default_out(args.config, args.gpus, args.gpu)
    write_plan(result, out, command)
    print(f"wrote the best config to {out} (python train.py --config {out})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse(argv)
        if args.command == "project":
            return run_project(args, overrides)
        return run_search(args, overrides, argv)
    except (UsageError, ConfigError, ClusterError, plan_search.PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
