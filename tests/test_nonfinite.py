"""Non-finite steps are skipped alike on every rank and mesh; runs say what they did; one live
run per run.dir.

A NaN is injected by a test hook: at a chosen step, a grad hook on one parameter of global rank
0 turns that parameter's gradient into NaN, before any reduction, so the mesh must carry it to
every rank's decision (dp buckets, the norm over pp × tp)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import train
from megapipe.train import checkpoint, runlock
from megapipe.train import parallelize as parallelize_module
from megapipe.train.loop import NonFiniteError
from tests.conftest import TINY
from tests.parity import LOW_LR, build_mesh, tiny_config
from tests.util import assert_rel_close, assert_state_close

POISON_AT = 1  # the second step (0-based index) gets a NaN gradient


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def poisoned(at: set[int]):
    """Within: Job.train_step of a step in `at` gets a NaN grad on rank 0's first parameter."""
    real = parallelize_module.train_step

    def step_fn(engine, slice_, optimizer, batch, step, cfg, *hooks):
        if step not in at or _rank() != 0:
            return real(engine, slice_, optimizer, batch, step, cfg, *hooks)
        param = next(engine.chunks[0].parameters())
        handle = param.register_hook(lambda g: g * float("nan"))
        try:
            return real(engine, slice_, optimizer, batch, step, cfg, *hooks)
        finally:
            handle.remove()

    parallelize_module.train_step = step_fn
    try:
        yield
    finally:
        parallelize_module.train_step = real


def poisoned_case(overrides: list[str], steps: int = 4) -> dict:
    """Train `steps` steps with a NaN at POISON_AT: losses, skip flags, final logical weights."""
    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.train.optim import build_optimizer
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, build_mesh(cfg), "cpu", 0.01)
    optimizer = build_optimizer(job.model, cfg.train)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    with poisoned({POISON_AT}):
        results = [
            job.train_step(optimizer, data.batch(s, cfg.train.global_batch), s)
            for s in range(steps)
        ]
    weights = {}
    for chunk in job.engine.chunks:
        weights.update(gather_logical(chunk))
    return {
        "losses": [r.loss for r in results],
        "skipped": [r.skipped for r in results],
        "weights": weights,
    }


MESHES = {
    "dp2": ["parallel.dp=2"],
    "tp2": ["parallel.tp=2"],
    "pp2-zb_h1": ["parallel.pp=2", "parallel.schedule=zb_h1", "parallel.microbatches=2"],
}


