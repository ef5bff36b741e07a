"""The simulator reproduces the papers' closed forms; all schedules simulate without deadlock."""

import pytest

from megapipe.plan.actions import Action, Placement
from megapipe.plan.schedules import SCHEDULES, build_schedule, placement
from megapipe.plan.seq1f1b import balanced_segments
from megapipe.plan.simulate import Costs, action_cost, multi_iteration, simulate
from megapipe.plan.validate import ScheduleError
from megapipe.plan.walk import walk

UNIT = Costs(F=1, B=1, W=1)  # full backward BW = B + W = 2
SHAPES = [(pp, m) for pp in (2, 3, 4, 6, 8) for m in (pp, pp + 1, 2 * pp, 3 * pp + 2)]


def run(name, pp, m, vpp=1, k=1, costs=UNIT, **opts):
    schedule = build_schedule(name, pp, m, vpp, k, **opts)
    return simulate(schedule, costs, placement(name, pp, vpp))


def close(a, b):
    return a == pytest.approx(b, abs=1e-9)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream_async"])
def test_flush_bubble_is_p_minus_1_over_m_plus_p_minus_1(name):
    for pp, m in SHAPES:
        result = run(name, pp, m)
        assert close(result.bubble_fraction, (pp - 1) / (m + pp - 1)), (pp, m)
        assert close(result.makespan, 3 * (m + pp - 1))


def test_peak_inflight_gpipe_m_and_1f1b_p_minus_r():
    for pp, m in SHAPES:
        assert run("gpipe", pp, m).peak_inflight == [m] * pp
        assert run("1f1b", pp, m).peak_inflight == [pp - r for r in range(pp)]
    assert run("1f1b", 4, 2).peak_inflight == [2, 2, 2, 1]  # m < p: capped by m


def test_interleaved_bubble_megatron_closed_form():
    for pp in (2, 3, 4, 8):
        for vpp in (2, 3, 4):
            for m in (pp, 2 * pp, 4 * pp):
                overhead = (pp - 1) / vpp
                result = run("interleaved_1f1b", pp, m, vpp)
                assert close(result.bubble_fraction, overhead / (m + overhead)), (pp, m, vpp)


def test_interleaved_any_microbatch_count_beats_1f1b():
    for pp, m in [(4, 5), (4, 7), (4, 10), (8, 12), (3, 2)]:
        assert run("interleaved_1f1b", pp, m, 2).makespan < run("1f1b", pp, m).makespan


@pytest.mark.parametrize("costs", [UNIT, Costs(F=1, B=1.2, W=0.8), Costs(F=1, B=1.5, W=0.5)])
def test_zb_h1_idle_is_p_minus_1_times_f_plus_b_minus_w(costs):
    # Zero Bubble (Qi et al. 2023) §3.1: ZB-H1 bubble (p−1)(T_F + T_B − T_W), 1F1B memory.
    for pp, m in SHAPES:
        result = run("zb_h1", pp, m, costs=costs)
        expected = (pp - 1) * (costs.F + costs.B - costs.W)
        assert all(close(idle, expected) for idle in result.idle), (pp, m, result.idle)
        if m >= pp:
            assert result.peak_inflight == [pp] * pp  # pp−r−1 warm-up + 1 + r delayed W's
        assert max(result.peak_inflight) <= pp


@pytest.mark.parametrize("costs", [UNIT, Costs(F=1, B=1.2, W=0.8), Costs(F=1, B=1.5, W=0.5)])
def test_zb_h2_no_worse_than_zb_h1_within_2p_minus_1(costs):
    for pp, m in SHAPES:
        h1, h2 = run("zb_h1", pp, m, costs=costs), run("zb_h2", pp, m, costs=costs)
        assert h2.makespan <= h1.makespan + 1e-9, (pp, m)
        assert max(h2.peak_inflight) <= 2 * pp - 1
        # no single-chunk schedule beats m(F+B+W) + (p−1)F: the last rank cannot start earlier
        assert h2.makespan >= m * (costs.F + costs.B + costs.W) + (pp - 1) * costs.F - 1e-9
    # ZB-H2 reaches that bound when W is not too cheap (its extra warm-up fills the bubble)
    assert close(run("zb_h2", 4, 8, costs=Costs(F=1, B=1.2, W=0.8)).makespan, 24 + 3)


