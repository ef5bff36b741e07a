"""`log.tensorboard`: every numeric field of every metrics.jsonl record is one TensorBoard scalar
at the record's step, read back with TensorBoard's own reader; a resumed run and a rollback leave
one scalar a step; without the key no event file is written (train/sinks.py)."""

import os

import numpy as np
from tensorboard.backend.event_processing import event_accumulator

import train
from megapipe.train.metrics import read_metrics
from megapipe.train.sinks import TensorBoardSink
from tests.test_spikes import ROLLBACK, config, spiky, write_counting_dataset


def scalars_read(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar under `log_dir`, by tag, as TensorBoard shows them: its
    EventAccumulator, all points kept (size guidance 0), orphaned points purged (its default;
    a tag whose points were all purged is left out)."""
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    points = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return {tag: p for tag, p in points.items() if p}


def expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each numeric field's (step, value) over the records, booleans as 0/1."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                out.setdefault(key, []).append((record["step"], float(value)))
    return out


def assert_same(got: dict, want: dict) -> None:
    """The same tags, the same steps in order (one point each), values equal as float32 (the
    event files' simple_value)."""
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        values = np.array([v for _, v in points], dtype=np.float32)
        np.testing.assert_array_equal(np.array([v for _, v in got[tag]]), values, err_msg=tag)


def test_every_numeric_field_of_every_record_is_one_scalar_at_its_step(tiny_cfg):
    cfg = tiny_cfg(
        "log.tensorboard=true", "log.interval=2", "train.steps=5", "train.eval_interval=3",
        "log.peak_tflops=1.0",
    )  # fmt: skip
    train.run(cfg)
    records = read_metrics(os.path.join(cfg.run.dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 3, 4, 5]  # every 2nd, the evaluations, the end
    want = expected(records)
    named = {"loss", "val_loss", "lr", "grad_norm", "skipped", "tokens_per_s", "mfu", "tflops",
             "consumed_tokens", "peak_memory_gib"}  # fmt: skip
    assert named <= set(want)
    memory = [v for _, v in want["peak_memory_gib"]]
    assert memory[0] > 0 and memory == sorted(memory)  # the run's peak so far
    assert [s for s, _ in want["val_loss"]] == [3, 5]
    assert_same(scalars_read(os.path.join(cfg.run.dir, "tensorboard")), want)


def test_a_resumed_run_leaves_one_scalar_a_step(tiny_cfg):
    """The first run logs steps 1-6; the second resumes from step 3's checkpoint and logs 4-6
    again (other tokens/s): TensorBoard shows the second run's points only, once each."""
    run = tiny_cfg("log.tensorboard=true", "train.steps=6", "checkpoint.interval=3")
    train.run(run)
    first = read_metrics(os.path.join(run.run.dir, "metrics.jsonl"))
    step_3 = os.path.join(run.run.dir, "checkpoints", "step_00000003")
    train.run(tiny_cfg(
        "log.tensorboard=true", "train.steps=6", "checkpoint.interval=3",
        f"checkpoint.resume={step_3}",
    ))  # fmt: skip
    records = read_metrics(os.path.join(run.run.dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[3]["resumed_from"] == 3 and records[3] != first[3]
    assert_same(scalars_read(os.path.join(run.run.dir, "tensorboard")), expected(records))


def test_a_rollback_leaves_one_scalar_a_step(tmp_path):
    """A loss-spike rollback (tests/test_spikes.py's run: spikes at steps 10 and 13, back to
    step 8) logs steps 9-13 again within the run: TensorBoard shows their second records."""
    write_counting_dataset(tmp_path / "data")
    with spiky():
        logged = train.run(config(str(tmp_path), *ROLLBACK, "log.tensorboard=true"))
    assert [r["step"] for r in logged] == [*range(1, 14), *range(9, 17)]
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert "spike" in logged[9] and not any("spike" in r for r in records)
    assert_same(scalars_read(str(tmp_path / "run" / "tensorboard")), expected(records))


def test_a_step_logged_again_replaces_its_points(tmp_path):
    """The sink alone: a step at or before the last one logged hides the earlier points."""
    sink = TensorBoardSink(str(tmp_path), start_step=0)
    for step, loss in [(1, 9.0), (2, 8.0), (3, 7.0), (2, 6.5), (3, 5.5), (4, 4.5)]:
        sink.write({"step": step, "loss": loss, "moe_load": [[1, 2]], "mfu": None, "tag": "x"})
    sink.close()
    assert scalars_read(str(tmp_path)) == {"loss": [(1, 9.0), (2, 6.5), (3, 5.5), (4, 4.5)]}


def test_no_event_files_without_the_key(tiny_cfg):
    cfg = tiny_cfg("train.steps=1")
    train.run(cfg)
    assert os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(cfg.run.dir, "tensorboard"))