def test_skipped_step_leaves_weights_and_optimizer_untouched(tmp_path):
    from megapipe.data.loader import build_data
    from megapipe.train.optim import build_optimizer
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config([], str(tmp_path))
    job = parallelize(cfg, None)
    optimizer = build_optimizer(job.model, cfg.train)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    job.train_step(optimizer, data.batch(0, cfg.train.global_batch), 0)
    weights = {k: v.clone() for k, v in job.model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    with poisoned({1}):
        result = job.train_step(optimizer, data.batch(1, cfg.train.global_batch), 1)
    assert result.skipped and not torch.isfinite(torch.tensor(result.grad_norm))
    assert all(torch.equal(v, weights[k]) for k, v in job.model.state_dict().items())
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    assert all(p.grad is None for p in job.model.parameters())
    after = job.train_step(optimizer, data.batch(2, cfg.train.global_batch), 2)
    assert not after.skipped and torch.isfinite(torch.tensor(after.loss))


@pytest.mark.parametrize("name", sorted(MESHES))
def test_nan_is_skipped_identically_under_every_mesh(gloo_pool, name):
    ref = poisoned_case([LOW_LR])
    assert ref["skipped"] == [False, True, False, False]
    results = gloo_pool(2).run(poisoned_case, [LOW_LR, *MESHES[name]])
    for got in results:
        assert got["skipped"] == ref["skipped"], name
        finite = [i for i, s in enumerate(ref["skipped"]) if not s]
        assert_rel_close(
            torch.tensor([got["losses"][i] for i in finite]),
            torch.tensor([ref["losses"][i] for i in finite]),
            name="loss",
        )
    union = {k: v for got in results for k, v in got["weights"].items()}
    assert_state_close(union, ref["weights"], reach=3e-4 * 4)


def test_run_that_skipped_resumes_bitwise(tiny_cfg, tmp_path):
    common = ["train.steps=4", "checkpoint.interval=4"]
    with poisoned({POISON_AT}):
        full = train.run(tiny_cfg(*common, f"run.dir={tmp_path / 'full'}"))
        split = tmp_path / "split"
        first = train.run(tiny_cfg(*common, f"run.dir={split}", "train.stop_at_step=2"))
        second = train.run(tiny_cfg(*common, f"run.dir={split}"))
    assert [r["skipped"] for r in full] == [False, True, False, False]
    assert [r["skipped"] for r in first] == [False, True]
    assert [r["loss"] for r in first + second] == [r["loss"] for r in full]
    _, a = checkpoint.load_for_inference(str(tmp_path / "full"))
    _, b = checkpoint.load_for_inference(str(split))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_stop_mode_and_max_skipped_name_the_last_good_checkpoint(tiny_cfg):
    cfg = tiny_cfg("train.on_nonfinite=stop", "checkpoint.interval=1")
    with poisoned({1}), pytest.raises(NonFiniteError) as err:
        train.run(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith("step 2 had a non-finite loss")
    assert message.endswith(
        "last good checkpoint: "
        f"{checkpoint.step_dir(checkpoint.checkpoint_root(cfg), 1)}; "
        "lower train.lr or check the data"
    )
    cfg = tiny_cfg("train.max_skipped=2", "checkpoint.resume=none", "train.steps=4")
    with poisoned({1, 2}), pytest.raises(NonFiniteError, match=r"step 3 .*\(2 in a row"):
        train.run(cfg)
    with poisoned({1}):  # one skip under the limit: the run goes on
        assert [r["skipped"] for r in train.run(tiny_cfg("checkpoint.resume=none"))] == [
            False,
            True,
            False,
            False,
        ]


def test_a_run_says_what_it_did_and_a_finished_one_says_so(tiny_cfg, capsys):
    cfg = tiny_cfg("train.steps=2", "train.eval_interval=2", "checkpoint.interval=2")
    train.run(cfg)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = 2 * cfg.train.global_batch * cfg.model.seq_len
    assert line.startswith("done: step 2/2, loss ") and ", val_loss " in line
    assert f", {tokens:,} tokens, " in line and ", 0 steps skipped, last checkpoint " in line
    assert line.endswith(checkpoint.step_dir(checkpoint.checkpoint_root(cfg), 2))
    assert train.run(cfg) == []
    assert capsys.readouterr().out.strip() == (
        "already complete at step 2 (train.steps=2); nothing to do: raise --train.steps or set "
        "another run.dir"
    )


def test_a_live_run_holds_its_run_dir(tmp_path, tiny_cfg):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "run" / runlock.LOCK_FILE
        lock.parent.mkdir()
        lock.write_text(f"{os.uname().nodename} {holder.pid}\n")
        with pytest.raises(runlock.RunDirBusy) as err:
            train.run(tiny_cfg())
        assert str(err.value) == (
            f"run.dir '{tmp_path / 'run'}' is in use by the run of pid {holder.pid} on "
            f"{os.uname().nodename}; wait for it to finish or set another run.dir"
        )
    finally:
        holder.kill()
        holder.wait()
    assert len(train.run(tiny_cfg())) == 4  # its process is gone: the lock is stale
    assert not lock.exists(), "the lock is released at the end of a run"


def test_cli_errors_for_bad_numbers_and_a_busy_run_dir_are_one_line(tmp_path, capsys):
    args = ["--config", TINY, f"--run.dir={tmp_path}", "--train.on_nonfinite=stop"]
    with poisoned({0}):
        assert train.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: step 1 had a non-finite loss or grad norm") and "\n" not in err
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / runlock.LOCK_FILE).write_text(f"{os.uname().nodename} {holder.pid}\n")
        assert train.main(args) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: run.dir '{tmp_path}' is in use by the run of pid {holder.pid}")
