"""checkpoint.async_save: the checkpoint holds the weights of the step it was taken at, although
training changed them while it was written, and it resumes like a synchronous one."""

import pytest

from tests.parity import tiny_config

MESHES = {
    "one-process": (1, []),
    "dp2-zero1": (2, ["parallel.dp=2", "parallel.zero=1"]),
    "tp2": (2, ["parallel.tp=2"]),
}


def async_case(overrides: list[str], run_dir: str) -> dict:
    """Train 2 steps, start an async save, train a 3rd step while it is written, wait; then
    load it into a fresh job: the loaded weights and moments are those after step 2."""
    import torch

    from megapipe.data.loader import build_data
    from megapipe.distributed.launch import init_distributed
    from megapipe.train import checkpoint
    from megapipe.train.checkpoint_async import Saver
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config([*overrides, "checkpoint.async=true"], run_dir)
    mesh = init_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    job, data = parallelize(cfg, mesh), build_data(cfg.data, cfg.model, cfg.train.seed)
    optimizer, saver = job.optimizer(), Saver(cfg)
    for step in range(2):
        job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
    with job.full_weights():  # zero=1 gathers the weights on first use after the step
        at_save = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    path = saver.save(2, job.model, optimizer)
    job.train_step(optimizer, data.batch(2, cfg.train.global_batch), 2)  # while it is written
    assert saver.wait() == path
    fresh = parallelize(cfg, mesh)
    fresh_optimizer = fresh.optimizer()
    checkpoint.load(checkpoint.resume_path(cfg), cfg, fresh.model, fresh_optimizer)
    loaded = dict(fresh.model.named_parameters())
    with job.full_weights():
        moved = any(not torch.equal(p, at_save[n]) for n, p in job.model.named_parameters())
    return {"same": all(torch.equal(loaded[n], w) for n, w in at_save.items()), "moved": moved}


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(MESHES))
def test_async_checkpoint_holds_the_step_it_was_taken_at(gloo_pool, tmp_path, name):
    world, overrides = MESHES[name]
    args = ([*overrides, "train.steps=3", "log.progress=false"], str(tmp_path))
    results = [async_case(*args)] if world == 1 else gloo_pool(world).run(async_case, *args)
    for got in results:
        assert got["moved"]  # training did change the weights during the write
        assert got["same"]  # the checkpoint has them as they were at the save


# Moments of the asynchronous save of step 2 at which the process is killed with SIGKILL:
# (what is patched, the call that kills, the checkpoint a resume must start from).
KILL_MOMENTS = {
    "tensors-half-written": ("torch.save", 20, 1),  # DCP's writer thread, mid .distcp
    "metadata-not-renamed": ("os.fsync", 1, 1),  # .metadata.tmp written, not yet in place
    "rng-not-written": ("checkpoint.save_file", 1, 1),  # DCP done; RNG file, records to come
    "meta-json-to-come": ("checkpoint._write_json", 1, 1),  # all files recorded
    "before-the-rename": ("os.replace", 1, 1),  # every file written, step_2.tmp not renamed
    "renamed-not-pruned": ("checkpoint._prune", 1, 2),
}


def killed_run(moment: str, argv: list[str]) -> None:
    """train.py's main(argv), killed (SIGKILL: nothing runs after) at the `moment` of the
    asynchronous save of step 2. Runs in a subprocess of the test below."""
    import os
    import signal
    import threading

    import torch

    import train
    from megapipe.train import checkpoint, checkpoint_async

    where, nth, _ = KILL_MOMENTS[moment]
    armed, calls = [False], [0]
    module, name = where.split(".")
    owner = {"torch": torch, "os": os, "checkpoint": checkpoint}[module]
    original, begin = getattr(owner, name), checkpoint_async.begin

    def counts(*args, **kwargs) -> bool:
        if where == "torch.save":  # DCP's writes from its thread, not the RNG file's
            return threading.current_thread() is not threading.main_thread()
        if where == "os.fsync":
            return os.readlink(f"/proc/self/fd/{args[0]}").endswith(".metadata.tmp")
        return True

    def killing(*args, **kwargs):
        if armed[0] and counts(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    def arming(cfg, step):
        armed[0] = armed[0] or step == 2
        return begin(cfg, step)

    setattr(owner, name, killing)
    checkpoint_async.begin = arming
    train.main(argv)
    raise SystemExit(f"{moment}: the run was not killed")


def _train(tmp_path, run_dir: str, moment: str | None = None):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, TINY

    argv = [
        "--config", TINY, f"--run.dir={run_dir}", f"--checkpoint.dir={tmp_path / 'ckpt'}",
        "--checkpoint.async_save=true", "--checkpoint.interval=1", "--checkpoint.keep=3",
        "--train.steps=4", "--log.interval=1",
    ]  # fmt: skip
    code = f"from tests.test_checkpoint_async import killed_run; killed_run({moment!r}, {argv!r})"
    cmd = [sys.executable, "-c", code] if moment else [sys.executable, f"{ROOT}/train.py", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _last_records(run_dir) -> dict[int, float]:
    """Step -> loss of metrics.jsonl, the last record of a step logged twice (killed, resumed)."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.spawn
def test_kill_at_any_moment_of_an_async_save_resumes_bit_for_bit(tmp_path):
    """kill -9 at six moments of an asynchronous save (tensors half written, .metadata not in
    place, RNG file and records to come, meta.json to come, before the rename, before the
    prune): the same command resumes from the newest checkpoint that was complete (never one it
    must skip), and every step's loss equals the uninterrupted run's, bit for bit."""
    import shutil

    from megapipe.train import checkpoint

    straight = tmp_path / "straight"
    done = _train(tmp_path / "s", str(straight))
    assert done.returncode == 0, done.stderr[-2000:]
    for moment, (_, _, start) in KILL_MOMENTS.items():
        trial, run_dir = tmp_path / moment, tmp_path / moment / "run"
        killed = _train(trial, str(run_dir), moment)
        assert killed.returncode == -9, f"{moment}: {killed.returncode} {killed.stderr[-2000:]}"
        found = checkpoint.complete_checkpoints(str(trial / "ckpt"))
        assert found[-1].endswith(f"step_{start:08d}"), f"{moment}: {found}"
        resumed = _train(trial, str(run_dir))
        assert resumed.returncode == 0, f"{moment}: {resumed.stderr[-2000:]}"
        assert "skipping" not in resumed.stdout, f"{moment}: {resumed.stdout}"  # all intact
        after = {s: loss for s, loss in _last_records(run_dir).items() if s > start}
        assert after == {s: loss for s, loss in _last_records(straight).items() if s > start}
        shutil.rmtree(trial)
