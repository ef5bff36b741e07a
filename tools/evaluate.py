"""Score a checkpoint (any mesh) on a downstream task as lm-evaluation-harness does.

    python tools/evaluate.py --checkpoint runs/gpt2 --task hellaswag [--data FILE] [--json]

The command line is megapipe/cli/evaluate.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
