"""Loss spikes (train/spikes.py): a spiky step is skipped and logged with its rows, alike on every
mesh; a resume between spikes continues bit for bit; a rollback reloads the newest checkpoint
and then trains as a run that never saw the offending batches.

The spikes are made by the data: the dataset is documents that count modulo 7 (tokens 3..9),
which the tiny model learns within a few steps at train.lr=2e-2 (loss ~2.0, from 4.6); the
batches of the data steps in BAD are replaced by uniformly random tokens (loss ~5), by a
MemmapData subclass that the test puts in place of the loop's data, so its rows are still those
`tools/inspect_data.py` shows for that data step. SHIFT moves the data steps from a given step
on, to build a reference that never reads the skipped batches."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from megapipe.cli import inspect_data
from megapipe.config import ConfigError, load_config
from megapipe.data import loader
from megapipe.train import checkpoint
from megapipe.train import loop as loop_module
from megapipe.train.spikes import NonFiniteError
from tests.conftest import TINY
from tests.dataset_files import write_dataset
from tests.util import assert_rel_close

PERIOD = 7
SPIKY = ["train.spike_factor=1.5", "train.spike_window=4", "train.lr=2e-2", "train.steps=16"]
BAD = (9, 12)  # data steps 9 and 12: train steps 10 and 13 (1-based, as metrics.jsonl counts)


def write_counting_dataset(out: Path) -> Path:
    rng = np.random.default_rng(0)
    starts, sizes = rng.integers(0, PERIOD, 200), rng.integers(40, 120, 200)
    docs = [(np.arange(s, s + n) % PERIOD) + 3 for s, n in zip(starts, sizes)]
    return write_dataset(out, {"train": docs, "val": docs[:20]}, vocab_size=96)


class SpikyData(loader.MemmapData):
    """The dataset's batches, but random tokens for the data steps in `bad`, and data step
    s + shift[1] read for s >= shift[0]."""

    bad: tuple[int, ...] = ()
    shift: tuple[int, int] = (0, 0)

    def rows(self, step, size, split, picked):
        if split == "train" and step >= self.shift[0]:
            step += self.shift[1]
        out = super().rows(step, size, split, picked)
        if split == "train" and step in self.bad:
            whole = np.random.default_rng(step).integers(3, 96, (size, out.shape[1]))
            out = whole[picked.start : picked.stop]  # a dp rank's rows of the same batch
        return out


@contextlib.contextmanager
def spiky(bad=BAD, shift=(0, 0)):
    """Within: the loop trains on SpikyData (test-only: the product reads the dataset)."""
    real = loop_module.build_data

    def build(*args, **kwargs):
        data = real(*args, **kwargs)
        data.__class__ = type("Spiky", (SpikyData,), {"bad": tuple(bad), "shift": shift})
        return data

    loop_module.build_data = build
    try:
        yield
    finally:
        loop_module.build_data = real


def config(root: str, *overrides: str, run: str = "run"):
    return load_config(
        TINY,
        [f"run.dir={root}/{run}", "data.source=memmap", f"data.path={root}/data", *SPIKY,
         *overrides],
    )  # fmt: skip


def spikes_log(run_dir) -> list[dict]:
    path = Path(run_dir) / "spikes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_records(records: list[dict]) -> dict[int, dict]:
    """Each step's last record (a rollback logs the steps after its checkpoint again)."""
    return {r["step"]: r for r in records}


def final_weights(run_dir) -> dict:
    _, model = checkpoint.load_for_inference(str(run_dir))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def root(tmp_path) -> str:
    write_counting_dataset(tmp_path / "data")
    return str(tmp_path)


