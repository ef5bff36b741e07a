"""Write every projected figure in README.md, configs/ and docs/ from the performance model and
the dry run (`--check`: fail if any differs)."""

import sys

from megapipe.cli.figures import main

if __name__ == "__main__":
    sys.exit(main())
