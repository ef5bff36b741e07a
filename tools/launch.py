"""Check the config once, then start torchrun: a bad config is one line, not one per rank.

    python tools/launch.py --nproc-per-node 4 train.py --config configs/tiny.yaml --parallel.pp=4
    python tools/launch.py --nproc-per-node 8 --nnodes 2 --node-rank 0 \\
        --rdzv-endpoint host:29400 --rdzv-id job1 train.py --config FILE [--section.key=value ...]

The command line is megapipe/cli/launch.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
