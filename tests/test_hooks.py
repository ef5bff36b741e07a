"""The loop's and the step core's hooks (train/hooks.py) and `log.profile` (train/profile.py):
an observer sees every point in order without patching anything; the profile train.py writes
has the shape megapipe/study/results.py reads. One process; the pipelined profile and trace
are checked by tests/test_scaling_study.py's local study (pp=2 over two agents)."""

from __future__ import annotations

import json
import os

import pytest

from megapipe.config import ConfigError, load_config
from megapipe.study.results import _profile
from megapipe.train import loop
from megapipe.train.hooks import TrainHooks
from tests.conftest import TINY


class Seen(TrainHooks):
    """Every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def step_begin(self, step):
        self.calls.append(("step_begin", step))

    def forward_backward_begin(self, step):
        self.calls.append(("fb_begin", step))

    def forward_backward_end(self, step, events):
        self.calls.append(("fb_end", step, len(events)))

    def optimizer_begin(self):
        self.calls.append(("opt_begin",))

    def optimizer_end(self):
        self.calls.append(("opt_end",))

    def step_end(self, step, result, seconds):
        assert seconds > 0 and result.final
        self.calls.append(("step_end", step))

    def evaluated(self, step, losses):
        self.calls.append(("evaluated", step, sorted(losses)))

    def train_end(self, job, records):
        self.calls.append(("train_end", len(records)))


def test_hooks_see_steps_optimizer_evaluation_and_the_end_in_order(tiny_cfg):
    seen = Seen()
    records = loop.run(tiny_cfg("train.steps=2", "train.eval_interval=2"), seen)
    one = [("step_begin",), ("fb_begin",), ("fb_end", 0), ("opt_begin",), ("opt_end",),
           ("step_end",)]  # fmt: skip
    steps = [(c[0], s, *c[1:]) if "opt" not in c[0] else c for s in (0, 1) for c in one]
    assert seen.calls == [*steps, ("evaluated", 2, ["val_loss"]), ("train_end", 2)]
    assert len(records) == 2 and "val_loss" in records[-1]


def test_log_profile_writes_the_study_profile_and_leaves_training_alone(tiny_cfg, tmp_path):
    plain = loop.run(tiny_cfg("train.steps=3"))
    assert not os.path.exists(tmp_path / "run" / "study_profile.json")  # default: off
    cfg = tiny_cfg("train.steps=3", f"run.dir={tmp_path / 'profiled'}", "log.profile=true")
    profiled = loop.run(cfg)
    assert [r["loss"] for r in profiled] == [r["loss"] for r in plain]
    path = tmp_path / "profiled" / "study_profile.json"
    (rank,) = json.loads(path.read_text())["ranks"]
    assert [s["step"] for s in rank["steps"]] == [1, 2, 3]
    for s in rank["steps"]:
        assert list(s) == ["step", "opt", "fb", "opt_inside"]  # pp=1: no pipeline events
        assert s["fb"] > 0 and s["opt"] > 0 and s["opt_inside"] is False
    assert rank["memory_kind"] == "max RSS" and rank["peak_memory_bytes"] > 0
    assert not (tmp_path / "profiled" / "trace.json").exists()  # pp=1: no timeline
    row = _profile(path, 1, {r["step"]: 0.5 for r in profiled})  # what the study report reads
    assert row["compute_s"] > 0 and row["bubble_s"] == 0.0 and row["trace"] is False


def test_log_profile_is_a_bool_key():
    assert load_config(TINY).log.profile is False
    assert load_config(TINY, ["log.profile=true"]).log.profile is True
    with pytest.raises(ConfigError, match="log.profile") as err:
        load_config(TINY, ["log.profile=maybe"])
    assert "\n" not in str(err.value)
