"""tools/schedule.py and benchmarks/bench.py run as a user would run them (subprocess)."""

import json
import subprocess
import sys
from pathlib import Path

from megapipe.plan.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, tool=("tools/schedule.py",)):
    done = subprocess.run(
        [sys.executable, *tool, *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done


def test_grid_printout():
    done = cli("--schedule", "1f1b", "--pp", "2", "--microbatches", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split() == [
        "rank",
        "0:",
        "F0",
        "F1",
        "BW0",
        "F2",
        "BW1",
        "BW2",
    ]


def test_json_summary_has_contract_keys():
    done = cli(
        "--schedule",
        "zb_h1",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--cost",
        "F=1,B=1.2,W=0.8,comm=0",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {
        "makespan",
        "bubble_fraction",
        "idle",
        "peak_inflight_microbatches",
        "peak_memory",
        "span",
        "bubble_rate_paper",
    }
    assert out["idle"] == [4.2] * 4  # (p−1)(F+B−W)
    assert len(out["peak_inflight_microbatches"]) == 4


def test_plot_writes_png(tmp_path):
    target = tmp_path / "t.png"
    done = cli(
        "--schedule",
        "interleaved_1f1b",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--vpp",
        "2",
        "--plot",
        str(target),
    )
    assert done.returncode == 0, done.stderr
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_table_and_stacked_plot(tmp_path):
    target = tmp_path / "cmp.png"
    done = cli(
        "--compare",
        "1f1b,zb_h1,zb_v,seq1f1b",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--seq-segments",
        "2",
        "--plot",
        str(target),
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["1f1b", "zb_h1", "zb_v", "seq1f1b"]
    assert target.stat().st_size > 10_000
    as_json = json.loads(
        cli("--compare", "1f1b,zb_v", "--pp", "4", "--microbatches", "8", "--json").stdout
    )
    assert as_json["zb_v"]["makespan"] < as_json["1f1b"]["makespan"]


def test_compare_shows_the_v_shape_blocks_beside_1f1b():
    """Qi et al. 2024 at p = 6: V-Min a third of 1F1B's activations, V-Half a half, ZB-V all."""
    done = cli("--compare", "1f1b,v_min,v_half,zb_v", "--pp", "6", "--microbatches", "12", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    peak = {name: max(row["peak_inflight_microbatches"]) for name, row in rows.items()}
    assert peak == {"1f1b": 6, "v_min": 3, "v_half": 4, "zb_v": 6}
    rate = {name: row["bubble_rate_paper"] for name, row in rows.items()}
    assert rate["zb_v"] < rate["v_half"] <= rate["v_min"] < rate["1f1b"]


def test_csv_round_trip(tmp_path):
    path = tmp_path / "zbv.csv"
    first = cli(
        "--schedule",
        "zb_v",
        "--pp",
        "4",
        "--microbatches",
        "6",
        "--vpp",
        "2",
        "--to-csv",
        str(path),
        "--json",
    )
    assert first.returncode == 0, first.stderr
    header = "rank,index,kind,microbatch,chunk,segment,version,pair"
    assert path.read_text().splitlines()[0] == header
    again = cli("--from-csv", str(path), "--placement", "v", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)
    wrong = cli("--from-csv", str(path), "--placement", "loop", "--json")
    assert wrong.returncode != 0  # a V order run on loop placement waits on itself
    assert wrong.stderr.startswith("error: deadlock: no rank can progress (rank 0 at B0.c1")


def test_compare_shows_dualpipe_v_and_csv_keeps_its_pairs(tmp_path):
    done = cli("--compare", "1f1b,zb_v,dualpipe_v", "--pp", "4", "--microbatches", "8", "--json")
    as_json = json.loads(done.stdout)
    assert as_json["dualpipe_v"]["makespan"] < as_json["1f1b"]["makespan"]
    path = tmp_path / "dpv.csv"
    args = ("--pp", "4", "--microbatches", "8", "--cost", "F=1,B=1,W=1,FB=2.5", "--json")
    first = cli("--schedule", "dualpipe_v", "--vpp", "2", "--to-csv", str(path), *args)
    assert first.returncode == 0, first.stderr
    assert ",1\n" in path.read_text()  # paired forwards
    again = cli("--from-csv", str(path), "--placement", "v", *args[4:])
    assert json.loads(again.stdout) == json.loads(first.stdout)  # pairs priced as F&B again


def test_bad_arguments_give_one_line_error():
    done = cli("--schedule", "zb_v", "--pp", "4", "--microbatches", "8")
    assert done.returncode != 0
    assert done.stderr.strip() == "error: zb_v needs exactly 2 chunks per rank (vpp=2), got vpp=1"


def test_bench_schedules_runs():
    done = cli("schedules", "--proofs", tool=("-m", "benchmarks.bench"))
    assert done.returncode == 0, done.stderr
    assert "zb_h1 idle per rank" in done.stdout


def test_summary_has_a_row_per_schedule_with_its_memory_and_messages():
    """docs/pipeline-schedules.md's table: every registered schedule, the V placements'
    messages twice 1F1B's, dualpipe's parameters twice."""
    done = cli("schedules", "--summary", tool=("-m", "benchmarks.bench"))
    assert done.returncode == 0, done.stderr
    rows = {
        line.split("|")[1].strip(" `"): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in done.stdout.strip().splitlines()[2:]
    }
    assert set(rows) == set(SCHEDULES)
    assert rows["1f1b"][3] == "6" and rows["zb_v"][3] == "12" and rows["v_min"][3] == "12"
    assert rows["dualpipe"][4] == "2×" and rows["1f1b"][4] == "1×"
    assert float(rows["v_min"][2]) < float(rows["v_half"][2]) < float(rows["1f1b"][2])
