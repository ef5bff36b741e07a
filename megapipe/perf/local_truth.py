"""The local truth: the projection of small meshes on this machine's CPU profile
(perf/calibrate.py) against the step times `train.py` measures on them.

Each of LOCAL_MESHES runs the same config as `train.py` runs it (tools/launch.py -> torchrun
for two ranks; one process with OMP_NUM_THREADS as the profile), per-step times from
metrics.jsonl, against `perf.model.project` with the profile (runtime megapipe, float32). The
model prices dedicated cores; other work on the machine takes them away, so each run waits for
the machine to go quiet, is rerun when it was disturbed, and reports the other work's load and
the ranks' run-queue wait (/proc schedstat: time runnable without a core) next to its time.
The machine's speed itself drifts between runs (a shared host), so each run is also projected
with the profile's gloo fields probed just before it and its compute fields probed just before
and just after it (calibrate.probe_around), beside the stored profile's projection.
`timed_steps` times the same build()/train_step in an already initialised gloo world (the
tests' worker pool) or one process.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from megapipe.config import Config, load_config
from megapipe.data.loader import build_data
from megapipe.distributed.mesh import MeshSizes, ParallelMesh
from megapipe.perf.calibrate import default_profile, probe_around
from megapipe.perf.cluster import Cluster, load_cluster
from megapipe.perf.model import Projection, project
from megapipe.perf.probes import cpu_ticks, wait_quiet
from megapipe.perf.runtime import MEGAPIPE
from megapipe.train.build import build

ROOT = Path(__file__).resolve().parents[2]

# One config for every point: big enough that a step is mostly GEMMs (about 25 GFLOP), small
# enough for a few seconds of steps on one core.
LOCAL_CONFIG = [
    "model.arch=gpt2",
    "model.n_layers=4",
    "model.d_model=256",
    "model.n_heads=4",
    "model.seq_len=128",
    "model.vocab_size=2048",
    "model.dropout=0.0",
    "train.global_batch=8",
    "parallel.microbatches=4",
    "train.lr=3e-4",
    "train.warmup=1",
    "data.source=synthetic",
    "log.progress=false",
    "log.interval=1",
]
# How often train_run looks at metrics.jsonl: the harness's own CPU is other work on the cores
# the ranks fill (at 5 ms it kept ~0.04 of a core busy); a mark up to 20 ms late is <1% of the
# ~3 s over which the ranks' scheduler counters are read.
POLL_S = 0.02
LOCAL_MESHES = {
    "1 process": [],
    "dp2": ["parallel.dp=2"],
    "pp2 1f1b": ["parallel.pp=2", "parallel.schedule=1f1b"],
    "pp2 zb_h1": ["parallel.pp=2", "parallel.schedule=zb_h1"],
    "tp2": ["parallel.tp=2"],
}


def local_config(mesh: list[str], extra: list[str] = ()) -> Config:
    return load_config(None, [*LOCAL_CONFIG, *extra, *mesh])


def project_point(cfg: Config, cluster: Cluster) -> Projection:
    """The projection local truth compares against: runtime megapipe, float32, no memory."""
    return project(cfg, cluster, MEGAPIPE, memory=False)


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid` (/proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _workers(proc: subprocess.Popen, world: int) -> list[int]:
    """The train.py processes: `proc` itself on one process, else torchrun's workers."""
    if world == 1:
        return [proc.pid]
    found = []
    for pid in _children(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train.py") for a in argv) and b"torch.distributed.run" not in argv:
            found.append(pid)
    return found


def _sched(pid: int) -> tuple[float, float, float]:
    """(main thread's CPU s, its run-queue wait s: runnable but not running, the process's
    CPU s over all threads) from /proc/<pid>/task/<pid>/schedstat and /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0, 0.0
    return run_ns * 1e-9, wait_ns * 1e-9, ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One train.py run, over its steps after the warm-up: per-step seconds (metrics.jsonl),
    per rank the run-queue wait per step (the time its training thread was runnable but had
    no core: the machine's other work), and the rest of the machine's load in cores."""

    steps: list[float]
    wait: list[float]  # per rank, s per step
    others: float  # cores the rest of the machine kept busy meanwhile
    cpu: list[float] = field(default_factory=list)  # per rank, its training thread's CPU s/step


def train_run(
    mesh: list[str],
    steps: int,
    warmup: int,
    threads: int,
    extra: list[str] = (),
    timeout: float = 600,
) -> Run:
    """Run train.py (tools/launch.py -> torchrun for world > 1) on the local config; step
    times from its metrics.jsonl (the loop times each train_step). While it runs, the ranks'
    scheduler counters are read when the warm-up's last step and the last step are logged."""
    cfg = local_config(mesh, extra)
    world = cfg.derived.world_size
    with tempfile.TemporaryDirectory(prefix="megapipe-local-") as tmp:
        args = [f"--{o}" for o in (*LOCAL_CONFIG, *extra, *mesh)]
        args += [f"--train.steps={steps + warmup}", f"--run.dir={tmp}/run"]
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        with open(Path(tmp) / "log.txt", "w+") as log:
            proc = subprocess.Popen(
                _train_command(args, world),
                env=_train_env(threads),
                cwd=tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            marks = _counters_while_running(
                proc, metrics, (warmup, warmup + steps), world, timeout, mesh
            )
            log.seek(0)
            output = log.read()
        if proc.returncode != 0:
            tail = output.strip().splitlines()[-5:]
            raise RuntimeError(f"train.py on {mesh or 'one process'} failed: " + " | ".join(tail))
        tokens = cfg.derived.tokens_per_step
        with open(metrics) as f:
            times = [tokens / json.loads(line)["tokens_per_s"] for line in f]
    return _run_between(times[warmup:], marks, warmup, warmup + steps, world)


def _train_command(args: list[str], world: int) -> list[str]:
    """train.py with `args`: itself on one process, else through tools/launch.py (torchrun)."""
    if world == 1:
        return [sys.executable, str(ROOT / "train.py"), *args]
    return [
        sys.executable,
        str(ROOT / "tools" / "launch.py"),
        f"--nproc-per-node={world}",
        str(ROOT / "train.py"),
        *args,
    ]


def _train_env(threads: int) -> dict[str, str]:
    """train.py's environment: `threads` OpenMP threads per rank, no wandb, the repo importable."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "WANDB_MODE": "disabled",
        "PYTHONPATH": str(ROOT),
    }


def _counters_while_running(
    proc: subprocess.Popen,
    metrics: Path,
    marks_at: tuple[int, int],
    world: int,
    timeout: float,
    mesh: list[str],
) -> dict[int, tuple]:
    """Wait for `proc` (killed past `timeout` s); {steps logged: (time, the machine's CPU
    ticks, each rank's _sched)} read as soon as metrics.jsonl holds each of `marks_at` lines."""
    began, marks = time.perf_counter(), {}
    try:
        while proc.poll() is None:
            if time.perf_counter() - began > timeout:
                raise RuntimeError(f"train.py on {mesh or 'one process'}: over {timeout} s")
            done = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
            for mark in marks_at:
                if done >= mark and mark not in marks:
                    pids = _workers(proc, world)
                    marks[mark] = (time.perf_counter(), cpu_ticks(), [_sched(p) for p in pids])
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return marks


def _run_between(steps: list[float], marks: dict, first: int, last: int, world: int) -> Run:
    """The Run of `steps` with the ranks' counters between the marks `first` and `last`
    (_counters_while_running): NaN where either mark was missed or did not find every rank."""
    complete = last in marks and first in marks
    if not complete or len(marks[first][2]) != world or len(marks[last][2]) != world:
        return Run(steps, [math.nan] * world, math.nan, [math.nan] * world)
    (t0, ticks0, s0), (t1, ticks1, s1) = marks[first], marks[last]
    between = last - first
    wait = [(b[1] - a[1]) / between for a, b in zip(s0, s1)]
    cpu = [(b[0] - a[0]) / between for a, b in zip(s0, s1)]
    ours = sum(b[2] - a[2] for a, b in zip(s0, s1))
    busy = (ticks1[0] - ticks0[0]) / os.sysconf("SC_CLK_TCK")
    return Run(steps, wait, max(busy - ours, 0.0) / (t1 - t0), cpu)


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


def _thread_wait() -> float:
    """Seconds this thread has been runnable without a core (/proc/thread-self/schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return math.nan


def timed_steps(mesh: list[str], steps: int, warmup: int, extra: list[str] = ()) -> dict:
    """train_step timed as train.py's loop times it, on the local config under `mesh`: in the
    initialised gloo world of the calling process (tests/parity.WorkerPool's ranks) or, with
    none, on this one process. Per-step seconds after `warmup` steps and this thread's
    run-queue wait per step."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="megapipe-local-") as tmp:
        cfg = local_config(mesh, [*extra, f"run.dir={tmp}/run"])
        grid = ParallelMesh(MeshSizes.of(cfg)) if dist.is_initialized() else None
        job = build(cfg, grid, "cpu")
        optimizer = job.optimizer()
        data = build_data(cfg.data, cfg.model, cfg.train.seed)
        times, wait0 = [], 0.0
        for step in range(warmup + steps):
            if step == warmup:
                if grid is not None:
                    dist.barrier()
                wait0 = _thread_wait()
            batch = data.batch(step, cfg.train.global_batch)
            began = time.perf_counter()
            job.train_step(optimizer, batch, step)
            times.append(time.perf_counter() - began)
        wait = (_thread_wait() - wait0) / steps
    return {"steps": times[warmup:], "wait": wait}


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
    """The local truth as one JSON object (tools/plan.py local --json)."""
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
