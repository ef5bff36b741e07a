"""The local truth: the projection of small meshes on this machine's CPU profile
(calibrate.py) against the step times `train.py` measures on them.

    python -m benchmarks.bench local [--steps 10] [--rounds 3] [--stored-only] [--json]

Each of LOCAL_MESHES runs the same config as `train.py` runs it (local_runs.py:
tools/launch.py -> torchrun for two ranks; one process with OMP_NUM_THREADS as the profile),
per-step times from metrics.jsonl, against `perf.model.project` with the profile (runtime
megapipe, float32). The
model prices dedicated cores; other work on the machine takes them away, so each run waits for
the machine to go quiet, is rerun when it was disturbed, and reports the other work's load and
the ranks' run-queue wait (/proc schedstat: time runnable without a core) next to its time.
The machine's speed itself drifts between runs (a shared host), so each run is also projected
with the profile's gloo fields probed just before it and its compute fields probed just before
and just after it (calibrate.probe_around), beside the stored profile's projection.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from benchmarks.calibrate import default_profile, probe_around
from benchmarks.harness import Parser, UsageError, run_cli, say
from benchmarks.local_runs import LOCAL_CONFIG, LOCAL_MESHES, Run, local_config, train_run
from benchmarks.probes import wait_quiet
from megapipe.config import Config, ConfigError
from megapipe.perf.cluster import Cluster, ClusterError, load_cluster
from megapipe.perf.model import Projection, project
from megapipe.perf.software import MEGAPIPE


def project_point(cfg: Config, cluster: Cluster) -> Projection:
    """The projection local truth compares against: runtime megapipe, float32, no memory."""
    return project(cfg, cluster, MEGAPIPE, memory=False)


@dataclass
class Point:
    name: str
    mesh: list[str]
    steps: list[float]  # every measured step, all rounds
    rounds: list[float]  # median of each round
    others: list[float]  # the other work's load (cores) during each round
    wait: list[float]  # each round's run-queue wait per step (s, the most waiting rank)
    projected: Projection  # on the stored profile
    cpu: list[float] = field(default_factory=list)  # each round's busiest rank's CPU s/step
    now: list[Projection] = field(default_factory=list)  # each round's, probed around it

    @property
    def measured(self) -> float:
        return statistics.median(self.steps)

    def _by_round(self) -> list[tuple[float, Projection]]:
        """(projected / measured, projection) of each round probed around its run, by ratio."""
        pairs = zip(self.now, self.rounds)
        return sorted(((p.step_time_s / m, p) for p, m in pairs), key=lambda x: x[0])

    @property
    def priced(self) -> Projection:
        """The projection shown for the point: the round's on the fields probed around it
        whose ratio to its run is the median one (local_points), else the stored profile's."""
        if not self.now:
            return self.projected
        ranked = self._by_round()
        return ranked[(len(ranked) - 1) // 2][1]

    @property
    def error(self) -> float:
        """With the probes: each round's projection against its own run (the machine's speed
        moves between rounds, the probes follow it), the median over rounds; else the stored
        profile's projection against the median step."""
        if not self.now:
            return self.stored_error
        return statistics.median(ratio for ratio, _ in self._by_round()) - 1

    @property
    def stored_error(self) -> float:
        return self.projected.step_time_s / self.measured - 1


def local_points(
    steps: int = 10,
    rounds: int = 3,
    warmup: int = 2,
    threads: int = 1,
    solo_threads: int | None = None,
    meshes: dict = LOCAL_MESHES,
    profile: str | None = None,
    solo_profile: str | None = None,
    quiet: float = 0.25,
    patience: float = 300.0,
    retries: int = 2,
    probe_each_run: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> list[Point]:
    """Measure every mesh `rounds` times, alternating, and project it (module docstring).
    One process runs `solo_threads` threads (default: `threads`) with its profile.

    The cores are shared with other work, which the model does not know about: each run
    waits (up to `patience` s) for the rest of the machine to use at most `quiet` cores, and
    a run during which it used more is run again (up to `retries` times; the least disturbed
    is kept). The table shows the other work's load during the runs kept.

    The machine's own speed moves too, by tens of percent within minutes, while the stored
    profile was measured once: with `probe_each_run`, the probes bracket each run
    (calibrate.probe_around: gloo's for two ranks, ~15 s, then the compute ones in as many
    processes as the run has ranks, ~4 s, just before the run and again just after it), which
    is also projected with the fields they measured."""
    solo_threads = solo_threads or threads
    clusters = {
        1: load_cluster(solo_profile or default_profile(solo_threads, ranks=1)),
        2: load_cluster(profile or default_profile(threads)),
    }
    runs: dict[str, list[tuple[Run, Projection | None]]] = {name: [] for name in meshes}
    for r in range(rounds):
        for name, mesh in meshes.items():
            cfg = local_config(mesh)
            world = cfg.derived.world_size
            ranks_threads = solo_threads if world == 1 else threads
            probed_on = _profile_of(clusters, world) if probe_each_run else None
            attempt = partial(_run_and_project, cfg, mesh, steps, warmup, ranks_threads, probed_on)
            label = f"round {r + 1}/{rounds}: {name}"
            runs[name].append(_least_disturbed(attempt, label, quiet, patience, retries, say))
    return [_point(name, mesh, runs[name], clusters) for name, mesh in meshes.items()]


def _run_and_project(
    cfg: Config,
    mesh: list[str],
    steps: int,
    warmup: int,
    threads: int,
    probed_on: Cluster | None,
) -> tuple[Run, Projection | None]:
    """train_run on `mesh` (whose config is `cfg`) and, given a stored profile `probed_on`,
    the run's projection on that profile with the fields the probes around the run measured
    (calibrate.probe_around); without one, the run alone."""

    def timed() -> Run:
        return train_run(mesh, steps, warmup, threads)

    if probed_on is None:
        return timed(), None
    cluster, run = probe_around(probed_on, cfg.derived.world_size, threads, timed)
    return run, project_point(cfg, cluster)


def _least_disturbed(
    attempt: Callable[[], tuple[Run, Projection | None]],
    label: str,
    quiet: float,
    patience: float,
    retries: int,
    say: Callable[[str], None],
) -> tuple[Run, Projection | None]:
    """`attempt()` once the machine is quiet (wait_quiet), again (up to `retries` times) while
    the other work used more than `quiet` cores during it: the least disturbed try."""
    tries = []
    for _ in range(retries + 1):
        wait_quiet(quiet, patience, say)
        run, now = attempt()
        tries.append((run, now))
        say(
            f"{label}: median {statistics.median(run.steps):.3f} s"
            + (f", projected now {now.step_time_s:.3f} s" if now else "")
            + f", other work {run.others:.2f} cores"
            + ("" if run.others <= quiet else " (disturbed)")
        )
        if run.others <= quiet:
            break
    return min(tries, key=lambda x: x[0].others)


def _profile_of(clusters: dict[int, Cluster], world: int) -> Cluster:
    """The stored profile a run of `world` ranks is priced on: one process's own, else the
    two-rank one (LOCAL_MESHES have at most two)."""
    return clusters[min(world, 2)]


def _point(name: str, mesh: list[str], got: list, clusters: dict) -> Point:
    """A mesh's Point from its kept (run, projection on the fields probed around it) rounds."""
    cfg = local_config(mesh)
    return Point(
        name,
        mesh,
        [t for run, _ in got for t in run.steps],
        [statistics.median(run.steps) for run, _ in got],
        [run.others for run, _ in got],
        [max(run.wait) for run, _ in got],
        project_point(cfg, _profile_of(clusters, cfg.derived.world_size)),
        [max(run.cpu) for run, _ in got],
        [now for _, now in got if now is not None],
    )


def markdown(points: list[Point]) -> str:
    """The local-truth table: measured median (quartiles over every step, range of the round
    medians), the other work's load and the ranks' run-queue wait; projected on the stored
    profile with its error, and with the fields probed around each run (the rounds'
    range) with the median of the rounds' errors; then the busiest rank's CPU time per step
    against Point.priced's compute + optimizer (what a rank computes, whoever else shares the
    cores), and where that projection puts the time."""
    rows = [
        "| mesh | measured (s) | steps p25-p75 | round medians | other work (cores) "
        "| run-queue wait (s/step) | projected, stored profile (s) | error "
        "| projected, probed around each run (s) | error, by round | rank CPU (s/step) "
        "| projected compute + optimizer (s) | error | projected compute / tp / bubble+p2p / dp "
        "/ optimizer (s) |",
        "|---" * 14 + "|",
    ]
    for p in points:
        q = statistics.quantiles(p.steps, n=4) if len(p.steps) > 1 else [p.measured] * 3
        b = p.priced.breakdown
        keys = ("compute_s", "tp_comm_s", "pipeline_bubble_p2p_s", "dp_comm_s", "optimizer_s")
        parts = " / ".join(f"{b[k]:.3f}" for k in keys)
        cpu = statistics.median(p.cpu) if p.cpu else math.nan
        work = b["compute_s"] + b["optimizer_s"]
        now = "— | —"
        if p.now:
            projected = [x.step_time_s for x in p.now]
            now = f"{min(projected):.3f}-{max(projected):.3f} | {p.error:+.1%}"
        rows.append(
            f"| {p.name} | {p.measured:.3f} | {q[0]:.3f}-{q[2]:.3f} | "
            f"{min(p.rounds):.3f}-{max(p.rounds):.3f} | {statistics.median(p.others):.2f} | "
            f"{statistics.median(p.wait):.3f} | {p.projected.step_time_s:.3f} | "
            f"{p.stored_error:+.1%} | {now} | {cpu:.3f} | {work:.3f} | {work / cpu - 1:+.1%} | "
            f"{parts} |"
        )
    rows.append("")
    if all(p.now for p in points):
        rows.append("step time, probed around each run: " + _summary([p.error for p in points]))
    rows.append("step time, stored profile: " + _summary([p.stored_error for p in points]))
    return "\n".join(rows)


def _summary(errors: list[float]) -> str:
    errs = [abs(e) for e in errors]
    return f"mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%}"


def points_json(points: list[Point]) -> dict:
    """The local truth as one JSON object (python -m benchmarks.bench local --json)."""
    return {
        "config": LOCAL_CONFIG,
        "points": [
            {
                "mesh": p.name,
                "overrides": p.mesh,
                "measured_s": p.measured,
                "steps_s": p.steps,
                "round_medians_s": p.rounds,
                "other_work_cores": p.others,
                "run_queue_wait_s": p.wait,
                "rank_cpu_s": p.cpu,
                "projected_stored_profile_s": p.projected.step_time_s,
                "error_stored_profile": p.stored_error,
                "projected_now_s": [now.step_time_s for now in p.now],
                "error": p.error,
                "breakdown": p.priced.breakdown,
            }
            for p in points
        ],
    }


def parse(argv: list[str]):
    loc = Parser(prog="python -m benchmarks.bench local",
                 description="projected vs measured train.py steps on this machine")  # fmt: skip
    loc.add_argument("--steps", type=int, default=10, help="timed steps per run")
    loc.add_argument("--warmup", type=int, default=2, help="steps before them, not timed")
    loc.add_argument("--rounds", type=int, default=3, help="runs of each mesh, alternating")
    loc.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    loc.add_argument("--solo-threads", type=int, help="threads of the one-process run")
    loc.add_argument("--profile", help="default: cpu (cpu_Nt for N threads)")
    loc.add_argument("--solo-profile", help="one-process run's (default cpu_solo)")
    loc.add_argument("--quiet", type=float, default=0.25, help="wait for other work <= cores")
    loc.add_argument("--patience", type=float, default=300.0, help="seconds to wait for it")
    loc.add_argument("--retries", type=int, default=2, help="reruns of a disturbed run")
    loc.add_argument(
        "--stored-only", action="store_true",
        help="skip the probes around each run: the stored profile's projection only",
    )  # fmt: skip
    loc.add_argument("--json", action="store_true", help="one JSON object")
    args, rest = loc.parse_known_args(argv)
    if rest:
        raise UsageError(f"local takes no {' '.join(rest)}")
    if min(args.steps, args.rounds, args.threads, args.solo_threads or 1) < 1 or args.warmup < 0:
        raise UsageError("--steps, --rounds and --threads must be at least 1, --warmup >= 0")
    return args


def local(argv: list[str]) -> int:
    """Run the local meshes and print them against their projections."""
    args = parse(argv)
    points = local_points(
        args.steps, args.rounds, args.warmup, args.threads, args.solo_threads,
        profile=args.profile, solo_profile=args.solo_profile, quiet=args.quiet,
        patience=args.patience, retries=args.retries, probe_each_run=not args.stored_only, say=say,
    )  # fmt: skip
    if args.json:
        print(json.dumps(points_json(points)))
        return 0
    config = " ".join(LOCAL_CONFIG)
    print(f"`python -m benchmarks.bench local {' '.join(argv)}` (config: {config})\n")
    print(markdown(points))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(local, argv, (ClusterError, ConfigError))


if __name__ == "__main__":
    sys.exit(main())
