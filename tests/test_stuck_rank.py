"""A stuck rank is named: with real torchrun agents (tools/launch.py), one rank is frozen
(SIGSTOP) mid-run; the survivor's one error line names it and what it last did, within
parallel.timeout_s + 15 s, and the job exits 3. A job killed from outside leaves records that
tools/diagnose.py (megapipe/cli/diagnose.py) reads, the frozen rank first. The survivor's
flight-recorder trace, dumped as it gives up (megapipe/distributed/flight.py), names the
collective it waits in and the frozen rank as the one that never entered it; a wait in a
send/recv (pp2), which gloo does not record, is named from the progress record.

The rank to freeze is found, and the moment chosen, from its own progress record in run.dir
(megapipe/distributed/progress.py): its pid, and a step past the first.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megapipe.cli import diagnose
from megapipe.distributed import flight
from megapipe.distributed.diagnosis import GONE, process_state, stale_s
from megapipe.distributed.progress import read_records
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.spawn

TIMEOUT_S = 10
NAMED_WITHIN_S = TIMEOUT_S + 15
START_S = 240  # torchrun and two workers importing torch on a loaded 2-core machine


class Job:
    """`tools/launch.py --nproc-per-node 2 train.py ...`, its stderr lines with their times."""

    def __init__(self, run_dir: str, *overrides: str) -> None:
        self.run_dir, self.lines = run_dir, []
        args = ["--config", TINY, f"--run.dir={run_dir}", "--train.steps=100000",
                "--checkpoint.interval=0", *overrides]  # fmt: skip
        cmd = [sys.executable, "tools/launch.py", "--nproc-per-node", "2", "train.py", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def record_at_step(self, rank: int, step: int):
        """Rank `rank`'s record once it has begun step `step` (or later)."""
        began = time.monotonic()
        while time.monotonic() - began < START_S:
            record = read_records(self.run_dir).get(rank)
            if record is not None and record.step >= step:
                return record
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"rank {rank} never reached step {step}:\n" + self.stderr())

    def error_line(self, since: float, within: float) -> tuple[str, float]:
        """The first `error:` line and its seconds after `since`; fails after `within` s."""
        while time.monotonic() - since < within + 5:
            found = [(t, x) for t, x in self.lines if x.startswith("error:")]
            if found:
                return found[0][1], found[0][0] - since
            time.sleep(0.1)
        pytest.fail(f"no error line {within + 5} s after the stop:\n" + self.stderr())

    def stderr(self) -> str:
        return "\n".join(x for _, x in self.lines)

    def kill(self) -> None:
        """Everything the job started: the launcher and torchrun (their session) and the
        workers (torchrun starts each in a session of its own)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: its own group
        for record in read_records(self.run_dir).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.reader.join(timeout=10)


@pytest.mark.parametrize("mesh,frozen,survivor", [
    ("--parallel.dp=2", 1, 0),
    ("--parallel.pp=2", 0, 1),
], ids=["dp2", "pp2"])  # fmt: skip
def test_frozen_rank_is_named_in_the_survivors_line(tmp_path, mesh, frozen, survivor):
    job = Job(str(tmp_path), mesh, f"--parallel.timeout_s={TIMEOUT_S}")
    try:
        record = job.record_at_step(frozen, 2)
        os.kill(record.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(0.5)  # the record as the frozen rank left it
        where = read_records(str(tmp_path))[frozen].where()
        line, seconds = job.error_line(stopped_at, NAMED_WITHIN_S)
        flight_lines = diagnosis_of_the_frozen(str(tmp_path))  # before the frozen rank resumes
        os.kill(record.pid, signal.SIGCONT)  # it meets the lost peer too, or torchrun's SIGTERM
        code = job.proc.wait(timeout=120)
    finally:
        job.kill()
    c = read_records(str(tmp_path))[frozen].coords_text()
    assert line.startswith(f"error: rank {frozen} ({c}) stopped "), line
    assert f" s ago {where}; rank {survivor} gave up at " in line, line
    assert seconds < NAMED_WITHIN_S, f"named after {seconds:.0f} s: {line}"
    assert code == 3, job.stderr()
    assert 'train.py", line' not in job.stderr()  # no worker traceback (torchrun's own is there)
    check_flight_lines(flight_lines, read_records(str(tmp_path))[survivor], frozen)


def diagnosis_of_the_frozen(run_dir: str) -> list[str]:
    """tools/diagnose.py's flight-recorder lines while the frozen rank is still frozen."""
    return flight.report(run_dir, read_records(run_dir))


def check_flight_lines(lines: list[str], waiter, frozen: int) -> None:
    """The survivor (`waiter`, its record) left a trace; the last line names where it waits:
    a collective the frozen rank never entered, or (gloo records no p2p) its send/recv."""
    me = waiter.rank
    assert lines[0] == "flight recorder: 1 traces (rank<R>.fr.json)", lines
    assert lines[1].startswith(f"rank {me} last entered "), lines
    if waiter.wait.startswith("all_reduce"):
        assert lines[-1].startswith("first collective some rank never entered: all_reduce ")
        assert f"; rank {frozen} never entered it (no trace: stopped or died); " in lines[-1]
        assert lines[-1].endswith(f"waiting in it: rank {me}"), lines
    else:
        assert waiter.wait.startswith(flight.P2P) and waiter.peer == frozen, waiter
        assert lines[-1] == (
            f"every recorded collective matches; waiting in send/recv: rank {me} "
            f"{waiter.where()} (not in gloo's flight recorder: from the progress records)"
        ), lines


def test_diagnose_names_the_rank_frozen_before_the_job_was_killed(tmp_path, capsys):
    job = Job(str(tmp_path), "--parallel.pp=2", "--parallel.timeout_s=600")
    try:
        record = job.record_at_step(1, 2)
        os.kill(record.pid, signal.SIGSTOP)
        time.sleep(stale_s(600) + 4)  # rank 0 waits on it meanwhile, its heartbeat going on
        where = read_records(str(tmp_path))[1].where()
    finally:
        job.kill()  # from outside, as scancel or a user's kill -9
    pids = [r.pid for r in read_records(str(tmp_path)).values()]
    for _ in range(200):  # the kill takes effect asynchronously
        if all(process_state(pid) in GONE for pid in pids):
            break
        time.sleep(0.05)
    assert diagnose.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("rank 1 (pp=1 dp=0 cp=0 tp=0, ") and " stopped, " in out[1], out
    assert out[1].endswith(where), out
    assert out[2].startswith("rank 0 (pp=0 dp=0 cp=0 tp=0, ") and " stopped" not in out[2], out
