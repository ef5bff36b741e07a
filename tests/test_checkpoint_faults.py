"""A full disk during a save: the checkpoint directory on a small tmpfs where the first checkpoint
fits and the second does not. The run stops with one line naming the directory, the bytes needed
and free (exit 2), or under checkpoint.on_save_error=continue warns and trains on; either way the
half-written checkpoint is gone and the first one resumes bit for bit."""

import json
import os
import subprocess

import pytest

import train
from megapipe.train import checkpoint
from tests.conftest import TINY

DISK_KIB = 800  # one tiny checkpoint is ~560 KB: the first fits, a second beside it does not


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a tmpfs of DISK_KIB KiB (mounting needs root; CI runs as root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k", "tmpfs", str(disk)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except OSError as e:
        pytest.skip(f"this machine cannot mount a small tmpfs ({e}); the full-disk test needs it")
    if done.returncode:
        pytest.skip(f"this machine cannot mount a small tmpfs ({done.stderr.strip()}): needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False, timeout=60)


def _main(run_dir, disk, *extra) -> int:
    return train.main(
        ["--config", TINY, f"--run.dir={run_dir}", f"--checkpoint.dir={disk}",
         "--train.steps=3", "--log.interval=1", "--checkpoint.keep=1", *extra]
    )  # fmt: skip


def _losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_full_disk_stops_with_one_line_and_the_first_checkpoint_resumes(
    tmp_path, small_disk, capfd, background
):
    straight = _losses_of(tmp_path / "straight", tmp_path / "none")
    capfd.readouterr()
    code = _main(tmp_path / "run", small_disk, "--checkpoint.interval=1",
                 f"--checkpoint.async_save={str(background).lower()}")  # fmt: skip
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, lines  # one line, no traceback, no warnings
    first, second = (checkpoint.step_dir(str(small_disk), s) for s in (1, 2))
    assert lines[0].startswith(f"error: checkpoint '{second}' could not be written: no space")
    assert f"free in '{small_disk}'" in lines[0] and "needs about" in lines[0]
    assert lines[0].endswith(f"{first} is intact")
    assert sorted(os.listdir(small_disk)) == ["step_00000001"]  # the half-written one removed
    assert _main(tmp_path / "resumed", small_disk, "--checkpoint.interval=0") == 0
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == [2, 3]
    assert [resumed[s] for s in (2, 3)] == [straight[s] for s in (2, 3)]  # bit for bit


def _losses_of(run_dir, ckpt_dir) -> dict[int, float]:
    assert _main(run_dir, ckpt_dir, "--checkpoint.interval=0") == 0
    return _losses(run_dir)


def test_full_disk_under_continue_warns_once_per_save_and_trains_on(tmp_path, small_disk, capfd):
    code = _main(tmp_path / "run", small_disk, "--checkpoint.interval=1",
                 "--checkpoint.on_save_error=continue")  # fmt: skip
    out, err = capfd.readouterr()
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.strip()]
    assert len(warned) == 2, warned  # steps 2 and 3, one line each
    for step, line in zip((2, 3), warned, strict=True):
        where = checkpoint.step_dir(str(small_disk), step)
        assert line.startswith(f"warning: checkpoint '{where}' could not be written: no space")
        assert line.endswith("training goes on (checkpoint.on_save_error=continue)")
    assert sorted(_losses(tmp_path / "run")) == [1, 2, 3]  # trained to the end
    assert sorted(os.listdir(small_disk)) == ["step_00000001"]  # no .tmp left for resume=auto
    assert "last checkpoint " + checkpoint.step_dir(str(small_disk), 1) in out
