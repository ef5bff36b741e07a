"""Preemption (checkpoint.signals): a stop signal ends the run at the next step boundary with a
checkpoint, one line from rank 0 and exit code 0; the same command resumes it bit for bit.

The signal is sent by the process to itself right after a given step (a patched Job.train_step),
so the step it stops at is known. In-process cases guard SIGTERM with a handler that fails the
test instead of killing pytest; the others run train.py's main() in fresh processes, on one
rank or on two with torchrun's environment, signalling one rank only.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

import train
from megapipe.config import ConfigError, load_config
from megapipe.config.checks import signal_names
from megapipe.train import checkpoint, loop, parallelize
from tests.conftest import ROOT, TINY
from tests.parity import free_port

LINE = "saved step {}; run the same command to resume"
COMMON = ["model.dropout=0.1", "train.steps=6", "train.warmup=2"]  # dropout: RNG resumed too


def signal_after(monkeypatch, sig: int, step: int) -> None:
    """Send `sig` to this process when training step `step` (1-based) has finished."""
    real = parallelize.Job.train_step

    def train_step(self, optimizer, batch, index, *hooks):
        result = real(self, optimizer, batch, index, *hooks)
        if index + 1 == step:
            os.kill(os.getpid(), sig)
        return result

    monkeypatch.setattr(parallelize.Job, "train_step", train_step)


class Uncaught(Exception):
    pass


@pytest.fixture
def guarded():
    """SIGTERM and SIGUSR1 raise here instead of ending pytest; the previous handlers return."""

    def fail(signum, frame):
        raise Uncaught(f"signal {signum} reached the test's own handler")

    previous = {s: signal.signal(s, fail) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield fail
    for s, handler in previous.items():
        signal.signal(s, handler)


def _losses(records):
    return [r["loss"] for r in records]


def _logged(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def _saved(run_dir) -> list[str]:
    return [os.path.basename(p) for p in checkpoint.complete_checkpoints(f"{run_dir}/checkpoints")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_and_the_same_command_resumes_bitwise(
    tiny_cfg, tmp_path, monkeypatch, capsys, guarded, sig
):
    full = train.run(tiny_cfg(*COMMON, f"run.dir={tmp_path / 'full'}", "checkpoint.resume=none"))
    split = tmp_path / "split"
    cfg = tiny_cfg(*COMMON, f"run.dir={split}")
    with monkeypatch.context() as m:
        signal_after(m, sig, 2)
        first = train.run(cfg)
    assert [r["step"] for r in first] == [1, 2]
    assert _saved(split) == ["step_00000002"]  # checkpoint.interval=0: the stop's save only
    assert capsys.readouterr().out.strip().splitlines()[-1] == LINE.format(2)
    assert signal.getsignal(sig) is guarded  # the previous handler is back
    second = train.run(cfg)  # the same command
    assert [r["step"] for r in second] == [3, 4, 5, 6]
    assert _losses(first + second) == _losses(full)  # bit for bit, dropout included
    assert _losses(_logged(split)) == _losses(full)


def test_a_stop_past_the_grace_exits_without_a_checkpoint(tiny_cfg, monkeypatch, capsys, guarded):
    """checkpoint.preempt_grace_s: the save of step 1 (checkpoint.interval=1) took longer than
    the grace, so the signal after step 2 stops the run without saving step 2 (which resumes
    from step 1's checkpoint); a grace of 0 is no limit."""
    cfg = tiny_cfg(*COMMON, "checkpoint.interval=1", "checkpoint.preempt_grace_s=0.0001")
    with monkeypatch.context() as m:
        signal_after(m, signal.SIGTERM, 2)
        assert [r["step"] for r in train.run(cfg)] == [1, 2]
    assert _saved(cfg.run.dir) == ["step_00000001"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("stopped at step 2 without a checkpoint: the signal came ")
    assert "past checkpoint.preempt_grace_s=0.0001; run the same command to resume from " in last
    assert last.endswith("step_00000001")
    unlimited = tiny_cfg(*COMMON, "checkpoint.interval=1", "checkpoint.preempt_grace_s=0",
                         "checkpoint.resume=none", f"run.dir={cfg.run.dir}-0")  # fmt: skip
    with monkeypatch.context() as m:
        signal_after(m, signal.SIGTERM, 2)
        train.run(unlimited)
    assert _saved(unlimited.run.dir) == ["step_00000001", "step_00000002"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == LINE.format(2)


def test_signal_during_the_last_step_saves_and_a_rerun_is_complete(
    tiny_cfg, monkeypatch, capsys, guarded
):
    cfg = tiny_cfg("train.steps=2")
    with monkeypatch.context() as m:
        signal_after(m, signal.SIGTERM, 2)
        assert [r["step"] for r in train.run(cfg)] == [1, 2]
    assert _saved(cfg.run.dir) == ["step_00000002"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == LINE.format(2)
    monkeypatch.setattr(loop.checkpoint, "save", _no_save)
    assert train.run(cfg) == []
    assert capsys.readouterr().out.strip() == (
        "already complete at step 2 (train.steps=2); nothing to do: raise --train.steps or set "
        "another run.dir"
    )


def _no_save(*args, **kwargs):
    raise AssertionError("a run with nothing to do saved a checkpoint")


def test_stop_at_step_says_the_same_line_and_a_rerun_does_not_save(tiny_cfg, monkeypatch, capsys):
    cfg = tiny_cfg("train.stop_at_step=2")
    assert [r["step"] for r in train.run(cfg)] == [1, 2]
    assert capsys.readouterr().out.strip().splitlines()[-1] == LINE.format(2)
    monkeypatch.setattr(loop.checkpoint, "save", _no_save)
    assert train.run(cfg) == []
    assert capsys.readouterr().out.strip() == (
        "already at train.stop_at_step=2 (step 2); nothing to do: remove --train.stop_at_step "
        "to go on to train.steps"
    )


def test_a_run_without_a_signal_says_nothing_of_it(tiny_cfg, capsys):
    train.run(tiny_cfg())
    assert "run the same command" not in capsys.readouterr().out


def test_handlers_are_set_only_while_the_run_lasts(tiny_cfg, monkeypatch, guarded):
    seen = []
    real = parallelize.Job.train_step

    def train_step(self, *args):
        seen.append({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)})
        return real(self, *args)

    monkeypatch.setattr(parallelize.Job, "train_step", train_step)
    train.run(tiny_cfg("train.steps=1", "checkpoint.signals=SIGUSR1"))
    assert seen[0][signal.SIGTERM] is guarded  # not listed: untouched
    assert seen[0][signal.SIGUSR1] is not guarded
    train.run(tiny_cfg("train.steps=2", "checkpoint.signals=", "checkpoint.resume=none"))
    assert seen[1] == {signal.SIGTERM: guarded, signal.SIGUSR1: guarded}  # "": none at all
    assert signal.getsignal(signal.SIGUSR1) is guarded


@pytest.mark.parametrize("text, names", [
    ("SIGTERM,SIGUSR1", ["SIGTERM", "SIGUSR1"]),
    ("", []),
    ("usr2, TERM,SIGTERM", ["SIGUSR2", "SIGTERM"]),
])  # fmt: skip
def test_signal_names(text, names):
    assert signal_names(text) == names


@pytest.mark.parametrize("text", ["SIGKILL", "STOP", "SIGFOO", "SIGTERM,15"])
def test_bad_signal_is_one_line_naming_the_key(text):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"checkpoint.signals={text}"])
    message = str(err.value)
    assert message.startswith(f"checkpoint.signals='{text}': ") and "\n" not in message
    assert "is not a signal a process can catch" in message


def test_default_signals():
    assert load_config(TINY).checkpoint.signals == "SIGTERM,SIGUSR1"


# --- train.py in fresh processes: exit codes, one rank or two -----------------------------------


def child() -> None:
    """`python -c ... SIGNAL STEP SIGNALLED_RANK ARGS`: train.main(ARGS), this process sending
    itself SIGNAL after step STEP if its RANK is SIGNALLED_RANK (STEP 0: never)."""
    name, step, signalled, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    if step and int(os.environ.get("RANK", "0")) == signalled:
        real = parallelize.Job.train_step

        def train_step(self, optimizer, batch, index, *hooks):
            result = real(self, optimizer, batch, index, *hooks)
            if index + 1 == step:
                os.kill(os.getpid(), signal.Signals[name])
            return result

        parallelize.Job.train_step = train_step
    sys.exit(train.main(args))


def launch(world: int, args: list[str], sig: str = "SIGTERM", step: int = 0, rank: int = 1):
    """train.py's main() on `world` ranks (torchrun's environment when world > 1);
    [(exit code, stdout, stderr)] per rank."""
    code = "from tests.test_preempt import child; child()"
    port, procs = free_port(), []
    for r in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if world > 1:
            env |= {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, "-c", code, sig, str(step), str(rank), "--config", TINY, *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            out.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    return out


def _lines(text: str) -> list[str]:
    return text.strip().splitlines()


@pytest.mark.spawn
def test_train_py_exits_0_on_sigterm_and_an_empty_list_keeps_the_default(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"--run.dir={run_dir}", "--train.steps=4"]
    [(code, out, err)] = launch(1, args, "SIGTERM", 2, rank=0)
    assert code == 0, err
    assert _lines(out)[-1] == LINE.format(2) and "Traceback" not in err
    assert _saved(run_dir) == ["step_00000002"]
    [(code, out, err)] = launch(1, args)  # the same command
    assert code == 0, err
    assert [r["step"] for r in _logged(run_dir)] == [1, 2, 3, 4]
    assert _lines(out)[-1].startswith("done: step 4/4")

    other = tmp_path / "default"
    [(code, out, err)] = launch(1, [f"--run.dir={other}", "--checkpoint.signals="], "SIGTERM", 2, 0)
    assert code == -signal.SIGTERM  # "": SIGTERM ends the process as it always did
    assert not os.path.exists(other / "checkpoints")


@pytest.mark.spawn
def test_two_ranks_stop_together_when_one_is_signalled(tmp_path):
    """pp=2: rank 1 alone gets SIGTERM after step 2; both stop after step 2 (none waits in a
    pipeline transfer the other skipped), one checkpoint, exit 0; the same command resumes
    bit for bit against an uninterrupted two-rank run."""
    common = ["--parallel.pp=2", "--parallel.microbatches=2", "--train.steps=4",
              "--model.dropout=0.1", "--parallel.timeout_s=60"]  # fmt: skip
    split = tmp_path / "split"
    ranks = launch(2, [*common, f"--run.dir={split}"], "SIGTERM", 2, rank=1)
    assert [code for code, _, _ in ranks] == [0, 0], [err for _, _, err in ranks]
    assert _lines(ranks[0][1])[-1] == LINE.format(2)  # rank 0 says it, once
    assert "run the same command" not in ranks[1][1]
    assert _saved(split) == ["step_00000002"]
    assert [r["step"] for r in _logged(split)] == [1, 2]
    ranks = launch(2, [*common, f"--run.dir={split}"])  # the same command
    assert [code for code, _, _ in ranks] == [0, 0], [err for _, _, err in ranks]
    full = tmp_path / "full"
    ranks = launch(2, [*common, f"--run.dir={full}"])
    assert [code for code, _, _ in ranks] == [0, 0], [err for _, _, err in ranks]
    assert [r["step"] for r in _logged(split)] == [1, 2, 3, 4]
    assert _losses(_logged(split)) == _losses(_logged(full))
