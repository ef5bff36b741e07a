"""tools/scaling_study.py and megapipe/study: a small local study end to end (its numbers from
the runs' own metrics, a failing point recorded while the rest reports, two torchrun agents on
localhost training the one-process model), the slurm scripts of a 2-node point without a
cluster, and the study file's one-line errors."""

import csv
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import train
from megapipe.config import load_config
from megapipe.study import StudyError, load_study
from megapipe.study.launchers import command_text
from megapipe.study.report import write_report
from megapipe.study.runner import Entry, collect, run_points
from tests.conftest import ROOT, TINY

ENTRY = Entry(Path(ROOT), str(Path(ROOT) / "train.py"))  # as tools/scaling_study.py runs it

STEPS, WARMUP = 3, 1


def write_study(path: Path, points, launcher=None, kind="strong", projected=None) -> Path:
    study = {
        "name": "t",
        "base": TINY,
        "overrides": {"log.progress": False},
        "kind": kind,
        "steps": STEPS,
        "warmup": WARMUP,
        "cluster": "cpu",
        "launcher": launcher or {"kind": "local"},
        "timeout_s": 300,
        "points": points,
    }
    if projected:
        study["projected"] = projected
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- the local study, run once for the tests below ----------------------------------------------

LOCAL_POINTS = [
    {"nodes": 1, "devices_per_node": 1, "mesh": {"dp": 1}, "name": "one"},
    {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2}, "name": "dp2"},
    # two torchrun agents on localhost, c10d rendezvous, standing in for two nodes
    {"nodes": 2, "devices_per_node": 2, "mesh": {"dp": 2, "pp": 2, "microbatches": 2},
     "name": "two-nodes"},
    {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2, "pp": 2}, "name": "bad-mesh"},
]  # fmt: skip


