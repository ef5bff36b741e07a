"""Write docs/configuration.md from megapipe/config/schema.py (`--check`: fail if it differs)."""

import sys

from megapipe.cli.config_reference import main

if __name__ == "__main__":
    sys.exit(main())