def test_spiky_steps_are_skipped_and_logged_with_their_rows(root, capsys):
    with spiky():
        records = train.run(config(root))
    spikes = [r["step"] for r in records if r.get("spike")]
    assert spikes == [10, 13]
    assert [r["step"] for r in records if r["skipped"]] == spikes
    assert all(r["loss"] < 2.5 for r in records[8:] if not r["skipped"])
    logged = spikes_log(f"{root}/run")
    assert [(e["step"], e["data_step"]) for e in logged] == [(10, 9), (13, 12)]
    for e in logged:
        assert e["loss"] > e["limit"] == pytest.approx(1.5 * e["median"])
        capsys.readouterr()
        args = ["--config", TINY, "--data.source=memmap", f"--data.path={root}/data"]
        assert inspect_data.main([*args, "--steps", str(e["data_step"]), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["step"] == e["data_step"] and e["rows"] == shown["rows"]
    metrics = [json.loads(line) for line in open(f"{root}/run/metrics.jsonl")]
    assert [m["step"] for m in metrics if m.get("spike")] == spikes
    stop = config(root, "train.max_skipped=2", run="stop")
    with spiky(bad=(9, 10)), pytest.raises(NonFiniteError, match=r"^step 11 had a loss spike "):
        train.run(stop)  # spikes count toward train.max_skipped (in a row)


def run_case(root: str, overrides: list[str], bad, run: str) -> dict:
    """One run on every rank of the pool (or one process): its records and spikes.jsonl."""
    with spiky(bad):
        records = train.run(config(root, *overrides, run=run))
    return {"records": records, "log": spikes_log(f"{root}/{run}")}


ROLLBACK = ["train.spike_rollback=2", "checkpoint.interval=8"]
MESHES = {
    "dp2": ["parallel.dp=2"],
    "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"],
    "pp2": ["parallel.pp=2", "parallel.microbatches=2"],
}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_spikes_and_rollbacks_are_decided_alike_under_every_mesh(gloo_pool, root, name):
    for extra in ([], ROLLBACK):
        ref = run_case(root, extra, BAD, f"ref{len(extra)}")
        run = f"{name}{len(extra)}"
        results = gloo_pool(2).run(run_case, root, [*extra, *MESHES[name]], BAD, run)
        assert sum(r.get("spike", False) for r in ref["records"]) == 2
        for got in results:
            assert [(r["step"], r["skipped"], r.get("spike")) for r in got["records"]] == [
                (r["step"], r["skipped"], r.get("spike")) for r in ref["records"]
            ], name
            assert_rel_close(
                torch.tensor([r["loss"] for r in got["records"]]),
                torch.tensor([r["loss"] for r in ref["records"]]),
                name=f"{name} loss",
            )
            strip = [{k: v for k, v in e.items() if k not in ("loss", "median", "limit",
                      "checkpoint")} for e in got["log"]]  # fmt: skip
            assert strip == [{k: v for k, v in e.items() if k not in ("loss", "median", "limit",
                             "checkpoint")} for e in ref["log"]]  # fmt: skip


def test_a_resume_between_spikes_continues_bit_for_bit(root):
    with spiky():
        full = train.run(config(root, "checkpoint.interval=11", run="full"))
        first = train.run(config(root, "checkpoint.interval=11", "train.stop_at_step=11"))
        second = train.run(config(root, "checkpoint.interval=11"))
    assert [r["step"] for r in full if r.get("spike")] == [10, 13]
    assert [r["step"] for r in second if r.get("spike")] == [13], "the window was saved"
    assert [r["loss"] for r in first + second] == [r["loss"] for r in full]
    assert spikes_log(f"{root}/run") == spikes_log(f"{root}/full")
    a, b = final_weights(f"{root}/full"), final_weights(f"{root}/run")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("saving", ["checkpoint.async_save=false", "checkpoint.async_save=true"])
def test_a_rollback_trains_as_a_run_that_never_saw_the_offending_batches(root, saving):
    with spiky():
        rolled = train.run(config(root, *ROLLBACK, saving))
    log = spikes_log(f"{root}/run")
    assert [e["step"] for e in log] == [10, 13, 13]
    assert log[2]["rollback_to"] == 8 and log[2]["skipped_data_steps"] == [8, 12]
    # the reference: no spike check, no bad batch, data steps 8..12 never read
    with spiky(bad=(), shift=(8, 5)):
        ref = train.run(config(root, "checkpoint.interval=8", "train.spike_factor=0", run="ref"))
    got = last_records(rolled)
    assert [got[s]["loss"] for s in range(1, 17)] == [r["loss"] for r in ref]
    assert all(got[s].get("rollbacks") == 1 for s in range(9, 17))
    a, b = final_weights(f"{root}/run"), final_weights(f"{root}/ref")
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = Path(checkpoint.step_dir(f"{root}/run/checkpoints", 16), "train_state.json")
    assert json.loads(saved.read_text())["spikes"]["offset"] == 5


@pytest.mark.parametrize("stop_at", [13, 14])
def test_a_run_stopped_at_or_after_its_rollback_resumes_bit_for_bit(root, stop_at):
    """13: the rollback's step stops the run, which saves the checkpoint step it went back to
    (with the new data offset); 14: a later stop saves the offset with step 14."""
    with spiky():
        full = train.run(config(root, *ROLLBACK, run="full"))
        first = train.run(config(root, *ROLLBACK, f"train.stop_at_step={stop_at}"))
        second = train.run(config(root, *ROLLBACK))
    saved = {13: 8, 14: 14}[stop_at]
    assert first[-1]["step"] == stop_at and second[0]["step"] == saved + 1
    got, want = last_records(first + second), last_records(full)
    assert [got[s]["loss"] for s in range(1, 17)] == [want[s]["loss"] for s in range(1, 17)]
    a, b = final_weights(f"{root}/full"), final_weights(f"{root}/run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollback_before_the_first_checkpoint_goes_on_without_one(root):
    with spiky():
        records = train.run(config(root, "train.spike_rollback=2", "checkpoint.interval=13"))
    assert [r["step"] for r in records] == list(range(1, 17))
    assert [r["step"] for r in records if r["skipped"]] == [10, 13]
    assert checkpoint.complete_checkpoints(f"{root}/run/checkpoints")[0].endswith("step_00000013")
    assert spikes_log(f"{root}/run")[2] == {
        "step": 13,
        "rollback_to": None,
        "note": "no checkpoint saved yet",
    }


def test_rollbacks_to_one_checkpoint_past_max_skipped_stop_the_run(root):
    cfg = config(root, "train.spike_rollback=1", "checkpoint.interval=8", "train.max_skipped=1")
    with spiky(bad=(9, 11)), pytest.raises(NonFiniteError) as err:
        train.run(cfg)  # data step 9 spikes, rollback; data step 11 spikes at the same step
    where = checkpoint.step_dir(f"{root}/run/checkpoints", 8)
    assert str(err.value) == (
        f"step 10: loss spikes would roll back to {where} again (2 rollbacks to it, "
        "train.max_skipped=1); lower train.lr, raise train.spike_factor or check the batches in "
        "run.dir/spikes.jsonl"
    )
    assert [e.get("rollback_to") for e in spikes_log(f"{root}/run")] == [None, 8, None]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.spike_factor=0.5"], "train.spike_factor=0.5 must be 0 (off) or > 1"),
        (["train.spike_rollback=2"], "train.spike_rollback=2 counts loss spikes, but train.spi"),
        (
            ["train.spike_factor=3", "parallel.pp=2", "parallel.post_validation=true"],
            "train.spike_factor with parallel.post_validation=true: the optimizer steps",
        ),
        (
            [
                "train.spike_factor=3",
                "parallel.pp=2",
                "parallel.schedule=pipedream_async",
                "model.tie_embeddings=false",
            ],
            "train.spike_factor with parallel.schedule=pipedream_async",
        ),  # fmt: skip
        (
            ["train.spike_factor=3", "train.spike_rollback=2"],
            "train.spike_rollback=2 reloads the newest checkpoint, but checkpoint.interval=0",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
