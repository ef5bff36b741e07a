"""Schedule generators and the validator: every schedule is complete and cannot deadlock."""

import pytest

from megapipe.plan.actions import Action, Placement, format_grid
from megapipe.plan.schedules import SCHEDULES, SPLIT_BACKWARD, build_schedule, placement
from megapipe.plan.seq1f1b import balanced_segments, segment_flops
from megapipe.plan.validate import ScheduleError, validate

# (name, vpp values, seq_segments values, extra option sets)
GRID = [
    ("gpipe", [1], [1], [{}]),
    ("1f1b", [1], [1], [{}]),
    ("interleaved_1f1b", [2, 3], [1], [{}, {"microbatch_group": "pp+1"}]),
    ("zb_h1", [1], [1], [{}]),
    ("zb_h2", [1], [1], [{}]),
    ("zb_v", [2], [1], [{}]),
    ("v_half", [2], [1], [{}]),
    ("v_min", [2], [1], [{}]),
    ("zb_auto", [1], [1], [{}, {"memory": "2p"}]),
    ("seq1f1b", [1], [1, 2, 3], [{}]),
    ("pipedream_async", [1], [1], [{}, {"weight_sync": "vertical"}]),
    ("dualpipe_v", [2], [1], [{}]),
    ("dualpipe", [2], [1], [{}]),
]


def _cases():
    for name, vpps, ks, option_sets in GRID:
        for pp in range(1, 7):
            for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp + 1, 3 * pp} - {0}):
                if SCHEDULES[name].microbatch_problem(pp, m):  # DualPipe: m >= 2·pp
                    continue
                for vpp in vpps:
                    for k in ks:
                        for opts in option_sets:
                            opts = {
                                key: pp + 1 if val == "pp+1" else val for key, val in opts.items()
                            }
                            yield name, pp, m, vpp, k, opts


def test_every_generated_schedule_validates():
    count = 0
    for name, pp, m, vpp, k, opts in _cases():
        schedule = build_schedule(name, pp, m, vpp, k, **opts)
        validate(schedule, pp, m, vpp, k, placement(name, pp, vpp))
        kinds = {a.kind for acts in schedule.values() for a in acts}
        split = {"F", "B", "W"} | ({"BW"} if name.startswith("dualpipe") else set())  # BW in F&B
        assert kinds == (split if name in SPLIT_BACKWARD else {"F", "BW"}), name
        count += 1
    assert count > 400
    assert set(SCHEDULES) == {n for n, *_ in GRID}


def test_action_format_round_trips():
    for action in [
        Action("F", 3),
        Action("B", 3, 1),
        Action("BW", 12, 0, 2),
        Action("W", 0, 2, 1, 7),
        Action("F", 3, 0, None, 5),
    ]:
        assert Action.parse(str(action)) == action
    assert str(Action("F", 3, 1, 2, 5)) == "F3.c1s2@5"
    with pytest.raises(ValueError, match="bad action"):
        Action.parse("X3")


def test_grid_printer_shows_every_rank_in_order():
    text = format_grid(build_schedule("1f1b", 3, 4))
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].split()[2:5] == ["F0", "F1", "F2"]
    assert lines[2].split()[2:4] == ["F0", "BW0"]


def test_placements_loop_and_v():
    loop = placement("interleaved_1f1b", 4, 2)
    assert loop.stage(1, 1) == 5 and loop.locate(5) == (1, 1)
    vee = placement("zb_v", 4, 2)
    assert vee.stage(0, 1) == 7 and vee.stage(3, 1) == 4 and vee.locate(4) == (3, 1)
    for pl in (loop, vee):
        assert sorted(pl.as_dict().values()) == list(range(8))


@pytest.mark.parametrize(
    "args, message",
    [
        (("nope", 2, 2), "unknown schedule"),
        (("1f1b", 2, 0), "microbatches must be >= 1"),
        (("interleaved_1f1b", 2, 4), "needs vpp >= 2"),
        (("zb_v", 2, 4, 3), "exactly 2 chunks"),
        (("1f1b", 2, 4, 2), "one chunk per rank"),
        (("seq1f1b", 2, 4, 1, 0), "seq_segments must be >= 1"),
        (("1f1b", 2, 4, 1, 2), "needs schedule seq1f1b"),
    ],
)
def test_build_schedule_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message) as info:
        build_schedule(*args)
    assert "\n" not in str(info.value)


def test_interleaved_rejects_small_microbatch_group():
    with pytest.raises(ValueError, match="microbatch_group must be >= pp"):
        build_schedule("interleaved_1f1b", 4, 8, 2, microbatch_group=2)


def test_gpipe_forwards_follow_clock_cycles():
    schedule = build_schedule("gpipe", 3, 4)
    for rank in range(3):
        assert [a.microbatch for a in schedule[rank][:4]] == [0, 1, 2, 3]
        assert [a.microbatch for a in schedule[rank][4:]] == [3, 2, 1, 0]


