"""Failures around the job, with real torchrun agents (tools/launch.py, torchrun underneath):

- in-job restart: `--max-restarts` with checkpoint.resume=auto; a worker killed with SIGKILL at
  some step, the agent restarts the group, every rank resumes the newest checkpoint, and the run
  ends with the losses of an uninterrupted run bit for bit (dp2 and pp2, three trials each: other
  ranks, other steps; one uninterrupted run per mesh shared by its trials);
- preemption from the launcher: SIGTERM to the torchrun agent (what SLURM sends) makes every
  rank save at the next step and exit; the same command resumes bit for bit.

Each trial is one agent start watched from here: the kill comes when rank 0's metrics.jsonl
holds a given step, aimed at the worker whose RANK is given (the agent's children).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megapipe.train import checkpoint
from megapipe.train.metrics import read_metrics
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.spawn  # every case starts torchrun agents

STEPS = 16  # a SIGTERM after step 2 must land before the last step, also when steps are fast
COMMON = [f"--train.steps={STEPS}", "--train.warmup=2", "--model.dropout=0.1",
          "--checkpoint.interval=2", "--parallel.timeout_s=60", "--log.progress=false"]  # fmt: skip
MESHES = {"dp2": ["--parallel.dp=2"], "pp2": ["--parallel.pp=2", "--parallel.microbatches=2"]}
TIMEOUT_S = 240  # one agent start, restarts included, on a loaded 2-core machine


def start(run_dir: Path, mesh: str, *extra: str, restarts: int = 0) -> subprocess.Popen:
    """tools/launch.py on two local ranks of `mesh`, its output in run_dir's parent."""
    cmd = [sys.executable, "tools/launch.py", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "train.py", "--config", TINY, *MESHES[mesh],
           *COMMON, f"--run.dir={run_dir}", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with open(f"{run_dir}.log", "w") as log:  # a session of its own: killed whole if stuck
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen, run_dir: Path) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, Path(f"{run_dir}.log").read_text()


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone meanwhile
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def agent_of(launcher: subprocess.Popen) -> int:
    """The torchrun agent: tools/launch.py's child."""
    (agent,) = wait_for(lambda: children(launcher.pid) or None, launcher)
    return agent


def worker(agent: int, rank: int) -> int | None:
    """The pid of the agent's worker with RANK `rank` (None until it exists)."""
    for pid in children(agent):
        if environ(pid).get("RANK") == str(rank):
            return pid
    return None


def wait_for(find, proc: subprocess.Popen):
    """Poll `find()` until it returns something; fails if `proc` ends first or it takes long."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = find()
        if found:
            return found
        assert proc.poll() is None, "the run ended before the awaited moment"
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def logged_step(run_dir: Path) -> int:
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    return records[-1]["step"] if records else 0


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(run_dir / "metrics.jsonl"))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(mesh)`: the losses of a run never interrupted, once per mesh."""
    runs = {}

    def get(mesh: str) -> list[float]:
        if mesh not in runs:
            run_dir = tmp_path_factory.mktemp("full") / mesh
            code, out = finish(start(run_dir, mesh), run_dir)
            assert code == 0, out[-3000:]
            runs[mesh] = losses(run_dir)
            assert len(runs[mesh]) == STEPS
        return runs[mesh]

    return get


TRIALS = [  # (mesh, rank killed, step logged by rank 0 when it is killed); checkpoints: 2, 4, 6
    ("dp2", 1, 3), ("dp2", 0, 5), ("dp2", 1, 6),
    ("pp2", 0, 3), ("pp2", 1, 5), ("pp2", 0, 6),
]  # fmt: skip


@pytest.mark.parametrize("mesh, rank, step", TRIALS)
def test_a_killed_worker_is_restarted_and_the_run_ends_bit_for_bit(
    tmp_path, uninterrupted, mesh, rank, step
):
    run_dir = tmp_path / "run"
    proc = start(run_dir, mesh, restarts=2)
    agent = agent_of(proc)
    wait_for(lambda: logged_step(run_dir) >= step, proc)
    os.kill(wait_for(lambda: worker(agent, rank), proc), signal.SIGKILL)
    time.sleep(1.0)  # a step whose collectives had all run may still be logged by rank 0
    reached = logged_step(run_dir)  # no later step can be: it needs the killed rank
    code, out = finish(proc, run_dir)
    assert code == 0, out[-3000:]
    assert "connectFullMesh" not in out
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    resumed = [r for r in records if "resumed_from" in r]
    assert len(resumed) == 1, records  # the kill took: one restart, which resumed
    assert resumed[0]["attempt"] == 1
    # the newest checkpoint when the kill landed: the one before `step` at the earliest (the
    # worker may have run on while the kill was aimed), one at most at the step reached
    last = resumed[0]["resumed_from"]
    assert last % 2 == 0 and step - 1 - (step - 1) % 2 <= last <= reached, (last, reached)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert losses(run_dir) == uninterrupted(mesh)  # bit for bit, dropout included


@pytest.mark.parametrize("mesh", ["dp2", "pp2"])
def test_sigterm_to_the_agent_saves_exits_and_the_same_command_resumes(
    tmp_path, uninterrupted, mesh
):
    run_dir = tmp_path / "run"
    extra = ["--checkpoint.interval=0"]  # the stop's save is the only checkpoint
    proc = start(run_dir, mesh, *extra)
    agent = agent_of(proc)
    wait_for(lambda: logged_step(run_dir) >= 2, proc)
    os.kill(agent, signal.SIGTERM)
    sent = time.monotonic()
    code, out = finish(proc, run_dir)
    # every worker was done within the agent's 30 s (it says when it has to SIGKILL one); the
    # bound here also allows for the agent's own exit on a loaded machine
    assert "forcefully exiting" not in out and time.monotonic() - sent < 60, out[-3000:]
    saved = [os.path.basename(p) for p in checkpoint.complete_checkpoints(f"{run_dir}/checkpoints")]
    assert len(saved) == 1, out[-3000:]
    stopped = int(saved[0].split("_")[1])
    assert 2 <= stopped < STEPS
    assert f"saved step {stopped}; run the same command to resume" in out
    assert 'train.py", line' not in out  # no worker traceback (the agent's own is there)
    assert logged_step(run_dir) == stopped
    code, out = finish(start(run_dir, mesh, *extra), run_dir)  # the same command
    assert code == 0, out[-3000:]
    assert losses(run_dir) == uninterrupted(mesh)
