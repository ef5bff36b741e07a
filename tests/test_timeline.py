"""Measured timelines (megapipe/pipeline/timeline.py, tools/plot_timeline.py): Chrome traces,
measured makespan and bubble, profiled costs that reproduce a step in the simulator."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.pipeline import timeline
from megapipe.plan.schedules import build_schedule, placement
from megapipe.plan.simulate import Costs, simulate

ROOT = Path(__file__).resolve().parents[1]


def simulated_spans(
    name: str, pp: int, m: int, vpp: int, costs: Costs, wait: float = 0.0, origin: float = 100.0
) -> list:
    """A step as the runtime would record it if it ran exactly as simulated: each rank's
    spans in order, every action starting `wait` early (waiting for its input)."""
    sim = simulate(build_schedule(name, pp, m, vpp), costs, placement(name, pp, vpp))
    per_rank = [[] for _ in range(pp)]
    for rank, action, start, end in sorted(sim.timeline, key=lambda t: t[2]):
        w = wait if start >= wait else 0.0
        per_rank[rank].append((str(action), origin + start - w, origin + end, w))
    return per_rank


def test_chrome_trace_has_one_x_event_per_action_named_like_the_schedule():
    per_rank = simulated_spans("zb_v", 2, 4, 2, Costs(F=2, B=2, W=2), wait=0.25)
    trace = json.loads(json.dumps(timeline.chrome_trace(per_rank, "zb_v", {"vpp": 2})))
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "wait"]
    for rank in range(2):
        names = [e["name"] for e in sorted(actions, key=lambda e: e["ts"]) if e["pid"] == rank]
        assert names == [str(a) for a in build_schedule("zb_v", 2, 4, 2)[rank]]
    assert {"F1.c1", "B0", "W3.c1"} <= {e["name"] for e in actions}
    assert {e["cat"] for e in actions} == {"F", "B", "W"}
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == 0.0  # µs from start
    first = next(e for e in actions if e["name"] == "F0" and e["pid"] == 1)
    assert first["dur"] == pytest.approx(1e6)  # F=2 over 2 chunks: 1 s = 1e6 µs
    waits = [e for e in trace["traceEvents"] if e["name"] == "wait"]
    assert waits and all(e["dur"] == pytest.approx(0.25e6) for e in waits)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [m["args"]["name"] for m in meta] == ["zb_v rank 0", "zb_v rank 1"]
    assert trace["otherData"] == {"vpp": 2}
    back = timeline.spans_from_trace(trace)  # the round trip keeps actions, spans and waits
    for got, want in zip(back, per_rank):
        assert [s[0] for s in got] == [s[0] for s in want]
        for (_, a0, a1, aw), (_, b0, b1, bw) in zip(got, want):
            assert (a0 + 100, a1 + 100, aw) == pytest.approx((b0, b1, bw))


@pytest.mark.parametrize(
    "name,vpp", [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zb_v", 2)]
)
def test_profiled_costs_reproduce_a_step_that_ran_as_simulated(name, vpp):
    costs = Costs(F=1.0, B=1.5, W=0.5, BW=2.0)
    per_rank = simulated_spans(name, 2, 4, vpp, costs, wait=0.1)
    profiled = timeline.profile_costs([per_rank], vpp)
    sim = simulate(build_schedule(name, 2, 4, vpp), profiled, placement(name, 2, vpp))
    got = timeline.measured(per_rank)
    want = simulate(build_schedule(name, 2, 4, vpp), costs, placement(name, 2, vpp))
    assert got["makespan"] == pytest.approx(want.makespan)
    assert sim.makespan == pytest.approx(want.makespan)
    assert got["busy"] == pytest.approx(want.busy)  # waits are idle, not busy
    assert got["bubble_fraction"] == pytest.approx(want.bubble_fraction)


def test_to_timeline_starts_at_the_first_action_and_leaves_out_waits():
    per_rank = [[("F0", 10.0, 11.0, 0.0)], [("F0", 10.5, 12.0, 0.5)]]
    assert [(r, str(a), s, e) for r, a, s, e in timeline.to_timeline(per_rank)] == [
        (0, "F0", 0.0, 1.0),
        (1, "F0", 1.0, 2.0),
    ]
    assert timeline.measured(per_rank)["bubble_fraction"] == pytest.approx(1 - 2.0 / 4.0)


@pytest.mark.spawn
def test_plot_timeline_records_a_real_two_rank_step_then_redraws_its_trace(tmp_path):
    png, trace = tmp_path / "zb_v.png", tmp_path / "zb_v.json"
    common = [sys.executable, str(ROOT / "tools" / "plot_timeline.py")]
    run = [
        *common,
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--model",
        "--schedule",
        "zb_v",
        "--vpp",
        "2",
        "--microbatches",
        "4",
        "--steps",
        "1",
        "--png",
        str(png),
        "--trace",
        str(trace),
    ]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["measured_ms"] > 0 and 0 <= figures["measured_bubble"] < 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    actions = [e for e in events if e["ph"] == "X" and e["name"] != "wait"]
    for rank in range(2):
        ran = [e["name"] for e in sorted(actions, key=lambda e: e["ts"]) if e["pid"] == rank]
        assert ran == [str(a) for a in build_schedule("zb_v", 2, 4, 2)[rank]]
    again = tmp_path / "again.png"
    out = subprocess.run(
        [*common, "--from-trace", str(trace), "--png", str(again)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["measured_ms"] == pytest.approx(figures["measured_ms"])
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
