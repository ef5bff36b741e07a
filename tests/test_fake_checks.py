"""Jobs checked before they start (megapipe/train/fake_checks.py): `tools/scaling_study.py run`
and `tools/launch.py --check` run each job's edge ranks on fake tensors first; a job whose
build raises is reported in one line and not queued, a good one is queued. A build that fails
is planted by replacing fake_ranks' `parallelize` for the dp2 worlds only."""

from __future__ import annotations

import yaml

from megapipe.cli import launch as launch_tool
from megapipe.study import load_study
from megapipe.study.runner import Entry, run_points
from megapipe.train import fake_ranks
from megapipe.train.fake_checks import check_edges
from tests.conftest import ROOT, TINY

BROKEN = "stage 1 has no blocks\nsecond line of the traceback's message"


def _broken_at_dp2(monkeypatch) -> None:
    real = fake_ranks.parallelize

    def build(cfg, mesh, device):
        if cfg.parallel.dp == 2:
            raise RuntimeError(BROKEN)
        return real(cfg, mesh, device)

    monkeypatch.setattr(fake_ranks, "parallelize", build)


def test_study_queues_the_points_that_pass_and_reports_the_one_that_fails(tmp_path, monkeypatch):
    _broken_at_dp2(monkeypatch)
    study = {"name": "t", "base": TINY, "kind": "strong", "steps": 2, "warmup": 1,
             "cluster": "cpu", "timeout_s": 60,
             "launcher": {"kind": "command", "template": "echo queued {nodes}"},
             "points": [{"nodes": 1, "devices_per_node": 1, "mesh": {"dp": 1}, "name": "good"},
                        {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2},
                         "name": "bad"}]}  # fmt: skip
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    out.mkdir()
    run_points(load_study(str(path)), out, Entry(ROOT, "train.py"), check=check_edges)
    good = yaml.safe_load((out / "points" / "good" / "point.json").read_text())
    bad = yaml.safe_load((out / "points" / "bad" / "point.json").read_text())
    assert good["status"] == "pending" and good["error"] is None  # queued: its command ran
    assert (out / "points" / "good" / "command.log").read_text() == "queued 1\n"
    assert bad["status"] == "failed" and not (out / "points" / "bad" / "command.txt").exists()
    assert bad["error"] == (
        "check: rank 0 (pp=0 dp=0 cp=0 tp=0) of 2 fails: RuntimeError: stage 1 has no blocks"
    )


def test_launch_check_starts_nothing_when_a_rank_fails(monkeypatch, capsys):
    _broken_at_dp2(monkeypatch)
    started = []
    monkeypatch.setattr(
        launch_tool, "run_torchrun", lambda cmd, stops: started.append(cmd) or (0, "")
    )
    base = ["--check", "--nproc-per-node", "2", "train.py", "--config", TINY]
    assert launch_tool.main([*base, "--parallel.dp=2"]) == 2
    err = capsys.readouterr().err
    assert err == "error: check: rank 0 (pp=0 dp=0 cp=0 tp=0) of 2 fails: RuntimeError: " \
                  "stage 1 has no blocks\n" and started == []  # fmt: skip
    assert launch_tool.main([*base, "--parallel.tp=2"]) == 0  # the good job starts
    assert len(started) == 1 and started[0][-1] == "--parallel.tp=2"
