"""Scaling studies: run a sweep of node counts and meshes, then report it beside the projection.

    python tools/scaling_study.py run configs/studies/tiny_local_weak.yaml --out runs/study_weak
    python tools/scaling_study.py run configs/studies/llama_7b_h100.yaml --out runs/s7b --dry-run
    python tools/scaling_study.py collect runs/s7b     # slurm: when the jobs are done
    python tools/scaling_study.py report runs/study_weak

`run` resolves every point of the study (megapipe/study/spec.py), then for each one: local:
torchrun agents on this machine (c10d rendezvous on 127.0.0.1, one agent per "node"); slurm:
writes DIR/points/NAME/job.sbatch and submits it with sbatch (only writes it with --dry-run);
command: runs the study's template. A point that cannot run or fails is recorded in its
point.json with its one-line error, and the study goes on. Local and command studies are
reported at the end of `run`; `collect` finds the slurm jobs' results and reports.

`report DIR` writes DIR/results.csv, results.json, report.md and PNG plots
(megapipe/study/report.py). Every launcher runs plain `train.py --config F [--section.key=value
...] --log.profile=true`: the run writes its own profile (megapipe/train/profile.py:
run.dir/study_profile.json, and under pp > 1 trace.json); its errors are one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from megapipe.study import StudyError, load_study
from megapipe.study.launchers import command_text, local_commands, sbatch_script
from megapipe.study.report import write_report
from megapipe.study.results import metrics_done

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "train.py")  # every point runs plain train.py (with --log.profile=true)
ERROR_LINE = re.compile(r"^error: .*$", re.MULTILINE)
EXCEPTION_LINE = re.compile(r"^\w*(Error|Exception)\b.*$", re.MULTILINE)


class UsageError(Exception):
    pass


# -- running the points -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_error(text: str, code: int) -> str:
    """The one-line cause from a point's output: train.py's `error:` line, else the last
    exception line, else the exit code."""
    found = ERROR_LINE.findall(text)
    if found:
        return found[0][len("error: ") :]
    found = EXCEPTION_LINE.findall(text)
    return found[-1] if found else f"exited with code {code} (see the point's logs)"


def run_local(study, point, pdir: Path, run_dir: Path) -> str | None:
    """The point's agents on this machine; None on success, else the one-line error."""
    port = int(study.launcher.get("port", 0)) or free_port()
    threads = str(study.launcher.get("threads", 1))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(ROOT),
           "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}  # fmt: skip
    cmds = local_commands(study, point, str(run_dir), sys.executable, SCRIPT, port)
    (pdir / "command.txt").write_text("\n".join(" ".join(c) for c in cmds) + "\n")
    logs = [open(pdir / f"node{i}.log", "w") for i in range(len(cmds))]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
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


def run_command(study, point, pdir: Path, run_dir: Path) -> tuple[str, str | None]:
    """The user's template in a shell: (status, error). A command that exits 0 before the run
    has logged its last step (it submitted the run elsewhere) leaves the point pending for
    `collect`."""
    text = command_text(study, point, str(pdir), str(run_dir), sys.executable, SCRIPT)
    (pdir / "command.txt").write_text(text + "\n")
    with open(pdir / "command.log", "w") as log:
        try:
            code = subprocess.run(text, shell=True, cwd=ROOT, stdout=log, timeout=study.timeout_s,
                                  stderr=subprocess.STDOUT).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return "failed", f"timed out after {study.timeout_s:g} s (timeout_s in the study)"
    if code:
        return "failed", first_error((pdir / "command.log").read_text(), code)
    return ("ok" if metrics_done(run_dir, study.steps) else "pending"), None


def submit_slurm(study, point, pdir: Path, run_dir: Path, dry_run: bool) -> tuple[str, str | None]:
    """Write job.sbatch; submit it unless dry_run: (status, job id or error)."""
    script = pdir / "job.sbatch"
    script.write_text(sbatch_script(study, point, str(pdir), str(run_dir), str(ROOT)))
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


def run_points(study, out: Path, dry_run: bool) -> None:
    kind = study.launcher["kind"]
    write_json(out / "study.json", study.to_dict())
    for point in study.points:
        pdir = out / "points" / point.name
        run_dir = pdir / "run"
        pdir.mkdir(parents=True, exist_ok=True)
        # a fresh run: an earlier one's checkpoints would be resumed (checkpoint.resume=auto)
        shutil.rmtree(run_dir, ignore_errors=True)
        record, error = point.to_dict(), point.error
        if point.projected_only:
            status = "projected"
        elif error:
            status = "failed"
        elif kind == "local":
            error = run_local(study, point, pdir, run_dir)
            status = "failed" if error else "ok"
            # the machine's load over the last minute: on a shared machine it explains
            # measured steps slower than the projection for a quiet one
            record["load_avg"], record["cpus"] = os.getloadavg()[0], os.cpu_count()
        elif kind == "command":
            status, error = run_command(study, point, pdir, run_dir)
        else:
            status, found = submit_slurm(study, point, pdir, run_dir, dry_run)
            record["job_id"], error = (found, None) if status == "submitted" else (None, found)
        record.update(status=status, error=error, point_dir=str(pdir), run_dir=str(run_dir))
        write_json(pdir / "point.json", record)
        print(f"{point.name}: {status}" + (f": {error}" if error else ""), flush=True)


def collect(out: Path) -> None:
    """Slurm (or a command that returned before its run ended): each submitted, written or
    pending point is ok when its metrics are complete, failed with the `error:` line of its job
    output (slurm-*.out, command.log), else still pending."""
    study = json.loads((out / "study.json").read_text())
    for point in study["points"]:
        pdir = out / "points" / point["name"]
        record = json.loads((pdir / "point.json").read_text())
        if record["status"] not in ("submitted", "written", "pending"):
            continue
        logs = sorted(pdir.glob("slurm-*.out")) + sorted(pdir.glob("command.log"))
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        if metrics_done(Path(record["run_dir"]), study["steps"]):
            record.update(status="ok", error=None)
        elif ERROR_LINE.search(text) or EXCEPTION_LINE.search(text):
            record.update(status="failed", error=first_error(text, 1))
        else:
            record["status"] = "pending"
        write_json(pdir / "point.json", record)
        print(f"{record['name']}: {record['status']}", flush=True)


# -- the command line ----------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or submit) every point of a study")
    run.add_argument("study", help="STUDY.yaml (see configs/studies/)")
    run.add_argument("--out", required=True, help="the study's directory")
    run.add_argument("--dry-run", action="store_true", help="slurm: write the scripts only")
    for name, text in (("collect", "find finished slurm jobs, then report"),
                       ("report", "write results.csv/json, report.md and plots")):  # fmt: skip
        p = sub.add_parser(name, help=text)
        p.add_argument("dir", help="the study's directory (run --out)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "run":
            study, out = load_study(args.study), Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            run_points(study, out, args.dry_run)
            if study.launcher["kind"] == "slurm" and not args.dry_run:
                print(f"submitted; when the jobs end: python tools/scaling_study.py collect {out}")
                return 0
        else:
            out = Path(args.dir)
            if not (out / "study.json").is_file():
                raise UsageError(f"{out}/study.json not found; give the --out dir of a study run")
            if args.command == "collect":
                collect(out)
        written = write_report(out)
        print(f"report: {written}")
    except (StudyError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