def test_seq1f1b_backward_runs_segments_in_reverse():
    schedule = build_schedule("seq1f1b", 2, 2, seq_segments=3)
    backward = [(a.microbatch, a.segment) for a in schedule[0] if a.kind == "BW"]
    assert backward == [(0, 2), (0, 1), (0, 0), (1, 2), (1, 1), (1, 0)]


def test_pipedream_versions_stash_and_vertical_sync():
    stash = build_schedule("pipedream_async", 4, 8)
    vertical = build_schedule("pipedream_async", 4, 8, weight_sync="vertical")
    for rank in range(4):
        for sched in (stash, vertical):
            fwd = {a.microbatch: a.version for a in sched[rank] if a.kind == "F"}
            bwd = {a.microbatch: a.version for a in sched[rank] if a.kind == "BW"}
            assert fwd == bwd  # weight stashing: F and B of a microbatch share a version
        # vertical sync: every stage uses the version stage 0 used
        assert [a.version for a in vertical[rank] if a.kind == "F"] == [
            a.version for a in vertical[0] if a.kind == "F"
        ]
    # without vertical sync the last stage has fewer warm-up forwards, so newer weights
    assert [a.version for a in stash[3] if a.kind == "F"] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [a.version for a in stash[0] if a.kind == "F"] == [0, 0, 0, 0, 1, 2, 3, 4]


def test_balanced_segments_equalise_flops():
    split = balanced_segments(4096, 4, params=1.3e9, layers=24, d_model=2048, granularity=64)
    assert sum(split.lengths) == 4096 and all(n % 64 == 0 for n in split.lengths)
    assert list(split.lengths) == sorted(split.lengths, reverse=True)  # later = more attention
    flops = segment_flops(split.lengths, 1.3e9, 24, 2048)
    assert max(flops) / min(flops) < 1.05
    assert balanced_segments(10, 3, params=1, layers=0, d_model=1).lengths in {
        (3, 3, 4),
        (3, 4, 3),
        (4, 3, 3),
    }
    with pytest.raises(ValueError, match="multiple of 64"):
        balanced_segments(100, 2, 1, 1, 1, granularity=64)


# --- negative tests: the validator must catch broken schedules --------------------------------


def _one_f_one_b(pp=3, m=4):
    return build_schedule("1f1b", pp, m)


def test_validator_rejects_missing_action():
    schedule = _one_f_one_b()
    schedule[1].remove(Action("BW", 2))
    with pytest.raises(ScheduleError, match=r"rank 1: missing backward .* F2"):
        validate(schedule, 3, 4)


def test_validator_rejects_duplicated_action():
    schedule = _one_f_one_b()
    schedule[2].append(Action("F", 1))
    with pytest.raises(ScheduleError, match="rank 2: F1 appears 2 times"):
        validate(schedule, 3, 4)


def test_validator_rejects_weight_grad_before_input_grad():
    schedule = build_schedule("zb_h1", 2, 2)
    acts = schedule[0]
    i, j = acts.index(Action("B", 0)), acts.index(Action("W", 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="rank 0: W0 runs before B0, which it depends on"):
        validate(schedule, 2, 2)


def test_validator_rejects_chunk_dependency_on_same_rank():
    schedule = build_schedule("interleaved_1f1b", 1, 2, 2)
    acts = schedule[0]
    i, j = acts.index(Action("F", 0, 0)), acts.index(Action("F", 0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 0: F0.c1 runs before F0, which it depends on"):
        validate(schedule, 1, 2, 2, placement=Placement(1, 2))


def test_validator_rejects_deadlocking_order():
    f0, f1, b0, b1 = Action("F", 0), Action("F", 1), Action("BW", 0), Action("BW", 1)
    validate({0: [f0, f1, b0, b1], 1: [f0, b0, f1, b1]}, 2, 2)
    # rank 1 waits for F1, which rank 0 sends only after BW0, which rank 1 sends after F1
    with pytest.raises(
        ScheduleError, match=r"deadlock: no rank can progress \(rank 0 at BW0, rank 1 at F1\)"
    ):
        validate({0: [f0, b0, f1, b1], 1: [f1, b1, f0, b0]}, 2, 2)


def test_validator_rejects_mismatched_weight_version():
    schedule = build_schedule("pipedream_async", 2, 4)
    acts = schedule[1]
    idx = next(i for i, a in enumerate(acts) if a.kind == "BW" and a.microbatch == 2)
    acts[idx] = acts[idx]._replace(version=0)
    with pytest.raises(ScheduleError, match="rank 1: BW2@0 uses a different weight version"):
        validate(schedule, 2, 4)
