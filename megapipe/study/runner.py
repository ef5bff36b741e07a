"""Running a study's points (megapipe/study/__init__.py): local torchrun agents, a user's
command, or sbatch scripts (launchers.py writes their command lines), each point's outcome in
DIR/points/NAME/point.json; `collect` finds the results of points that ran elsewhere.

What to run comes from the caller (`Entry`: the checkout and its training script, which
tools/scaling_study.py names); nothing here knows a file path of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megapipe.distributed.local_world import free_port
from megapipe.study.launchers import command_text, local_commands, sbatch_script
from megapipe.study.results import metrics_done
from megapipe.study.spec import Study

ERROR_LINE = re.compile(r"^error: .*$", re.MULTILINE)
EXCEPTION_LINE = re.compile(r"^\w*(Error|Exception)\b.*$", re.MULTILINE)
# SLURM's own: a step that died (srun: error: n1: task 0: Killed), a job over its time limit
SLURM_LINE = re.compile(r"^(srun|slurmstepd)(-\S+)?: error: .*$", re.MULTILINE)
# squeue's states of a job that is over (it still lists one for MinJobAge after its end)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """What every point runs: `script` (train.py; launchers.script_args adds its arguments)
    from the checkout `root` (the working directory and PYTHONPATH of local and command
    points; slurm jobs cd there)."""

    root: Path
    script: str


def first_error(text: str, code: int) -> str:
    """The one-line cause from a point's output: train.py's `error:` line, else the last
    exception line, else SLURM's first error line, else the exit code."""
    found = ERROR_LINE.findall(text)
    if found:
        return found[0][len("error: ") :]
    found = [m.group(0) for m in EXCEPTION_LINE.finditer(text)]
    if found:
        return found[-1]
    found = [m.group(0) for m in SLURM_LINE.finditer(text)]
    return found[0] if found else f"exited with code {code} (see the point's logs)"


def job_state(job_id: str | None) -> str | None:
    """SLURM's state of a submitted job: squeue's (PENDING, RUNNING, COMPLETED, ...), "GONE"
    when SLURM no longer knows the id, None when it cannot be asked (no job id, no squeue, no
    controller)."""
    if not job_id or shutil.which("squeue") is None:
        return None
    done = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        return "GONE" if "Invalid job id" in done.stderr else None
    return (done.stdout.split() or ["GONE"])[0]


def run_local(study, point, pdir: Path, run_dir: Path, entry: Entry) -> str | None:
    """The point's agents on this machine; None on success, else the one-line error."""
    port = int(study.launcher.get("port", 0)) or free_port()
    threads = str(study.launcher.get("threads", 1))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(entry.root),
           "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}  # fmt: skip
    cmds = local_commands(study, point, str(run_dir), sys.executable, entry.script, port)
    (pdir / "command.txt").write_text("\n".join(" ".join(c) for c in cmds) + "\n")
    logs = [open(pdir / f"node{i}.log", "w") for i in range(len(cmds))]
    procs = [subprocess.Popen(c, cwd=entry.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True) for c, log in zip(cmds, logs)]  # fmt: skip
    deadline, codes = time.monotonic() + study.timeout_s, []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for proc in procs:  # our agents' sessions only (their workers inherit them)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
        for log in logs:
            log.close()
    if codes is None:
        return f"timed out after {study.timeout_s:g} s (timeout_s in the study); see node*.log"
    text = "\n".join((pdir / f"node{i}.log").read_text() for i in range(len(cmds)))
    if any(codes) or not metrics_done(run_dir, study.steps):
        return first_error(text, max(codes, key=abs))
    return None


def run_command(study, point, pdir: Path, run_dir: Path, entry: Entry) -> tuple[str, str | None]:
    """The user's template in a shell: (status, error). A command that exits 0 before the run
    has logged its last step (it submitted the run elsewhere) leaves the point pending for
    `collect`."""
    text = command_text(study, point, str(pdir), str(run_dir), sys.executable, entry.script)
    (pdir / "command.txt").write_text(text + "\n")
    with open(pdir / "command.log", "w") as log:
        try:
            done = subprocess.run(text, shell=True, cwd=entry.root, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=study.timeout_s)  # fmt: skip
            code = done.returncode
        except subprocess.TimeoutExpired:
            return "failed", f"timed out after {study.timeout_s:g} s (timeout_s in the study)"
    if code:
        return "failed", first_error((pdir / "command.log").read_text(), code)
    return ("ok" if metrics_done(run_dir, study.steps) else "pending"), None