@pytest.fixture(scope="module")
def local_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    path = write_study(tmp / "study.yaml", LOCAL_POINTS,
                       projected=[{"nodes": 4, "devices_per_node": 2, "name": "beyond",
                                   "mesh": {"dp": 4, "pp": 2, "microbatches": 1}}])  # fmt: skip
    out = tmp / "out"
    # --no-check: the edge-rank check before the points start is tested in test_fake_checks.py
    done = subprocess.run([sys.executable, "tools/scaling_study.py", "run", str(path), "--out",
                           str(out), "--no-check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    with open(out / "results.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    return done, out, rows


@pytest.mark.spawn
@pytest.mark.slow
def test_local_study_writes_csv_json_plots_and_report(local_study):
    done, out, rows = local_study
    assert done.returncode == 0, done.stderr[-3000:]
    assert [rows[n]["status"] for n in ("one", "dp2", "two-nodes")] == ["ok"] * 3
    for name in ("scaling.png", "efficiency.png", "breakdown.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    for name in ("one", "dp2", "two-nodes", "beyond", "bad-mesh"):
        assert f"| {name} |" in report
    assert "![throughput](scaling.png)" in report
    first = rows["one"]
    assert float(first["efficiency"]) == pytest.approx(1.0)
    for name in ("one", "dp2", "two-nodes"):
        r = rows[name]
        assert int(r["measured_steps"]) == STEPS - WARMUP
        assert float(r["proj_step_s"]) > 0 and r["proj_error"] != ""
        assert float(r["compute_s"]) > 0 and float(r["peak_memory_gib"]) > 0
    assert float(rows["two-nodes"]["bubble_s"]) > 0  # pp=2: the pipeline's idle time is seen
    assert rows["one"]["bubble_s"] == "0.0"  # pp=1 has no pipeline
    trace = json.loads((out / "points" / "two-nodes" / "run" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2, 3}  # every rank's last step
    assert not (out / "points" / "one" / "run" / "trace.json").exists()
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["rows"]] == [p["name"] for p in LOCAL_POINTS] + ["beyond"]


@pytest.mark.spawn
@pytest.mark.slow
def test_local_study_numbers_come_from_metrics_jsonl(local_study):
    _, out, rows = local_study
    row = rows["dp2"]
    metrics = out / "points" / "dp2" / "run" / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    tokens = int(row["tokens_per_step"])
    assert tokens == load_config(TINY).derived.tokens_per_step
    steps = [tokens / r["tokens_per_s"] for r in records if r["step"] > WARMUP]
    assert float(row["step_s"]) == pytest.approx(statistics.median(steps), rel=1e-9)
    assert float(row["tokens_per_s"]) == pytest.approx(tokens / statistics.median(steps))
    tflops = statistics.median(r["tflops"] for r in records if r["step"] > WARMUP)
    assert float(row["tflops_per_device"]) == pytest.approx(tflops, rel=1e-9)


@pytest.mark.spawn
@pytest.mark.slow
def test_failing_point_is_recorded_and_the_study_goes_on(local_study):
    done, out, rows = local_study
    bad = rows["bad-mesh"]
    assert bad["status"] == "failed" and "\n" not in bad["error"]
    assert "dp·pp·cp·tp = 2·2·1·1 = 4 != 1 nodes × 2 devices = 2" in bad["error"]
    assert "bad-mesh: failed: mesh dp·pp·cp·tp" in done.stdout
    assert not (out / "points" / "bad-mesh" / "run").exists()  # nothing was started
    assert "## Failed points" in (out / "report.md").read_text()
    assert rows["beyond"]["status"] == "projected" and rows["beyond"]["step_s"] == ""
    assert float(rows["beyond"]["proj_step_s"]) > 0


@pytest.mark.spawn
@pytest.mark.slow
def test_two_torchrun_agents_dp_pp_train_the_one_process_model(local_study):
    """The 2-node point (two agents on localhost, c10d, dp=2 × pp=2) and one process: the same
    global batch (a strong study), so the same losses (docs/architecture.md, parity)."""
    _, out, _ = local_study
    one = losses(out / "points" / "one" / "run")
    two = losses(out / "points" / "two-nodes" / "run")
    command = (out / "points" / "two-nodes" / "command.txt").read_text().splitlines()
    assert len(command) == 2 and all("--nnodes=2" in c and "--rdzv-backend=c10d" in c
                                     for c in command)  # fmt: skip
    assert len(one) == STEPS and two == pytest.approx(one, rel=1e-5)


# -- without processes ---------------------------------------------------------------------------


def sbatch_train_args(script: str) -> list[str]:
    """The training command's arguments from the script's srun line (continuations joined)."""
    text = script.replace("\\\n", " ")
    (line,) = [x for x in text.splitlines() if x.startswith("srun ")]
    args = shlex.split(line)
    return args[next(i for i, a in enumerate(args) if a.endswith("/train.py")) + 1 :]


def test_slurm_script_of_a_two_node_point(tmp_path):
    launcher = {"kind": "slurm", "partition": "gpu", "time": "00:10:00", "port": 29400,
                "env": {"NCCL_DEBUG": "WARN"}, "setup": ["source .venv/bin/activate"]}  # fmt: skip
    path = write_study(tmp_path / "s.yaml", [
        {"nodes": 2, "devices_per_node": 4, "mesh": {"dp": 2, "pp": 2, "tp": 2}, "name": "p"}],
        launcher)  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    run_points(load_study(str(path)), out, ENTRY, dry_run=True)
    script = (out / "points" / "p" / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=00:10:00",
                 f"#SBATCH --output={out}/points/p/slurm-%j.out",
                 'FIRST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "PORT=29400", "export NCCL_DEBUG=WARN", "source .venv/bin/activate"):  # fmt: skip
        assert line in script.splitlines() or line in script, line
    srun = script.replace("\\\n", " ")
    for flag in ("--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=$HEAD:$PORT", "--rdzv-id=$SLURM_JOB_ID"):  # fmt: skip
        assert flag in srun, flag
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # the train command parses as train.py's and gives the point's config
    args, overrides = train.parse_args(sbatch_train_args(script))
    assert args.config == TINY
    cfg = load_config(args.config, overrides)
    assert cfg.log.profile  # the run writes the profile the report reads
    p = cfg.parallel
    assert (p.dp, p.pp, p.tp, cfg.derived.world_size) == (2, 2, 2, 8)
    assert cfg.train.steps == STEPS and cfg.run.dir == str(out / "points" / "p" / "run")
    record = json.loads((out / "points" / "p" / "point.json").read_text())
    assert record["status"] == "written" and record["job_id"] is None


@pytest.mark.parametrize("devices", ["cpu", "gpu", "gres"])
def test_slurm_script_requests_gpus_only_for_gpu_devices(tmp_path, devices):
    launcher = {"kind": "slurm", "devices": "cpu" if devices == "cpu" else "gpu"}
    if devices == "gres":
        launcher["gpu_request"] = "--gres=gpu:h100:{devices_per_node}"
    path = write_study(tmp_path / "s.yaml", [
        {"nodes": 2, "devices_per_node": 2, "mesh": {"dp": 2, "pp": 2}, "name": "p"}],
        launcher)  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    run_points(load_study(str(path)), out, ENTRY, dry_run=True)
    lines = (out / "points" / "p" / "job.sbatch").read_text().splitlines()
    requests = [x for x in lines if x.startswith("#SBATCH --g")]
    expected = {"cpu": [], "gpu": ["#SBATCH --gpus-per-node=2"],
                "gres": ["#SBATCH --gres=gpu:h100:2"]}  # fmt: skip
    assert requests == expected[devices]
    assert ("export CUDA_VISIBLE_DEVICES=''" in lines) == (devices == "cpu")  # gloo
    assert ("export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in lines) == (devices != "cpu")
    launcher["devices"] = "tpu"
    with pytest.raises(StudyError, match="launcher.devices"):
        load_study(str(write_study(tmp_path / "bad.yaml", [
            {"nodes": 1, "devices_per_node": 1, "mesh": {"dp": 1}}], launcher)))  # fmt: skip


def test_dry_run_report_shows_projections_only(tmp_path):
    path = write_study(tmp_path / "s.yaml", [
        {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2}, "name": "a"},
        {"nodes": 2, "devices_per_node": 2, "mesh": {"dp": 4}, "name": "b"}],
        {"kind": "slurm"}, kind="weak")  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    run_points(load_study(str(path)), out, ENTRY, dry_run=True)
    write_report(out)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r.get("step_s") for r in rows] == [None, None]
    assert [r["global_batch"] for r in rows] == [8, 16]  # weak: the batch grows with dp
    assert rows[1]["proj_efficiency"] == pytest.approx(
        rows[1]["proj_tokens_per_s"] / 4 / (rows[0]["proj_tokens_per_s"] / 2)
    )
    report = (out / "report.md").read_text()
    assert "written; projected" in report and " * |" in report


def test_command_launcher_fills_the_template(tmp_path):
    launcher = {"kind": "command", "template": "echo {nodes} {devices_per_node} {script_args}"}
    path = write_study(tmp_path / "s.yaml", [
        {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2}, "name": "a"}], launcher)  # fmt: skip
    study = load_study(str(path))
    text = command_text(study, study.points[0], "/d", "/d/run", "py", "x.py")
    assert text.startswith("echo 1 2 x.py --config ") and text.endswith(" --log.profile=true")
    assert "--parallel.dp=2" in text and "--run.dir=/d/run" in text
    study.launcher["template"] = "run {gpus}"
    with pytest.raises(StudyError, match=r"unknown placeholder 'gpus'; use \{nodes\}"):
        command_text(study, study.points[0], "/d", "/d/run", "py", "x.py")


@pytest.mark.parametrize("change, message", [
    ({"kind": "medium"}, "kind: must be weak or strong"),
    ({"warmup": 3}, "warmup: 3 leaves no measured step of 3"),
    ({"points": [{"nodes": 1, "devices_per_node": 1, "mesh": {"dq": 1}}]},
     "points[0].mesh: unknown key 'dq'"),
    ({"overrides": {"run.dir": "x"}}, "overrides: run.dir is set by the study"),
    ({"cluster": "tpu"}, "cluster: unknown GPU 'tpu'"),
    ({"base": "missing.yaml"}, "base: config"),
    ({"extra": 1}, "extra: unknown key"),
])  # fmt: skip
def test_study_file_errors_are_one_line(tmp_path, change, message):
    path = write_study(tmp_path / "s.yaml", [{"nodes": 1, "devices_per_node": 1,
                                             "mesh": {"dp": 1}}])  # fmt: skip
    raw = yaml.safe_load(path.read_text())
    raw.update(change)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StudyError) as err:
        load_study(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_invalid_point_keeps_its_error_and_the_others_resolve(tmp_path):
    path = write_study(tmp_path / "s.yaml", [
        {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2}},
        {"nodes": 1, "devices_per_node": 2, "mesh": {"dp": 2, "tp": 3}},
        {"nodes": 2, "devices_per_node": 2, "mesh": "auto"}], kind="weak")  # fmt: skip
    points = load_study(str(path)).points
    assert points[0].error is None and points[0].cfg.train.global_batch == 8
    assert "model.n_heads=4" in points[1].error and points[1].cfg is None
    auto = points[2]  # the planner's pick on 4 CPU ranks; weak: batch × 4/2 devices
    assert auto.error is None and auto.cfg.derived.world_size == 4
    assert auto.cfg.train.global_batch == 16 and auto.mesh.startswith("auto: dp")


def test_collect_reads_finished_and_failed_slurm_jobs(tmp_path):
    """After the jobs: a run that logged its last step is ok (its numbers in the report), a job
    whose output has train.py's error line is failed with it, the others stay pending."""
    path = write_study(tmp_path / "s.yaml", [
        {"nodes": 1, "devices_per_node": 1, "mesh": {"dp": 1}, "name": name}
        for name in ("done", "broken", "waiting")], {"kind": "slurm"})  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    run_points(load_study(str(path)), out, ENTRY, dry_run=True)
    run = out / "points" / "done" / "run"
    run.mkdir()
    tokens = load_config(TINY).derived.tokens_per_step
    seconds = [0.5, 0.25, 0.2]  # step 1 is the warm-up
    run.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "loss": 1.0, "tokens_per_s": tokens / s, "tflops": 1e-3,
                    "mfu": None}) + "\n" for i, s in enumerate(seconds)))  # fmt: skip
    (out / "points" / "broken" / "slurm-7.out").write_text(
        "starting\nerror: data.path 'x' not found; run python tools/prepare_data.py\n"
    )
    collect(out)
    write_report(out)
    status = {p.parent.name: json.loads(p.read_text()) for p in out.glob("points/*/point.json")}
    assert {k: v["status"] for k, v in status.items()} == {
        "done": "ok", "broken": "failed", "waiting": "pending"}  # fmt: skip
    assert status["broken"]["error"].startswith("data.path 'x' not found")
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["done"]["step_s"] == pytest.approx(statistics.median(seconds[WARMUP:]))
    assert rows["done"]["measured_steps"] == STEPS - WARMUP
    assert rows["waiting"].get("step_s") is None and rows["waiting"]["proj_step_s"] > 0
