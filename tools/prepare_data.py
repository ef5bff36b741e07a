"""Prepare a packed token dataset for `data.source: memmap`.

The command line is megapipe/cli/prepare_data.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
