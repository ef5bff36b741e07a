"""tools/launch.py checks the config before torchrun; train.py prints a rank's error once (rank 0)
and shuts its process groups down (megapipe/distributed/launch.shutdown) before it exits."""

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import train
from megapipe.cli import launch as launch_tool
from megapipe.distributed.launch import shutdown
from megapipe.distributed.rendezvous import attempt_store
from tests.conftest import ROOT, TINY

REPORT = """Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : {} (pid: 11)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : {} (pid: 10)
"""


def launch(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """tools/launch.py as a user runs it: (result, seconds)."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "tools/launch.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return done, time.monotonic() - began


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("codes, torchrun, expected", [
    ((2, 2), 1, 2), ((-15, 2), 1, 2), ((3, 3), 1, 3), ((-15, 3), 1, 3),
    ((2, 3), 1, 1), ((1, 1), 1, 1), ((-6, 2), 1, 1), ((-15, -15), 1, 1),
])  # fmt: skip
def test_exit_code_of_torchrun_report(codes, torchrun, expected):
    assert launch_tool.exit_code(torchrun, REPORT.format(*codes)) == expected


def test_exit_code_without_report_is_torchrun_s():
    assert launch_tool.exit_code(0, "") == 0
    assert launch_tool.exit_code(1, "some other failure") == 1


def test_torchrun_command():
    args = launch_tool.parse_args(["--nproc-per-node", "2", "train.py", "--config", "x.yaml"])
    cmd = launch_tool.torchrun_command(args)
    assert cmd[1:] == ["-m", "megapipe.cli.agent", "--nproc-per-node=2", "--nnodes=1",
                       "--standalone", "train.py", "--config", "x.yaml"]  # fmt: skip
    args = launch_tool.parse_args(["--nproc-per-node=2", "--max-restarts", "3", "train.py"])
    assert launch_tool.torchrun_command(args)[-2:] == ["--max-restarts=3", "train.py"]
    multi_node = ["--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=h:29400",
                  "--rdzv-id=j", "train.py"]  # fmt: skip
    args = launch_tool.parse_args(multi_node)
    cmd = launch_tool.torchrun_command(args)
    assert "--standalone" not in cmd
    assert cmd[-4:] == ["--node-rank=1", "--rdzv-endpoint=h:29400", "--rdzv-id=j", "train.py"]


@pytest.mark.spawn
def test_sigterm_to_the_launcher_is_passed_on_to_torchrun(tmp_path):
    """SLURM signals every process of the job: tools/launch.py passes a stop signal of the run
    (checkpoint.signals) on and waits for torchrun's code instead of dying and closing the pipe
    the workers' stderr goes to."""
    ready = tmp_path / "ready"
    child = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('passed on', file=sys.stderr), "
        f"sys.exit(7)))\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(120)"
    )

    def signal_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process: the launcher's handler

    reached = []  # the signal reached this guard, not the launcher's handler: not passed on

    def guard(*args):
        reached.append(args)

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        threading.Thread(target=signal_when_ready, daemon=True).start()
        code, tail = launch_tool.run_torchrun([sys.executable, "-c", child], ["SIGTERM"])
        assert (code, tail, reached) == (7, "passed on\n", [])
        assert signal.getsignal(signal.SIGTERM) is guard  # the handler before it is back
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_config_error_printed_by_rank0_only(tmp_path, monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    code = train.main(["--config", TINY, "--model.n_heads=5", f"--run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: model.n_heads=5") if printed else err == ""


def test_shutdown_destroys_the_group(tmp_path):
    shutdown()  # no group: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        assert dist.is_initialized()
        shutdown()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.spawn
def test_invalid_config_is_one_line_before_any_process(tmp_path):
    run_dir = tmp_path / "run"
    done, seconds = launch("--nproc-per-node", "2", "train.py", "--config", TINY,
                           "--parallel.dp=3", f"--run.dir={run_dir}")  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train.global_batch=8"), done.stderr
    assert "torch.distributed" not in done.stderr + done.stdout  # torchrun never started
    assert not run_dir.exists() and seconds < 60  # no worker started: a few seconds


def test_max_restarts_needs_resume_auto(capsys):
    args = ["--nproc-per-node", "2", "--max-restarts", "2", "train.py", "--config", TINY,
            "--parallel.dp=2", "--checkpoint.resume=none"]  # fmt: skip
    assert launch_tool.main(args) == 2  # refused before torchrun starts
    assert capsys.readouterr().err == (
        "error: --max-restarts=2 with checkpoint.resume='none': a restart would not continue "
        "from the newest checkpoint; set --checkpoint.resume=auto\n"
    )


@pytest.mark.spawn
def test_world_size_mismatch_is_one_line(tmp_path):
    done, _ = launch("--nproc-per-node", "2", "train.py", "--config", TINY, "--parallel.pp=4",
                     "--model.n_layers=4", f"--run.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == error_lines(done.stderr)[0]
    assert "world size 2 != dp·pp·cp·tp = 4" in done.stderr


@pytest.mark.spawn
def test_run_time_data_error_printed_once_and_exit_2(tmp_path):
    """The config is valid; the missing dataset is found by every rank after the group exists."""
    done, _ = launch("--nproc-per-node", "2", "train.py", "--config", TINY, "--parallel.pp=2",
                     "--data.source=memmap", "--data.path=/nonexistent",
                     f"--run.dir={tmp_path}")  # fmt: skip
    errors = error_lines(done.stderr)
    assert errors == ["error: data.path '/nonexistent' not found; run python "
                      "tools/prepare_data.py or set data.path"], done.stderr  # fmt: skip
    codes = {int(c) for c in launch_tool.EXITCODE.findall(done.stderr)}
    assert codes and codes - {launch_tool.STOPPED} == {2}, done.stderr  # each rank 2 or stopped
    assert done.returncode == 2
    assert 'train.py", line' not in done.stderr  # no worker traceback (torchrun's own is there)


@pytest.mark.spawn
def test_two_rank_run_exits_0_after_shutdown(tmp_path):
    done, _ = launch("--nproc-per-node", "2", "train.py", "--config", TINY, "--parallel.pp=2",
                     "--train.steps=2", f"--run.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr and not error_lines(done.stderr)
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]


def _start(world: int, rank0_delay: float) -> list:
    """One start of `world` ranks (threads) on the store at MASTER_PORT: each one's store."""
    stores = [None] * world

    def rank(r: int) -> None:
        time.sleep(rank0_delay if r == 0 else 0)
        stores[r] = attempt_store(r, world, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return stores


def test_each_start_gets_a_store_prefix_no_earlier_start_used(monkeypatch):
    """torchrun's agent store outlives a restart: what one start wrote (and a request cut
    short by a kill) never reaches the next, whichever rank comes first."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    first = _start(3, rank0_delay=0.0)
    first[0].set("address/1", "dead peer")
    server.add("megapipe/attempts/requests", 1)  # an asker killed before it wrote its nonce
    second = _start(3, rank0_delay=0.5)  # the others ask first, beside the old requests
    second[2].set("address/1", "live peer")
    assert [s.get("address/1") for s in second] == [b"live peer"] * 3
    assert [s.get("address/1") for s in first] == [b"dead peer"] * 3
    third = _start(3, rank0_delay=0.0)
    assert not any(s.check(["address/1"]) for s in third)


@pytest.mark.spawn
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_stop_signal_to_the_launcher_saves_every_rank_and_exits_0(tmp_path, sig):
    """What SLURM does before a time limit (it signals every process of the step): the agent
    (megapipe/cli/agent.py) passes the signal on and exits as its workers do, 0 after every
    rank saved, where a stock torchrun agent exits 1 (SignalException)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "tools/launch.py", "--nproc-per-node", "2",
                             "train.py", "--config", TINY, "--parallel.dp=2",
                             "--train.global_batch=16", "--train.steps=100000",
                             f"--run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "no step logged"
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    (line,) = [x for x in out.splitlines() + err.splitlines() if x.startswith("saved step ")]
    step = int(line.split()[2].rstrip(";"))
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    assert all((saved / f"rng_rank{r}.pt").is_file() for r in range(2)), sorted(saved.iterdir())