def submit_slurm(
    study, point, pdir: Path, run_dir: Path, entry: Entry, dry_run: bool
) -> tuple[str, str | None]:
    """Write job.sbatch; submit it unless dry_run: (status, job id or error)."""
    script = pdir / "job.sbatch"
    job = sbatch_script(study, point, str(pdir), str(run_dir), str(entry.root), entry.script,
                        sys.executable)  # fmt: skip
    script.write_text(job)
    if dry_run:
        return "written", None
    if shutil.which("sbatch") is None:
        return "failed", "sbatch not found on PATH; run on the cluster's login node or --dry-run"
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode:
        return "failed", "sbatch: " + (done.stderr.strip().splitlines() or ["failed"])[-1]
    return "submitted", done.stdout.strip().split(";")[0]


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def run_points(study: Study, out: Path, entry: Entry, dry_run: bool = False, check=None) -> None:
    """Every point of `study` under `out`/points/NAME: run, submitted or written (`dry_run`),
    projected only, or failed with its one-line error; its point.json says which. `check`
    (a config's one-line problem or None: train/fake_checks.check_edges) runs on every point
    first, before anything is started or queued; a point it fails is not run."""
    kind = study.launcher["kind"]
    write_json(out / "study.json", study.to_dict())
    checked = check_points(study, check) if check is not None else {}
    for point in study.points:
        pdir = out / "points" / point.name
        run_dir = pdir / "run"
        pdir.mkdir(parents=True, exist_ok=True)
        # a fresh run: an earlier one's checkpoints would be resumed (checkpoint.resume=auto)
        shutil.rmtree(run_dir, ignore_errors=True)
        record, error = point.to_dict(), point.error or checked.get(point.name)
        if point.projected_only:
            status = "projected"
        elif error:
            status = "failed"
        elif kind == "local":
            error = run_local(study, point, pdir, run_dir, entry)
            status = "failed" if error else "ok"
            # the machine's load over the last minute: on a shared machine it explains
            # measured steps slower than the projection for a quiet one
            record["load_avg"], record["cpus"] = os.getloadavg()[0], os.cpu_count()
        elif kind == "command":
            status, error = run_command(study, point, pdir, run_dir, entry)
        else:
            status, found = submit_slurm(study, point, pdir, run_dir, entry, dry_run)
            record["job_id"], error = (found, None) if status == "submitted" else (None, found)
        record.update(status=status, error=error, point_dir=str(pdir), run_dir=str(run_dir))
        write_json(pdir / "point.json", record)
        print(f"{point.name}: {status}" + (f": {error}" if error else ""), flush=True)


def check_points(study: Study, check) -> dict[str, str]:
    """{name: "check: <its one line>"} of each point that would run and fails `check`."""
    failed = {}
    for point in study.points:
        if point.projected_only or point.error:
            continue
        problem = check(point.cfg)
        print(f"{point.name}: checked: {problem or 'ok'}", flush=True)
        if problem:
            failed[point.name] = f"check: {problem}"
    return failed


def _open_records(out: Path) -> list[tuple[Path, dict]]:
    """(point dir, point.json) of each point still waiting for its results."""
    study = json.loads((out / "study.json").read_text())
    found = []
    for point in study["points"]:
        pdir = out / "points" / point["name"]
        record = json.loads((pdir / "point.json").read_text())
        if record["status"] in ("submitted", "written", "pending"):
            found.append((pdir, record))
    return found


def wait_for_jobs(out: Path, timeout_s: float, poll_s: float = 5.0) -> None:
    """Until no job of the study is queued or running in SLURM (or `timeout_s` has passed)."""
    jobs = [r.get("job_id") for _, r in _open_records(out) if r.get("job_id")]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [job_state(j) for j in jobs]
        if all(state is None or state in ENDED or state == "GONE" for state in states):
            return
        time.sleep(poll_s)


def collect(out: Path) -> None:
    """Slurm (or a command that returned before its run ended): each submitted, written or
    pending point is ok when its metrics are complete; pending while SLURM still runs or queues
    its job; failed with the one-line error of its job output (slurm-*.out, command.log:
    train.py's `error:` line, an exception, SLURM's `srun: error:` line), or because its job
    ended without one; else still pending."""
    steps = json.loads((out / "study.json").read_text())["steps"]
    for pdir, record in _open_records(out):
        logs = sorted(pdir.glob("slurm-*.out")) + sorted(pdir.glob("command.log"))
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        state = job_state(record.get("job_id"))
        if metrics_done(Path(record["run_dir"]), steps):
            record.update(status="ok", error=None)
        elif state is not None and state not in ENDED and state != "GONE":
            record["status"] = "pending"
        elif any(p.search(text) for p in (ERROR_LINE, EXCEPTION_LINE, SLURM_LINE)):
            record.update(status="failed", error=first_error(text, 1))
        elif state is not None:
            job = record["job_id"]
            record.update(status="failed", error=f"job {job} ended ({state.lower()}) before "
                          f"the run's last step; see {pdir}/slurm-{job}.out")  # fmt: skip
        else:
            record["status"] = "pending"
        write_json(pdir / "point.json", record)
        print(f"{record['name']}: {record['status']}", flush=True)
