"""Print, simulate, compare and plot pipeline schedules.

    python tools/schedule.py --schedule zb_h1 --pp 4 --microbatches 8
    python tools/schedule.py --schedule interleaved_1f1b --pp 4 --microbatches 8 --vpp 2 --json
    python tools/schedule.py --compare 1f1b,zb_h1,zb_v --pp 4 --microbatches 8 --plot cmp.png
    python tools/schedule.py --schedule zb_v --pp 4 --microbatches 8 --to-csv zbv.csv
    python tools/schedule.py --from-csv zbv.csv --placement v --json

The command line is megapipe/cli/schedule.py's (its options, what it prints, its errors).
"""

import sys

from megapipe.cli.schedule import main

if __name__ == "__main__":
    sys.exit(main())
