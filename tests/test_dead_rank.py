"""A dead or stuck rank stops the run with an error within parallel.timeout_s, not a hang.

Each case launches train.py's main() in fresh processes with torchrun's environment (gloo, its
own short timeout); one rank fails at its first backward of step 2, mid-step while its peers
wait on it: it exits (os._exit) or hangs. Every other rank must exit non-zero, with a one-line
error, well within the bound; without the timeout a stuck peer would hold them for 30 min.
"""

import itertools
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TINY
from tests.parity import free_port

pytestmark = pytest.mark.spawn  # every case starts torchrun-like processes

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 40  # process start and a step or two on a loaded 2-core machine


def child() -> None:
    """One rank (torchrun's RANK etc. in the environment): `python -c ... MODE FAILING ARGS`."""
    import train
    from megapipe.pipeline.runtime import PipelineRuntime

    mode, failing, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if int(os.environ["RANK"]) == failing:
        backward, calls = PipelineRuntime._backward, itertools.count()

        def fail(self, action):
            if next(calls) == 2:  # first backward of step 2 (2 microbatches a step)
                if mode == "exit":
                    os._exit(3)
                time.sleep(3600)
            return backward(self, action)

        PipelineRuntime._backward = fail
    sys.exit(train.main(args))


def launch(world: int, mode: str, failing: int, overrides: list[str], run_dir: str) -> list:
    port, code = free_port(), "from tests.test_dead_rank import child; child()"
    args = ["--config", TINY, f"--run.dir={run_dir}", f"--parallel.timeout_s={TIMEOUT_S}",
            "--train.steps=4", "--parallel.microbatches=2", *overrides]  # fmt: skip
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        cmd = [sys.executable, "-c", code, mode, str(failing), *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    return procs


def wait_survivors(procs: list, failing: int) -> dict:
    """{rank: (exit code, stderr, seconds)} of every rank but `failing`; all killed at the end."""
    began, out = time.monotonic(), {}
    try:
        for rank, proc in enumerate(procs):
            if rank != failing:
                left = max(BOUND_S - (time.monotonic() - began), 0.1)
                try:
                    _, err = proc.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"rank {rank} still running after {BOUND_S} s: a hang")
                out[rank] = (proc.returncode, err, time.monotonic() - began)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    return out


@pytest.mark.parametrize("world,mode,failing,overrides", [
    (2, "exit", 1, ["--parallel.pp=2"]),  # p2p on the default group
    (4, "hang", 3, ["--parallel.pp=2", "--parallel.dp=2"]),  # dp all-reduce on a subgroup too
], ids=["pp2-rank-exits", "dp2-pp2-rank-hangs"])  # fmt: skip
def test_dead_rank_stops_the_run_with_an_error(tmp_path, world, mode, failing, overrides):
    survivors = wait_survivors(launch(world, mode, failing, overrides, str(tmp_path)), failing)
    for rank, (code, err, seconds) in survivors.items():
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code != 0, f"rank {rank} exited 0 although rank {failing} died"
        assert seconds < BOUND_S, f"rank {rank} took {seconds:.0f} s"
        # the line names the failing rank, from the records in run.dir/progress
        assert errors and errors[0].startswith(f"error: rank {failing} ("), errors
        assert "Traceback" not in err, f"rank {rank}: not a one-line error:\n{err}"
