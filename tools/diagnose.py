"""Every rank's last record of a run, the stopped ranks first: `python tools/diagnose.py RUN_DIR`.

The command line is megapipe/cli/diagnose.py's.
"""

import sys

from megapipe.cli.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
