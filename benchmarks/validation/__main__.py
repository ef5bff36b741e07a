"""`python -m benchmarks.validation validate|table1 ...`: what tools/plan.py runs for them."""

import sys

from benchmarks.validation.cli import main

if __name__ == "__main__":
    sys.exit(main())
