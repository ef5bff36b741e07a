"""V-Min, V-Half and ZB-V as the building-block family of Qi et al. 2024 ("Pipeline Parallelism
with Controllable Memory"): the lifespan bound on memory, the paper's closed forms for peak
activation memory and bubble at T_F = T_B = T_W, and its communication, checked in simulation."""

import pytest

from megapipe.plan.actions import Placement
from megapipe.plan.controllable_memory import (
    _blocks,
    _least_bubble,
    half_memory,
    min_memory,
    v_block,
    v_half,
    v_min,
)
from megapipe.plan.messages import sent
from megapipe.plan.schedules import build_schedule, placement
from megapipe.plan.simulate import Costs, simulate
from megapipe.plan.validate import validate

UNIT = Costs()
UNEVEN = [
    Costs(F=1, B=2, W=1),
    Costs(F=1, B=1.5, W=0.5),
    Costs(F=1.3, B=2.2, W=1.7, comm=0.2),
    Costs(first_stage=0.25, last_stage=0.5),  # rank 0 embeds and runs the head: the busiest
]


def _sim(name, pp, m, costs=UNIT):
    opts = {"costs": costs} if name != "1f1b" else {}
    vpp = 1 if name == "1f1b" else 2
    schedule = build_schedule(name, pp, m, vpp, **opts)
    validate(schedule, pp, m, vpp, 1, placement(name, pp, vpp))
    return simulate(schedule, costs, placement(name, pp, vpp))


@pytest.mark.parametrize("pp", range(2, 9))
def test_peak_memory_is_the_papers_closed_form(pp):
    """V-Min holds (p+4)//3 microbatches of activations (at p = 2 a block needs only 1.5),
    V-Half at most (p+2)//2 (1F1B: p)."""
    for m in (2 * pp, 4 * pp):
        assert max(_sim("v_min", pp, m).peak_inflight) == (min_memory(pp) if pp > 2 else 1.5), m
        assert max(_sim("v_half", pp, m).peak_inflight) <= half_memory(pp), m
        assert max(_sim("1f1b", pp, m).peak_inflight) == pp
    if pp >= 4:  # about a third, a half: below 1F1B's p
        assert min_memory(pp) <= half_memory(pp) < pp


@pytest.mark.parametrize("pp", range(2, 9))
def test_bubble_rate_is_within_the_papers_closed_form(pp):
    """Bubble rate (Zero Bubble's per-rank measure) ≈ 2p/(3m) for V-Min, p/(2m) for V-Half
    (the paper's table at T_F = T_B = T_W); 1F1B's is ≈ p/m. Allowed: 10% over the ≈."""
    for m in (pp, 2 * pp, 4 * pp, 8 * pp):
        vmin, vhalf = _sim("v_min", pp, m), _sim("v_half", pp, m)
        assert vmin.bubble_rate_paper <= 1.1 * 2 * pp / (3 * m), m
        assert vhalf.bubble_rate_paper <= 1.1 * pp / (2 * m), m
        assert vhalf.bubble_rate_paper <= vmin.bubble_rate_paper + 1e-9


@pytest.mark.parametrize("costs", [Costs(), *UNEVEN], ids=str)
def test_lifespan_bounds_every_blocks_memory_and_the_steady_state_is_dense(costs):
    """A rank holds at most Σ_c ceil(l_c / T) chunk activations, whatever the offsets, and
    exactly the most alive at once in the repeated order once m is large; with F = B = W no two
    passes of a rank collide modulo T, so every added microbatch costs T."""
    for pp in (2, 3, 5):
        where = Placement(pp, 2, "v")
        for block, _ in _blocks(pp, costs)[::7]:
            m = 3 * pp
            validate(block.repeat(m), pp, m, 2, 1, where)
            result = simulate(block.repeat(m), costs, where)
            for got, exact, bound in zip(
                result.peak_inflight, block.memory(), block.lifespan_bound()
            ):
                assert got == pytest.approx(exact) and exact <= bound
            if costs == Costs():
                longer = simulate(block.repeat(m + 1), costs, where)
                assert longer.makespan == pytest.approx(result.makespan + block.interval)


def test_offsets_trade_memory_for_bubble():
    """Larger offsets lengthen lifespans: the tightest block needs less memory than a loose one."""
    tight, loose = v_block(6, Costs(), (0,) * 5), v_block(6, Costs(), (2, 2, 2, 2, 4))
    assert max(tight.memory()) < max(loose.memory())
    assert tight.lifespan(0) < loose.lifespan(0)


@pytest.mark.parametrize("costs", UNEVEN, ids=str)
def test_built_for_uneven_costs_valid_and_within_1f1b_memory(costs):
    """With unequal F, B, W the closed forms no longer hold exactly; the schedules stay valid,
    below 1F1B's memory from p = 4 and the V-Half bubble no worse than V-Min's."""
    for pp in (2, 3, 4, 6):
        for m in (1, pp, 3 * pp):
            vmin, vhalf = _sim("v_min", pp, m, costs), _sim("v_half", pp, m, costs)
            if pp >= 4 and m >= pp:
                assert max(vmin.peak_inflight) < pp
            assert max(vhalf.peak_inflight) <= max(max(vmin.peak_inflight), half_memory(pp))


def test_zb_v_is_the_zero_bubble_member_at_1f1b_memory():
    """V-ZB: 1F1B's memory p and no bubble in the steady state (each added microbatch costs
    exactly F+B+W), below V-Half's and V-Min's; its list-scheduled order (zb_v) ends no later
    than the best repeated block at the same memory, which keeps warm-up and cool-down gaps."""
    for pp in (2, 4, 6, 8):
        block = _least_bubble(pp, UNIT, pp)
        for m in (pp, 4 * pp):
            zb, repeated = (
                _sim("zb_v", pp, m),
                simulate(block.repeat(m), UNIT, placement("zb_v", pp, 2)),
            )
            assert max(zb.peak_inflight) == max(repeated.peak_inflight) == pp
            assert zb.makespan <= repeated.makespan
        steady = _sim("zb_v", pp, 4 * pp).makespan - _sim("zb_v", pp, 2 * pp).makespan
        assert steady == pytest.approx(2 * pp * 3)  # F+B+W = 3 per microbatch
    for pp, m in ((4, 16), (6, 24), (8, 32)):
        zb, half, vmin = _sim("zb_v", pp, m), _sim("v_half", pp, m), _sim("v_min", pp, m)
        assert zb.bubble_rate_paper < 0.5 * half.bubble_rate_paper
        assert max(vmin.peak_inflight) <= max(half.peak_inflight) <= max(zb.peak_inflight)


def test_v_shape_communication_is_twice_1f1b():
    """Each microbatch crosses 2p−1 stage boundaries each way, p−1 ... 0 ... p−1 between ranks
    and the turn on rank p−1 locally: 4(p−1) p2p messages, 1F1B's 2(p−1) twice."""
    for name in ("v_min", "v_half"):
        for pp, m in ((2, 4), (4, 8)):
            where = placement(name, pp, 2)
            count = 0
            for rank, actions in build_schedule(name, pp, m, 2).items():
                for a in actions:
                    msg = sent(a, where.stage(rank, a.chunk), where.num_stages - 1)
                    count += msg is not None and where.locate(msg.dest_stage())[0] != rank
            assert count == 4 * (pp - 1) * m


def test_unit_cost_build_is_the_default_and_costs_change_it():
    assert v_min(4, 8) == v_min(4, 8, Costs())
    assert v_half(4, 8, Costs(F=1, B=2, W=1)) != v_half(4, 8)
