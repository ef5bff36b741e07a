"""SLURM for real (`pytest -m slurm`): a cluster of two nodes on this host
(tools/slurm/local_cluster.sh up; .ci/run brings it up and down) runs tools/slurm/train.sbatch
and the slurm study launcher, as a user would:

- the tiny weak study (configs/studies/tiny_slurm.yaml) through sbatch: `run` submits, `collect
  --wait` finds every measured point ok, the report as the local launcher's;
- a two-node job (2 nodes × 2 processes, dp 2 × pp 2, gloo; the README's sbatch line) trains
  like one process (rel 1e-5);
- `scancel --signal=TERM`: every rank saves, the job ends COMPLETED; requeued, it resumes bit for
  bit (losses equal to an uninterrupted run's);
- `--signal=TERM@N` with the time limit cut short: the same, and the next job of a
  `--dependency=afterany` chain resumes bit for bit;
- a job whose step dies (a rank SIGKILLed): `collect` records the point failed with its one-line
  error.

Skipped, with the reason, where no SLURM cluster of two usable nodes answers `sinfo`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import train
from megapipe.config import load_config
from megapipe.study.runner import ENDED
from tests.conftest import ROOT, TINY

UP = 'eval "$(sudo tools/slurm/local_cluster.sh up)"'
WAIT_S = 900  # a job's limit here: generous for a loaded machine, yet a hang still fails
# the preemption runs: dp 2 over the two nodes; dropout, so the RNG state is resumed too
PREEMPT = ["--parallel.dp=2", "--train.global_batch=16", "--model.dropout=0.1"]


def _no_cluster() -> str | None:
    """Why these tests cannot run here; None when two nodes are up."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return f"SLURM is not installed (no sinfo/sbatch); for a local cluster: {UP}"
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s"
    if done.returncode:
        cause = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        return f"no SLURM cluster answers sinfo ({cause}); bring one up: {UP}"
    usable = {line.split()[0] for line in done.stdout.splitlines()
              if line.split()[1].rstrip("*~#") in ("idle", "mix", "alloc")}  # fmt: skip
    return None if len(usable) >= 2 else f"fewer than two usable nodes in sinfo: {done.stdout!r}"


REASON = _no_cluster()
pytestmark = [pytest.mark.slurm, pytest.mark.spawn,
              pytest.mark.skipif(REASON is not None, reason=str(REASON))]  # fmt: skip


def job_env() -> dict[str, str]:
    """What the jobs inherit (sbatch exports the submitting environment): this interpreter."""
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ROOT, "WANDB_MODE": "disabled"}


def train_job(run: Path, *opts: str, overrides=(), devices: int = 1) -> str:
    """tools/slurm/train.sbatch on two nodes, unedited, as the README submits it (`sbatch
    --nodes=2 --export=ALL,DEVICES_PER_NODE=D tools/slurm/train.sbatch configs/tiny.yaml ...`);
    its output next to the run dir."""
    argv = ["sbatch", "--parsable", "--nodes=2", f"--export=ALL,DEVICES_PER_NODE={devices}",
            "--time=10", f"--output={run}-%j.out", *opts, "tools/slurm/train.sbatch",
            "configs/tiny.yaml", *overrides, f"--run.dir={run}"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=job_env(),
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)


def wait_job(job_id: str, restarts: int = 0) -> dict[str, str]:
    """The job's record once it has ended (after `restarts` requeues)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        info = job(job_id)
        if info["JobState"] in ENDED and int(info.get("Restarts", 0)) >= restarts:
            return info
        time.sleep(1)
    pytest.fail(f"job {job_id} still {info['JobState']} after {WAIT_S} s")


def ended_cleanly(info: dict[str, str], run: Path) -> str:
    """A job that ended COMPLETED with exit 0; its output."""
    text = Path(f"{run}-{info['JobId']}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    return text


def logged(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_steps(run: Path, count: int, job_id: str) -> None:
    """Until the run has logged `count` steps (its job still running)."""
    deadline = time.monotonic() + WAIT_S
    while len(logged(run)) < count:
        assert job(job_id)["JobState"] not in ENDED, f"job {job_id} ended before step {count}"
        assert time.monotonic() < deadline, f"job {job_id}: no step {count} after {WAIT_S} s"
        time.sleep(0.2)


def saved_by_every_rank(run: Path, text: str, world: int = 2) -> int:
    """The step the stop signal saved: one line from rank 0, every rank's shard and RNG."""
    (line,) = [x for x in text.splitlines() if x.startswith("saved step ")]
    step = int(line.split()[2].rstrip(";"))
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    for rank in range(world):
        assert (ckpt / f"rng_rank{rank}.pt").is_file() and (ckpt / f"__{rank}_0.distcp").is_file()
    return step


