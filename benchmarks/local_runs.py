"""How `train.py` runs on this machine for the local truth (local_truth.py): one config
(LOCAL_CONFIG) on five small meshes (LOCAL_MESHES), run as a user runs it (tools/launch.py ->
torchrun for two ranks, one process with OMP_NUM_THREADS as the profile), its per-step times
read from metrics.jsonl, and the ranks' scheduler counters (/proc: their CPU time and run-queue
wait, the machine's other work) read over the steps after the warm-up.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.probes import cpu_ticks
from megapipe.config import Config, load_config
from megapipe.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

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
    """LOCAL_CONFIG under `mesh` (one of LOCAL_MESHES) with the `extra` overrides."""
    return load_config(None, [*LOCAL_CONFIG, *extra, *mesh])


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
    """The train.py processes: `proc` itself on one process, else the agent's workers (the
    agent, tools/launch.py's megapipe.cli.agent or torchrun's, has train.py in its argv too)."""
    if world == 1:
        return [proc.pid]
    found = []
    for pid in _children(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        agent = b"torch.distributed.run" in argv or b"megapipe.cli.agent" in argv
        if any(a.endswith(b"train.py") for a in argv) and not agent:
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
        times = [tokens / r["tokens_per_s"] for r in read_metrics(str(metrics))]
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
