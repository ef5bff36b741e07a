"""torchrun's agent, with the run's stop signals passed on to its workers: what
megapipe/cli/launch.py starts in place of `python -m torch.distributed.run` (same options).

A stock agent that receives SIGTERM (SLURM sends it to every process of a job step for
`--signal=TERM@N` and `scancel --signal=TERM`) raises SignalException: it sends SIGTERM on,
waits up to 30 s and exits 1, whatever its workers did, so a job whose every rank saved and
returned 0 still ends FAILED. Here the stop signals (MEGAPIPE_STOP_SIGNALS: the run's
checkpoint.signals) are left out of torchrun's list of the signals it dies on
(--signals-to-handle, read from PET_SIGNALS_TO_HANDLE): the agent passes them on to its
workers (megapipe/train/preempt.py: they save at the next step and return 0) and keeps
watching them, so it exits as they do. The handler is a Python function, so a worker starts
with the default disposition (an ignored signal would stay ignored in it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from torch.distributed.run import main as torchrun_main

STOP_ENV = "MEGAPIPE_STOP_SIGNALS"  # comma-separated names, e.g. SIGTERM,SIGUSR1
HANDLED_ENV = "PET_SIGNALS_TO_HANDLE"  # torchrun's --signals-to-handle
TORCHRUN_HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # its default


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; none elsewhere)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the name is in parentheses and may hold spaces: the fields after the last ')'
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def pass_on(signum: int, frame) -> None:
    """Send the signal to every worker; the agent goes on watching them."""
    for child in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(child, signum)


def stop_signals(text: str) -> list[signal.Signals]:
    return [signal.Signals[name.strip()] for name in text.split(",") if name.strip()]


def main(argv: list[str] | None = None) -> int:
    stops = stop_signals(os.environ.get(STOP_ENV, ""))
    names = {s.name for s in stops}
    handled = os.environ.get(HANDLED_ENV, TORCHRUN_HANDLED).split(",")
    os.environ[HANDLED_ENV] = ",".join(s for s in handled if s.strip() and s.strip() not in names)
    for sig in stops:
        signal.signal(sig, pass_on)
    torchrun_main(sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
