"""Show what each training step reads: the documents and token ranges of its rows.

    python tools/inspect_data.py --config configs/shakespeare_tiny.yaml --steps 0:2 --json

The command line is megapipe/cli/inspect_data.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.inspect_data import main

if __name__ == "__main__":
    sys.exit(main())