def reference(tmp_path: Path, overrides: list[str], last: int) -> list[float]:
    """The same two-rank run, uninterrupted, on this machine (tools/launch.py): its losses."""
    run = tmp_path / "reference"
    done = subprocess.run([sys.executable, "tools/launch.py", "--nproc-per-node=2", "train.py",
                           "--config", TINY, f"--run.dir={run}", *overrides,
                           f"--train.stop_at_step={last}"], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=WAIT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [r["loss"] for r in logged(run)]


def workers(run: Path) -> list[int]:
    """The training processes of `run` (train.py under torchrun; not its agents)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if f"--run.dir={run}" in args and not any(a.startswith("megapipe.cli") for a in args):
            found.append(int(pid))
    assert found, f"no training process of {run}"
    return found


def test_tiny_study_runs_through_sbatch_and_collect(tmp_path):
    out = tmp_path / "study"
    study = ["tools/scaling_study.py", "run", "configs/studies/tiny_slurm.yaml", "--out", str(out)]
    for argv in (study, ["tools/scaling_study.py", "collect", "--wait", str(out)]):
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=job_env(),
                              capture_output=True, text=True, timeout=WAIT_S)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((out / "results.json").read_text())["rows"]
    measured = [r for r in rows if r["status"] != "projected"]
    assert [r["status"] for r in measured] == ["ok"] * 3, [r.get("error") for r in measured]
    assert max(r["nodes"] for r in measured) == 2 and all(r["step_s"] > 0 for r in measured)
    report = (out / "report.md").read_text()
    assert "launcher slurm" in report and "Where a step goes" in report
    script = (out / "points" / measured[-1]["name"] / "job.sbatch").read_text()
    assert "--gpus-per-node" not in script and "CUDA_VISIBLE_DEVICES=''" in script  # CPUs


def test_two_node_job_trains_like_one_process(tmp_path):
    run = tmp_path / "two"
    readme = ["--parallel.dp=2", "--parallel.pp=2", "--train.global_batch=16"]  # 2 × 2 ranks
    info = wait_job(train_job(run, overrides=[*readme, "--train.steps=6"], devices=2))
    ended_cleanly(info, run)
    assert info["NumNodes"] == "2"
    one = train.run(load_config(TINY, [f"run.dir={tmp_path / 'one'}", "train.global_batch=16",
                                       "train.steps=6"]))  # fmt: skip
    two = logged(run)
    assert [r["step"] for r in two] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)


def test_scancel_term_saves_every_rank_and_the_requeued_job_resumes_bitwise(tmp_path):
    run, steps = tmp_path / "run", ["--train.steps=300"]
    job_id = train_job(run, "--requeue", overrides=[*PREEMPT, *steps])
    wait_steps(run, 2, job_id)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=60)
    saved = saved_by_every_rank(run, ended_cleanly(wait_job(job_id), run))
    assert 2 <= saved < 300
    # what a preempting partition does to a --requeue job; soon, not after SLURM's delay, but
    # in a later second than the first run's end: slurmd revokes an ended job's credential by
    # its time in whole seconds and kills a relaunch of the same job id whose new credential
    # falls in that second ("Job credential revoked")
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], check=True,
                   timeout=60)  # fmt: skip
    ended_cleanly(wait_job(job_id, restarts=1), run)
    records = logged(run)
    assert [r["step"] for r in records] == list(range(1, 301))
    assert [r["loss"] for r in records] == reference(tmp_path, [*PREEMPT, *steps], 300)


def _seconds(text: str) -> int:
    """SLURM's [D-]HH:MM:SS (or MM:SS) in seconds."""
    days, _, hms = text.rpartition("-")
    parts = [int(p) for p in hms.split(":")]
    return int(days or 0) * 86400 + sum(p * 60**i for i, p in enumerate(reversed(parts)))


def test_signal_before_the_time_limit_saves_and_the_afterany_job_resumes_bitwise(tmp_path):
    run, steps = tmp_path / "run", ["--train.steps=100000"]  # the signal ends it, not its steps
    first = train_job(run, "--signal=TERM@110", overrides=[*PREEMPT, *steps])
    second = train_job(run, f"--dependency=afterany:{first}", overrides=[*PREEMPT, *steps])
    wait_steps(run, 1, first)
    # the time limit cut to 45-105 s ahead, in whole minutes: TERM@110 is due at SLURM's next
    # check (every 30 s or so), well before the limit; not before the first step either
    minutes = math.ceil((_seconds(job(first)["RunTime"]) + 45) / 60)
    subprocess.run(["scontrol", "update", f"JobId={first}", f"TimeLimit={minutes}"], check=True,
                   timeout=60)  # fmt: skip
    saved = saved_by_every_rank(run, ended_cleanly(wait_job(first), run))
    wait_steps(run, saved + 3, second)  # the chained job resumed and went on
    subprocess.run(["scancel", "--signal=TERM", second], check=True, timeout=60)
    last = saved_by_every_rank(run, ended_cleanly(wait_job(second), run))
    records = logged(run)
    assert [r["step"] for r in records] == list(range(1, last + 1))
    assert [r["loss"] for r in records] == reference(tmp_path, [*PREEMPT, *steps], last)


def test_a_job_whose_step_dies_is_collected_failed_with_its_error(tmp_path):
    study = tmp_path / "study.yaml"
    point = {"nodes": 2, "devices_per_node": 1, "mesh": {"dp": 2}, "name": "p"}
    study.write_text(yaml.safe_dump({
        "name": "dies", "base": TINY, "kind": "strong", "steps": 100000, "warmup": 1,
        "launcher": {"kind": "slurm", "devices": "cpu", "time": "00:10:00"},
        "points": [point]}))  # fmt: skip
    out = tmp_path / "out"
    argv = [sys.executable, "tools/scaling_study.py", "run", str(study), "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, env=job_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "points" / "p" / "point.json").read_text())
    run = out / "points" / "p" / "run"
    wait_steps(run, 1, record["job_id"])
    os.kill(workers(run)[0], signal.SIGKILL)  # one rank dies; the step fails
    assert wait_job(record["job_id"])["JobState"] == "FAILED"
    done = subprocess.run([sys.executable, "tools/scaling_study.py", "collect", str(out)],
                          cwd=ROOT, env=job_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "points" / "p" / "point.json").read_text())
    assert record["status"] == "failed" and "\n" not in record["error"]
    # the surviving rank's line (train.py: the lost peer named, distributed/diagnosis.py),
    # else SLURM's (srun: error: ...)
    error = record["error"]
    assert re.match(r"rank \d \(pp=\d dp=\d cp=\d tp=\d\) died ", error) or error.startswith(
        "srun: error:"
    ), error
