"""`python tools/diagnose.py RUN_DIR`: every rank's last record in RUN_DIR/progress, the ranks
that stopped first, for a job that hung and was killed from outside (or still hangs).

Each rank of a multi-rank run keeps a record of what it is doing (megapipe/distributed/
progress.py); the rule that names the stopped ranks is megapipe/distributed/diagnosis.py's,
the same one a rank applies when parallel.timeout_s passes. Then, from the flight-recorder
traces the ranks dumped when they gave up (megapipe/distributed/flight.py), each rank's last
collective and the first one some rank never entered. Exit code 0 when records were
found, 2 (one line) when RUN_DIR holds none.
"""

from __future__ import annotations

import argparse
import sys

from megapipe.distributed import flight
from megapipe.distributed.diagnosis import report
from megapipe.distributed.progress import read_records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the run's run.dir")
    args = parser.parse_args(argv)
    lines = report(args.run_dir)
    if not lines:
        print(
            f"error: no progress records in {args.run_dir}/progress: give the run.dir of a "
            "multi-rank run (one process keeps none)",
            file=sys.stderr,
        )
        return 2
    print("\n".join(lines + flight.report(args.run_dir, read_records(args.run_dir))))
    return 0
