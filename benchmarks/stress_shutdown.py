"""Run a short 4-rank pipeline job many times and tally how each run ended.

    python -m benchmarks.stress_shutdown [--runs 30] [--keep-logs DIR]

Each run is tools/launch.py (torchrun underneath) with pp=4, 1F1B, llama3 balance, 8 layers,
6 microbatches and 3 steps of configs/tiny.yaml, in a fresh temporary run directory. A rank
that leaves without shutting its process group down can abort after its last step
("terminate called without an active exception", SIGABRT); every run must exit 0. Prints one
line per run and the tally (`30/30 exited 0`); exits 1 if any run did not exit 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT

TRAIN_ARGS = [
    "train.py", "--config", "configs/tiny.yaml", "--parallel.pp=4", "--parallel.schedule=1f1b",
    "--parallel.balance=llama3", "--model.n_layers=8", "--parallel.microbatches=6",
    "--train.global_batch=12", "--train.steps=3",
]  # fmt: skip
ABORT = "terminate called"


def one_run(index: int, keep: Path | None) -> tuple[int, str]:
    """(exit code, note) of one launch in a fresh run directory."""
    with tempfile.TemporaryDirectory(prefix="stress_shutdown_") as tmp:
        cmd = [sys.executable, "tools/launch.py", "--nproc-per-node", "4", *TRAIN_ARGS,
               f"--run.dir={tmp}/run"]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_MODE": "disabled"}  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if keep is not None:
        (keep / f"run_{index:03d}.log").write_text(log)
    notes = [line.strip() for line in log.splitlines() if ABORT in line or "error:" in line]
    return done.returncode, (notes[0] if notes else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--keep-logs", type=Path, help="write each run's output here")
    args = parser.parse_args(argv)
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    tally: collections.Counter[int] = collections.Counter()
    for index in range(1, args.runs + 1):
        began = time.monotonic()
        code, note = one_run(index, args.keep_logs)
        tally[code] += 1
        seconds = time.monotonic() - began
        print(f"run {index}/{args.runs}: exit {code} ({seconds:.1f} s) {note}".rstrip(), flush=True)
    print(", ".join(f"{n}/{args.runs} exited {code}" for code, n in sorted(tally.items())))
    return 0 if tally[0] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