def test_zb_v_no_worse_than_zb_h1_at_1f1b_memory():
    for pp, m in SHAPES:
        v, h1 = run("zb_v", pp, m, 2), run("zb_h1", pp, m)
        assert v.makespan <= h1.makespan, (pp, m)
        assert max(v.peak_inflight) <= pp  # 2p chunk activations of 1/2 each = 1F1B's peak


@pytest.mark.parametrize(
    "costs",
    [
        Costs(F=1, B=1.5, W=0.5),
        Costs(F=1, B=1.07, W=0.73),
        Costs(F=1, B=2, W=1),
        Costs(F=1, B=0.8, W=1.2),
        Costs(F=(1.0, 1.1), B=(1.2, 1.3), W=(0.7, 0.8), comm=0.05),
    ],
)
def test_zb_v_built_for_the_costs_is_valid_and_no_slower_at_1f1b_memory(costs):
    """Zero Bubble §3.2 schedules with profiled costs: built for `costs`, ZB-V is a valid
    schedule at 1F1B memory and no slower under those costs than the unit-time build."""
    from megapipe.plan.validate import validate

    for pp, m in SHAPES:
        schedule = build_schedule("zb_v", pp, m, 2, costs=costs)
        validate(schedule, pp, m, 2, 1, placement("zb_v", pp, 2))
        tuned = simulate(schedule, costs, placement("zb_v", pp, 2))
        assert tuned.makespan <= run("zb_v", pp, m, 2, costs=costs).makespan + 1e-9, (pp, m)
        assert max(tuned.peak_inflight) <= pp


def test_zb_v_built_for_costs_closes_the_bubble_that_b_greater_than_w_opens():
    costs = Costs(F=1, B=1.5, W=0.5)
    unit_built = run("zb_v", 2, 8, 2, costs=costs)
    tuned = simulate(build_schedule("zb_v", 2, 8, 2, costs=costs), costs, placement("zb_v", 2, 2))
    assert unit_built.bubble_fraction > 0.2 and tuned.bubble_fraction < 0.04
    assert build_schedule("zb_v", 4, 8, 2, costs=UNIT) == build_schedule("zb_v", 4, 8, 2)


def test_seq1f1b_less_bubble_and_about_1_over_k_memory():
    for pp, m in SHAPES:
        base = run("1f1b", pp, m)
        for k in (2, 4):
            result = run("seq1f1b", pp, m, k=k)
            assert result.bubble_fraction < base.bubble_fraction
            # equal segments: 1F1B over m·k units of 1/k the cost
            assert close(result.bubble_fraction, (pp - 1) / (m * k + pp - 1))
            # peak = (p − r + k − 1)/k: 1F1B's (p − r) divided by k, plus (k−1)/k for the
            # segments of one microbatch the last stage needs before its first backward
            expected = [(min(pp - r, m) + k - 1) / k for r in range(pp)] if m >= pp else None
            if expected:
                assert result.peak_inflight == pytest.approx(expected)
            assert max(result.peak_inflight) <= max(base.peak_inflight) / k + 1


def test_seq1f1b_with_flop_balanced_segments():
    split = balanced_segments(2048, 4, params=3.5e8, layers=24, d_model=1024)
    schedule = build_schedule("seq1f1b", 4, 8, seq_segments=4)
    result = simulate(
        schedule, UNIT, Placement(4), list(split.flop_shares), list(split.token_shares)
    )
    assert result.makespan < run("1f1b", 4, 8).makespan
    assert max(result.peak_inflight) < 4 / 2


def test_unequal_chunk_costs_and_stage_extras():
    schedule = build_schedule("1f1b", 2, 1)
    costs = Costs(F=1, B=1, W=1, comm=0.5, first_stage=0.25, last_stage=1)
    result = simulate(schedule, costs, Placement(2))
    # F0 [0,1.25] -> comm -> F0 [1.75,3.75] BW0 [3.75,6.75] -> comm -> BW0 [7.25,9.5]
    assert close(result.makespan, 9.5)
    per_chunk = simulate(
        build_schedule("interleaved_1f1b", 1, 1, 2),
        Costs(F=(1, 3), B=(1, 1), W=(0, 0)),
        Placement(1, 2),
    )
    assert close(per_chunk.makespan, 1 + 3 + 1 + 1)


