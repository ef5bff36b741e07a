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
def small_disks(tmp_path):
    """`small_disks(name)`: a directory on a tmpfs of DISK_KIB KiB (mounting needs root; CI
    runs as root), unmounted after the test."""
    mounted = []

    def mount(name: str):
        disk = tmp_path / name
        disk.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k", "tmpfs", str(disk)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except OSError as e:
            pytest.skip(f"this machine cannot mount a small tmpfs ({e}): the test needs root")
        if done.returncode:
            pytest.skip(f"this machine cannot mount a small tmpfs ({done.stderr.strip()}): "
                        "the test needs root")  # fmt: skip
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=60)


@pytest.fixture
def small_disk(small_disks):
    return small_disks("disk")


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


def dp2_full_disk_case(root: str, disks: list[str]) -> dict:
    """dp2 with zero=1, a sync and an async save onto a full disk: what each rank raised, what
    is left on the disk, and the losses of a resume from it and of a run that never saved."""
    import train
    from megapipe.train.checkpoint import SaveFailed
    from tests.parity import tiny_config

    common = ["parallel.dp=2", "parallel.zero=1", "train.steps=3", "checkpoint.keep=1"]
    straight = train.run(tiny_config([*common, f"checkpoint.dir={root}/none"], f"{root}/s"))
    out = {"straight": [r["loss"] for r in straight]}
    for background, disk in zip(("false", "true"), disks, strict=True):
        run = [*common, f"checkpoint.dir={disk}", f"checkpoint.async_save={background}"]
        try:
            train.run(tiny_config([*run, "checkpoint.interval=1"], f"{root}/{background}"))
            raised = None
        except SaveFailed as e:
            raised = str(e)
        left = sorted(os.listdir(disk))
        resumed = train.run(tiny_config([*run, "checkpoint.interval=0"], f"{root}/r{background}"))
        out[background] = {"raised": raised, "left": left, "losses": [r["loss"] for r in resumed]}
    return out


def test_dp2_ranks_agree_on_a_failed_save_and_resume(gloo_pool, tmp_path, small_disks):
    """Every rank of a dp2 zero=1 run raises the same one-line SaveFailed at the same save (no
    rank waits in a collective for another), sync and async; the first checkpoint resumes."""
    disks = [str(small_disks("sync")), str(small_disks("async"))]
    results = gloo_pool(2).run(dp2_full_disk_case, str(tmp_path / "runs"), disks)
    for background, disk in zip(("false", "true"), disks, strict=True):
        raised = {r[background]["raised"] for r in results}
        assert len(raised) == 1, raised  # the same line on both ranks
        (line,) = raised
        assert line is not None and "\n" not in line
        assert line.startswith(f"checkpoint '{disk}/step_00000002' could not be written: rank ")
        assert "no space left on device" in line and "needs about" in line
        for r in results:
            assert r[background]["left"] == ["step_00000001"]
            assert r[background]["losses"] == r["straight"][1:]  # bit for bit from step 1


def test_a_short_write_in_torchs_zip_writer_is_a_full_disk():
    """DCP's writers torch.save into file streams; when the disk fills inside a record, torch's
    zip writer raises a RuntimeError ("unexpected pos") with no errno. `written` takes it as the
    disk's fault (ENOSPC), so the ranks agree on a one-line SaveFailed; any other RuntimeError
    is a bug and propagates."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from megapipe.train.checkpoint_faults import written

    def failing(exc):
        def fn():
            stack = traceback.StackSummary.from_list([])
            raise CheckpointException("write", {0: (exc, stack), 1: (exc, stack)})

        return fn

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    got = written(failing(short))
    assert isinstance(got, OSError) and got.errno == errno.ENOSPC
    assert "no space left on device" in got.strerror.lower()
    with pytest.raises(CheckpointException):
        written(failing(RuntimeError("a bug")))
