"""Project a config onto a GPU cluster, search the meshes that fit, and check the projection on
published runs.

    python tools/plan.py project --config FILE --gpu a100|h100|h200 --gpus-per-node 8 \\
        [--section.key=value ...] [--runtime megapipe|megatron2021] [--json]
    python tools/plan.py search --config FILE --gpus N --gpu a100|h100|h200 \\
        [--gpus-per-node G] [--out PATH] [--top 10] [--section.key=value ...]
    python tools/plan.py table1 [--refit] [--no-loo]
    python tools/plan.py validate [--refit] [--no-loo] [--megapipe] [--moe] [--a100]

`project` and `search` are megapipe/cli/plan.py's command line (what each prints, and its
errors: one line on stderr, exit code 2). `table1` and `validate` check the model on published
runs, which live apart from it in benchmarks/validation/ (cli.py says what they print): the
library never imports benchmarks/, so this main runs them as `python -m benchmarks.validation`
from the repo root (this script does not edit sys.path). This machine's CPU profile and the
local truth are benchmarks: `python -m benchmarks.bench calibrate` and `... local`.
"""

import subprocess
import sys
from pathlib import Path

from megapipe.cli.plan import main

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ("table1", "validate")  # benchmarks/validation/cli.py's commands


def run(argv: list[str]) -> int:
    if argv[:1] and argv[0] in VALIDATION:
        return subprocess.call([sys.executable, "-m", "benchmarks.validation", *argv], cwd=ROOT)
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
