"""Scaling studies: run a sweep of node counts and meshes, then report it beside the projection.

    python tools/scaling_study.py run configs/studies/tiny_local_weak.yaml --out runs/study_weak
    python tools/scaling_study.py run configs/studies/llama_7b_h100.yaml --out runs/s7b --dry-run
    python tools/scaling_study.py collect runs/s7b     # slurm: when the jobs are done
    python tools/scaling_study.py collect --wait runs/s  # slurm: wait for the jobs first
    python tools/scaling_study.py report runs/study_weak

`run` resolves every point of the study (megapipe/study/spec.py) and checks each one's edge
ranks on fake tensors (megapipe/train/fake_checks.py, docs/scale.md): a point whose check fails
is recorded with its one line and not run (`--no-check` leaves the check out). Then for each
point: local:
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
import sys
from pathlib import Path

from megapipe.study import StudyError, load_study
from megapipe.study.report import write_report
from megapipe.study.runner import Entry, collect, run_points, wait_for_jobs
from megapipe.train.fake_checks import check_edges

ROOT = Path(__file__).resolve().parents[1]
# every point runs plain train.py (with --log.profile=true) from this checkout
ENTRY = Entry(ROOT, str(ROOT / "train.py"))


class UsageError(Exception):
    pass


# -- the command line ----------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or submit) every point of a study")
    run.add_argument("study", help="STUDY.yaml (see configs/studies/)")
    run.add_argument("--out", required=True, help="the study's directory")
    run.add_argument("--dry-run", action="store_true", help="slurm: write the scripts only")
    run.add_argument("--no-check", action="store_true",
                     help="start the points without first checking their edge ranks")  # fmt: skip
    for name, text in (("collect", "find finished slurm jobs, then report"),
                       ("report", "write results.csv/json, report.md and plots")):  # fmt: skip
        p = sub.add_parser(name, help=text)
        p.add_argument("dir", help="the study's directory (run --out)")
        if name == "collect":
            p.add_argument("--wait", action="store_true", help="first wait for its jobs to end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "run":
            study, out = load_study(args.study), Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            run_points(study, out, ENTRY, args.dry_run, None if args.no_check else check_edges)
            if study.launcher["kind"] == "slurm" and not args.dry_run:
                print(f"submitted; when the jobs end: python tools/scaling_study.py collect {out}")
                return 0
        else:
            out = Path(args.dir)
            if not (out / "study.json").is_file():
                raise UsageError(f"{out}/study.json not found; give the --out dir of a study run")
            if args.command == "collect":
                if args.wait:
                    timeout = json.loads((out / "study.json").read_text())["timeout_s"]
                    wait_for_jobs(out, timeout)
                collect(out)
        written = write_report(out)
        print(f"report: {written}")
    except (StudyError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
