"""tools/launch.py checks the config before torchrun; train.py prints a rank's error once (rank 0)
and shuts its process groups down (megapipe/distributed/launch.shutdown) before it exits."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import train
from megapipe.cli import launch as launch_tool
from megapipe.distributed.launch import shutdown
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
    multi_node = ["--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=h:29400",
                  "--rdzv-id=j", "train.py"]  # fmt: skip
    args = launch_tool.parse_args(multi_node)
    cmd = launch_tool.torchrun_command(args)
    assert "--standalone" not in cmd
    assert cmd[-4:] == ["--node-rank=1", "--rdzv-endpoint=h:29400", "--rdzv-id=j", "train.py"]


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
