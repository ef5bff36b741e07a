"""Project a config onto a GPU cluster, search the meshes that fit, and check the projection on
Megatron-LM's Table 1.

    python tools/plan.py project --config FILE --gpu a100|h100|h200 --gpus-per-node 8 \\
        [--section.key=value ...] [--runtime megapipe|megatron2021] [--json]
    python tools/plan.py search --config FILE --gpus N --gpu a100|h100|h200 \\
        [--gpus-per-node G] [--out PATH] [--top 10] [--section.key=value ...]
    python tools/plan.py table1 [--refit] [--no-loo]

The command line is megapipe/cli/plan.py's (what each command prints, and its errors: one line
on stderr, exit code 2). This machine's CPU profile and the local truth are benchmarks:
`python -m benchmarks.bench calibrate` and `python -m benchmarks.bench local`.
"""

import sys

from megapipe.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
