"""DualPipe and DualPipeV (DeepSeek-V3 §3.2.1): the bidirectional placement, torch's DualPipeV
order, F&B pairs, and DeepSeek-V3 Table 2 in simulation."""

import pytest

from megapipe.plan.actions import Action, Placement
from megapipe.plan.schedules import build_schedule, placement
from megapipe.plan.simulate import Costs, simulate
from megapipe.plan.validate import ScheduleError, validate

TORCH_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}  # torch "B" is the full backward


def torch_dualpipe_v(pp: int, m: int) -> dict[int, list[Action]]:
    """torch.distributed.pipelining's ScheduleDualPipeV order as our Actions, its overlapped
    OVERLAP_F_B(F, B) as a paired F then the B. The class wants real stages and a process
    group in __init__, so its per-rank calculation runs on a bare instance."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    bare = ScheduleDualPipeV.__new__(ScheduleDualPipeV)
    bare.pp_group_size, bare._n_microbatches = pp, m
    vee = Placement(pp, 2, "v")
    order = {}
    for rank in range(pp):
        actions = []
        for op in bare._calculate_single_rank_operations(rank):
            subs = op.sub_actions or (op,)
            for i, sub in enumerate(subs):
                chunk = vee.locate(sub.stage_index)[1]
                kind = TORCH_KINDS[sub.computation_type.value]
                actions.append(Action(kind, sub.microbatch_index, chunk, pair=len(subs) > 1 > i))
        order[rank] = actions
    return order


def test_dualpipe_v_is_torchs_order_with_its_pairs():
    for pp in (1, 2, 3, 4, 5, 8):
        for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 3):
            ours = build_schedule("dualpipe_v", pp, m, 2)
            assert ours == torch_dualpipe_v(pp, m), (pp, m)
            assert any(a.pair for acts in ours.values() for a in acts)
            validate(ours, pp, m, 2, 1, placement("dualpipe_v", pp, 2))


def test_dualpipe_v_needs_two_microbatches_per_rank():  # the config's: test_parity_pp
    with pytest.raises(ValueError, match=r"dualpipe_v needs microbatches >= 2\*pp = 8, got 7"):
        build_schedule("dualpipe_v", 4, 7, 2)


def test_pair_marks_round_trip_and_are_checked():
    assert str(Action("F", 3, 1, pair=True)) == "F3.c1&"
    assert Action.parse("F3.c1&") == Action("F", 3, 1, pair=True)
    vee = Placement(1, 2, "v")
    good = [Action("F", 0), Action("F", 0, 1), Action("F", 1, pair=True), Action("BW", 0, 1)]
    rest = [Action("BW", 0), Action("F", 1, 1), Action("BW", 1, 1), Action("BW", 1)]
    validate({0: good + rest}, 1, 2, 2, 1, vee)
    bad = [Action("F", 0), Action("F", 0, 1, pair=True), Action("F", 1), *good[3:], *rest]
    with pytest.raises(ScheduleError, match="paired but not a forward before a B or BW"):
        validate({0: bad}, 1, 2, 2, 1, vee)


def test_a_pair_starts_as_one_unit_and_fb_prices_it():
    """The pair's F waits for its backward's input (the walk); F&B = F + BW changes nothing,
    a smaller F&B takes the hidden time off every pair."""
    pp, m, comm = 4, 12, 0.3
    schedule = build_schedule("dualpipe_v", pp, m, 2)
    vee = placement("dualpipe_v", pp, 2)
    plain = Costs(F=2, B=2, W=2, comm=comm)
    base = simulate(schedule, plain, vee)
    same = simulate(schedule, Costs(F=2, B=2, W=2, FB=6, comm=comm), vee)
    assert same.timeline == base.timeline
    pairs = sum(a.pair for acts in schedule.values() for a in acts)
    faster = simulate(schedule, Costs(F=2, B=2, W=2, FB=5, comm=comm), vee)
    assert sum(faster.busy) == pytest.approx(sum(base.busy) - 0.5 * pairs)
    assert faster.makespan < base.makespan
    ends = {}
    for rank, a, start, end in base.timeline:
        ends[rank, a] = (start, end)
    for rank, acts in schedule.items():  # the paired B starts right after its F: no wait
        for a, b in zip(acts, acts[1:]):
            if a.pair:
                assert ends[rank, b][0] == pytest.approx(ends[rank, a][1])


@pytest.mark.parametrize("x", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_deepseek_v3_table_2(x, overlap):
    """DeepSeek-V3 Table 2 (F, B full backward, W per chunk; F&B an overlapped pair), with the
    bubble as the longest idle time of a device: 1F1B (PP−1)(F+B), ZB1P (PP−1)(F+B−2W) on PP
    devices, and DualPipeV, the cut-in-half DualPipe on PP/2 devices of two chunks each (the
    DualPipe README's row): (PP/2−1)(F&B+B−3W), activations PP+1 chunks, parameters one
    stage per chunk. Equal F, B, W (the table's closed forms assume no other ratio)."""
    F, W, B = x, x, 2 * x  # a chunk: forward, weight-grad part, full backward
    fb = F + B - overlap * W  # F&B: a pair hiding up to a W of communication
    for PP in (4, 8, 16):
        one_f, zb1p = (simulate(build_schedule(n, PP, 2 * PP), Costs(F=F, B=x, W=W),
                                Placement(PP)) for n in ("1f1b", "zb_h1"))  # fmt: skip
        assert max(one_f.idle) == pytest.approx((PP - 1) * (F + B))
        assert max(zb1p.idle) == pytest.approx((PP - 1) * (F + B - 2 * W))
        pp = PP // 2
        dual_v = simulate(
            build_schedule("dualpipe_v", pp, 3 * pp, 2),
            Costs(F=2 * F, B=2 * x, W=2 * W, FB=2 * fb),  # Costs: a rank's two chunks
            placement("dualpipe_v", pp, 2),
        )
        assert max(dual_v.idle) == pytest.approx((PP / 2 - 1) * (fb + B - 3 * W))
        assert max(dual_v.peak_inflight) * 2 == PP + 1


def test_dual_placement_holds_every_stage_twice():
    """DualPipe's parameters 2×: rank r holds stage r (down) and stage pp−1−r (up) of a
    pp-stage model; each stage lives on two ranks, and a microbatch's direction picks its copy."""
    for pp in (2, 4, 8):
        dual = placement("dualpipe", pp, 2)
        assert dual.num_stages == pp
        held = [[dual.stage(r, c) for c in (0, 1)] for r in range(pp)]
        assert held == [[r, pp - 1 - r] for r in range(pp)]
        for s in range(pp):
            assert sum(row.count(s) for row in held) == 2
            assert dual.locate(s, 0) == (s, 0) and dual.locate(s, 1) == (pp - 1 - s, 1)
    with pytest.raises(ValueError, match="even pp and an even microbatches"):
        build_schedule("dualpipe", 4, 9, 2)
    with pytest.raises(ValueError, match="even pp"):
        build_schedule("dualpipe", 3, 6, 2)


def test_dualpipe_feeds_both_ends_and_its_halves_mirror():
    pp, m = 6, 16
    s = build_schedule("dualpipe", pp, m, 2)
    validate(s, pp, m, 2, 1, placement("dualpipe", pp, 2))
    firsts = {r: [a.microbatch for a in s[r] if a.kind == "F"][:1] for r in (0, pp - 1)}
    assert firsts == {0: [0], pp - 1: [1]}  # even microbatches enter at rank 0, odd at pp−1
    for r in range(pp):  # rank pp−1−r: rank r's order, each microbatch the other way
        flip = [a._replace(microbatch=a.microbatch ^ 1, chunk=1 - a.chunk) for a in s[r]]
        assert s[pp - 1 - r] == flip


@pytest.mark.parametrize("x", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_deepseek_v3_table_2_dualpipe(x, overlap):
    """Table 2's DualPipe row on PP devices, two stages each (a microbatch runs one of them per
    device, so Costs are a stage's, as 1F1B's): bubble (PP/2−1)(F&B+B−3W), activations PP+1
    stages' worth, equal F, B, W as in test_deepseek_v3_table_2."""
    F, W, B = x, x, 2 * x
    fb = F + B - overlap * W
    for PP in (4, 8, 16):
        schedule = build_schedule("dualpipe", PP, 2 * PP, 2)
        pairs = sum(a.pair for acts in schedule.values() for a in acts)
        dual = simulate(
            schedule,
            Costs(F=F, B=x, W=W, FB=fb),
            placement("dualpipe", PP, 2),
        )
        assert max(dual.idle) == pytest.approx((PP / 2 - 1) * (fb + B - 3 * W))
        assert max(dual.peak_inflight) == PP + 1
        one_f = simulate(build_schedule("1f1b", PP, 2 * PP), Costs(F=F, B=x, W=W), Placement(PP))
        assert dual.makespan < one_f.makespan  # the same work, less the hidden F&B overlap:
        assert sum(dual.busy) == pytest.approx(sum(one_f.busy) - overlap * W * pairs)


def test_dualpipe_partitions_the_model_into_pp_stages(tmp_path):
    """Each stage held twice: pp stages, not pp·vpp (4 here: E | t | t | L fits 2 layers)."""
    from megapipe.config.pipeline_split import partition, rank_blocks
    from tests.parity import tiny_config

    for balance in ("uniform", "cost"):
        cfg = tiny_config(["parallel.pp=4", "parallel.vpp=2", "parallel.schedule=dualpipe",
                           "parallel.microbatches=8", f"parallel.balance={balance}"],
                          str(tmp_path))  # fmt: skip
        stages = partition(cfg)
        assert len(stages) == 4
        assert [rank_blocks(cfg, r) for r in range(4)] == [
            [stages[r], stages[3 - r]] for r in range(4)
        ]