def test_every_schedule_simulates_without_deadlock():
    names = [
        ("gpipe", 1, 1),
        ("1f1b", 1, 1),
        ("interleaved_1f1b", 2, 1),
        ("interleaved_1f1b", 3, 1),
        ("zb_h1", 1, 1),
        ("zb_h2", 1, 1),
        ("zb_v", 2, 1),
        ("seq1f1b", 1, 3),
        ("pipedream_async", 1, 1),
    ]
    for pp in range(1, 9):
        for m in range(1, 2 * pp + 3):
            for name, vpp, k in names:
                result = run(name, pp, m, vpp, k, costs=Costs(F=1, B=1.3, W=0.7, comm=0.1))
                busy = sum(result.busy)
                assert close(busy, m * pp * 3.0)
                assert 0 <= result.bubble_fraction < 1
                assert len(result.timeline) == sum(
                    len(a) for a in build_schedule(name, pp, m, vpp, k).values()
                )


def test_simulator_reports_deadlock():
    f0, f1, b0, b1 = Action("F", 0), Action("F", 1), Action("BW", 0), Action("BW", 1)
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 0 at BW0, rank 1 at F1"):
        simulate({0: [f0, b0, f1, b1], 1: [f1, b1, f0, b0]}, UNIT, Placement(2))


def test_costs_parse():
    costs = Costs.parse("F=1,B=1.2,W=0.8,comm=0.1,last=0.5")
    assert (costs.F, costs.B, costs.W, costs.comm, costs.last_stage) == (1, 1.2, 0.8, 0.1, 0.5)
    with pytest.raises(ValueError, match="unknown cost key"):
        Costs.parse("X=1")


def walked(schedule, costs, place, flop_shares, start):
    """(rank, action, start, end) timed directly on walk.py's walk, without dag.py: each action
    starts when its rank is free and its inputs have arrived (+ comm from another rank)."""
    free, out = dict(start), []

    def run(rank, a, stage, needs, finished):
        arrive = [finished[e][0] + (costs.comm if finished[e][1] != rank else 0.0) for e in needs]
        ready = max([free[rank], *arrive])
        free[rank] = ready + action_cost(a, stage, costs, place, flop_shares)
        out.append((rank, a, ready, free[rank]))
        return free[rank], rank

    walk(schedule, place, run)
    return sorted(out, key=lambda item: (item[2], item[0]))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_compiled_dag_times_what_the_walk_times(name):
    """simulate times the schedule's compiled DAG (dag.py, which perf/model.py prices too): the
    same floats as timing each action as the walk runs it, with start offsets and shares."""
    spec = SCHEDULES[name]
    vpp, k = (1 if spec.chunks == (1, 1) else 2), (3 if spec.segmented else 1)
    costs = Costs(F=1.0, B=1.3, W=0.6, BW=None if spec.split_backward else 2.1, comm=0.15,
                  first_stage=0.2, last_stage=0.45)  # fmt: skip
    for pp, m in [(1, 3), (3, 6), (4, 8)]:  # m >= 2·pp: dualpipe_v
        if spec.microbatch_problem(pp, m):  # dualpipe: even pp and m
            continue
        schedule = build_schedule(name, pp, m, vpp, k)
        place = placement(name, pp, vpp)
        shares = [0.5, 0.3, 0.2][:k] if k > 1 else [1.0]
        start = {r: 0.25 * r for r in range(pp)}
        got = simulate(schedule, costs, place, shares, start=start)
        assert got.timeline == walked(schedule, costs, place, shares, start)
        first = multi_iteration(schedule, costs, place, 3, True, 0.5, 0.2).steps[0]
        equal = [1.0 / k] * k
        assert first.timeline == walked(
            schedule, costs, place, equal, dict.fromkeys(range(pp), 0.0)
        )
