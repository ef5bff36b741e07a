"""Partitioning blocks into pipeline stages: every strategy, exact cover, optimality, errors."""

import itertools
import random

import pytest

from megapipe.config import Config, ConfigError, ModelConfig, ParallelConfig
from megapipe.config.flops import block_costs_from_flops, flops_per_token
from megapipe.config.pipeline_split import (
    check_partition,
    describe_partition,
    partition,
    rank_blocks,
)
from megapipe.pipeline.stages import profile_block_costs
from megapipe.plan.actions import Placement
from megapipe.plan.partition import cost_balanced, format_layout, parse_layout


def make_cfg(n_layers=8, pp=1, vpp=1, balance="uniform", **model):
    model = {"d_model": 64, "n_heads": 4, "vocab_size": 256, "seq_len": 32, **model}
    return Config(
        model=ModelConfig(n_layers=n_layers, **model),
        parallel=ParallelConfig(pp=pp, vpp=vpp, balance=balance),
    )


def layers_per_stage(stages, n_layers):
    return [sum(1 for b in r if 1 <= b <= n_layers) for r in stages]


def stage_costs(stages, costs):
    return [sum(costs[b] for b in r) for r in stages]


def brute_force_max(costs, n_stages):
    """Smallest possible slowest stage, trying every set of n_stages − 1 cut points."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("balance", ["uniform", "llama3", "cost"])
def test_every_strategy_covers_all_blocks_contiguously(balance):
    for n_layers in range(1, 13):
        for n_stages in range(1, n_layers + 3):
            stages = partition(make_cfg(n_layers, balance=balance), n_stages)
            assert len(stages) == n_stages
            assert all(len(r) >= 1 and r.step == 1 for r in stages), stages
            assert [b for r in stages for b in r] == list(range(n_layers + 2)), stages


def test_default_stage_count_is_pp_times_vpp():
    for pp, vpp in [(1, 1), (2, 1), (3, 2), (2, 4), (4, 2)]:
        for balance in ["uniform", "llama3", "cost"]:
            assert len(partition(make_cfg(10, pp, vpp, balance))) == pp * vpp


def test_uniform_spreads_layers_with_extra_on_earlier_stages():
    stages = partition(make_cfg(8, pp=3))
    assert stages == [range(0, 4), range(4, 7), range(7, 10)]
    assert layers_per_stage(stages, 8) == [3, 3, 2]
    assert layers_per_stage(partition(make_cfg(12, pp=4)), 12) == [3, 3, 3, 3]
    # fewer layers than middle stages: every block spread, one or more per stage
    assert partition(make_cfg(2), 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]


def test_llama3_first_and_last_stages_hold_fewer_layers():
    for n_stages in range(3, 9):
        for k in (1, 2, 3, 4):
            n_layers = k * n_stages
            counts = layers_per_stage(
                partition(make_cfg(n_layers, balance="llama3"), n_stages), n_layers
            )
            middle = counts[1:-1]
            assert counts[0] < min(middle) and counts[-1] < min(middle), (n_layers, counts)
            assert max(middle) - min(middle) <= 1


def test_llama3_405b_shape_and_small_fallbacks():
    # Llama 3 405B: 126 layers on 16 stages, one layer fewer on the first and the last stage
    counts = layers_per_stage(partition(make_cfg(126, 4, 4, "llama3")), 126)
    assert counts == [7] + [8] * 14 + [7]
    # two stages have no middle stage: an even split of all blocks
    assert layers_per_stage(partition(make_cfg(8, balance="llama3"), 2), 8) == [4, 4]
    # one layer left over goes to a middle stage, never to the head's stage
    assert layers_per_stage(partition(make_cfg(8, balance="llama3"), 3), 8) == [2, 4, 2]
    assert layers_per_stage(partition(make_cfg(7, balance="llama3"), 4), 7) == [1, 3, 2, 1]


def test_cost_dp_matches_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.0, rng.uniform(0, 10), float(rng.randint(1, 5))]) for _ in range(n)]
        for n_stages in range(1, n + 1):
            stages = cost_balanced(costs, n_stages)
            assert [b for r in stages for b in r] == list(range(n))
            assert all(len(r) >= 1 for r in stages)
            got = max(stage_costs(stages, costs))
            assert got == pytest.approx(brute_force_max(costs, n_stages)), (costs, n_stages)


def test_cost_dp_evens_out_stages_that_tie():
    assert cost_balanced([1.0] * 10, 4) == [range(0, 2), range(2, 4), range(4, 7), range(7, 10)]
    assert cost_balanced([1.0] * 12, 4) == [range(i, i + 3) for i in range(0, 12, 3)]
    # the first stage is the bottleneck whatever follows: the rest is still split evenly
    assert cost_balanced([10.0] + [1.0] * 6, 3) == [range(0, 1), range(1, 4), range(4, 7)]


def test_cost_never_worse_than_uniform_and_better_with_a_heavy_head():
    for n_layers, n_stages, vocab in [(8, 4, 256), (12, 4, 50257), (6, 3, 32000), (24, 8, 1000)]:
        cfg = make_cfg(n_layers, vocab_size=vocab)
        costs = block_costs_from_flops(cfg)
        uniform = max(stage_costs(partition(cfg, n_stages), costs))
        cfg.parallel.balance = "cost"
        assert max(stage_costs(partition(cfg, n_stages), costs)) <= uniform
    cfg = make_cfg(6, vocab_size=2000, balance="cost")  # the head costs ~2.4 layers
    costs = block_costs_from_flops(cfg)
    cost_max = max(stage_costs(partition(cfg, 3), costs))
    cfg.parallel.balance = "uniform"
    assert cost_max < 0.9 * max(stage_costs(partition(cfg, 3), costs))


def test_flop_costs_add_up_to_the_model_flops():
    for arch in ["gpt2", "llama"]:
        cfg = make_cfg(4, arch=arch, vocab_size=1000)
        costs = block_costs_from_flops(cfg)
        assert len(costs) == 6 and all(c > 0 for c in costs)
        assert costs[0] < costs[1] == costs[4] and costs[5] > 0
        # matmul and attention FLOPs are config/flops.flops_per_token; the rest is element-wise
        assert sum(costs) == pytest.approx(flops_per_token(cfg), rel=0.02)
        assert sum(costs) > flops_per_token(cfg)


def test_explicit_layout():
    cfg = make_cfg(7, balance="E,t,t|t,t,t|t,t,L")
    assert partition(cfg, 3) == [range(0, 3), range(3, 6), range(6, 9)]
    cfg.parallel.balance = " E , t*2 | t*3 | t*2 , L "
    assert partition(cfg, 3) == [range(0, 3), range(3, 6), range(6, 9)]
    cfg.parallel.balance = "E|t*7|L"  # uneven layer counts are fine
    assert partition(cfg, 3) == [range(0, 1), range(1, 8), range(8, 9)]
    cfg.parallel.balance = "E,t*7,L"
    assert partition(cfg, 1) == [range(0, 9)]


def test_format_layout_round_trips():
    for n_layers in (1, 5, 13):
        for n_stages in range(1, n_layers + 3):
            for balance in ["uniform", "llama3", "cost"]:
                stages = partition(make_cfg(n_layers, balance=balance), n_stages)
                layout = format_layout(stages)
                assert partition(make_cfg(n_layers, balance=layout), n_stages) == stages
    assert format_layout([range(0, 3), range(3, 9), range(9, 11)]) == "E,t,t|t*6|t,L"


BAD_LAYOUTS = [
    ("E,t,t|t,t,t|t,L", 3, "drops layers: 6 t but model.n_layers = 7"),
    ("E,t,t|t,t,t,t|t,t,L", 3, "duplicates layers: 8 t but model.n_layers = 7"),
    ("t,E,t|t,t,t|t,t,L", 3, "E (embedding) must appear once, as the first block"),
    ("E,t,t|E,t,t|t,t,t,L", 3, "E (embedding) must appear once"),
    ("t,t,t|t,t,t|t,t,L", 3, "E (embedding) must appear once"),
    ("E,t,t|t,t,t|t,L,t", 3, "L (LM head + loss) must appear once, as the last block"),
    ("E,t,t|t,t,t,L|t,t", 3, "L (LM head + loss) must appear once"),
    ("E,t,t|t,t,t|t,t,L", 4, "3 stages but parallel.pp·vpp = 4"),
    ("E,t*3||t*4,L", 3, "stage 1 is empty"),
    ("E,t,t|t,t,t|t,t,L|", 4, "stage 3 is empty"),
    ("E,t,x|t,t,t,t|t,t,L", 3, "bad entry 'x' in stage 0"),
    ("E,t,,t|t,t,t|t,L", 3, "bad entry '' in stage 0"),
    ("E,t*0,t*2|t*3|t*2,L", 3, "bad entry 't*0' in stage 0"),
]


@pytest.mark.parametrize(("layout", "n_stages", "problem"), BAD_LAYOUTS)
def test_bad_layouts_are_one_line_errors(layout, n_stages, problem):
    with pytest.raises(ConfigError) as err:
        partition(make_cfg(7, balance=layout), n_stages)
    message = str(err.value)
    assert message.startswith(f"parallel.balance layout {layout!r}: ") and "\n" not in message
    assert problem in message
    with pytest.raises(ValueError, match="parallel.balance layout"):
        parse_layout(layout, 7, n_stages)


def test_too_many_stages_and_unknown_balance():
    message = (
        "parallel.pp·vpp = 11 stages but the model has only 8 layers + embedding + head; "
        "lower pp/vpp or add layers"
    )
    for balance in ["uniform", "llama3", "cost", "E|t|t|t|t|t|t|t|t|L|t"]:
        with pytest.raises(ConfigError) as err:
            partition(make_cfg(8, balance=balance), 11)
        assert str(err.value) == message
    with pytest.raises(ConfigError, match=r"parallel.balance='even' is not one of uniform, llama3"):
        partition(make_cfg(8, balance="even"), 2)
    with pytest.raises(ConfigError, match=r"parallel.balance='' is not one of"):
        partition(make_cfg(8, balance=""), 2)


def test_check_partition_raises_config_errors():
    check_partition(make_cfg(8, pp=4, vpp=2, balance="llama3"))
    check_partition(make_cfg(8, pp=2, balance="E,t*4|t*4,L"))
    for cfg, match in [
        (make_cfg(8, pp=4, vpp=3, balance="cost"), "12 stages but the model has only 8 layers"),
        (make_cfg(8, pp=11), "11 stages but the model has only 8 layers"),
        (make_cfg(8, pp=2, balance="E,t*4|t*3,L"), "drops layers"),
        (make_cfg(8, pp=2, balance="balanced"), "is not one of"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_partition(cfg)


def test_rank_blocks_follow_the_placement():
    cfg = make_cfg(10, pp=2, vpp=2)
    stages = partition(cfg)

    def stages_for_rank(rank, pp, vpp, style="loop"):
        return [Placement(pp, vpp, style).stage(rank, chunk) for chunk in range(vpp)]

    assert Placement(2, 2).stage(1, 1) == 3 and stages_for_rank(1, 2, 2) == [1, 3]
    assert stages_for_rank(0, 2, 2, "v") == [0, 3] and stages_for_rank(1, 2, 2, "v") == [1, 2]
    assert rank_blocks(cfg, 0, Placement(2, 2, "loop")) == [stages[0], stages[2]]
    assert rank_blocks(cfg, 0, Placement(2, 2, "v")) == [stages[0], stages[3]]
    cfg.parallel.schedule = "zb_v"  # default placement comes from the schedule
    assert rank_blocks(cfg, 1) == [stages[1], stages[2]]
    for pp, vpp, style in [(3, 1, "loop"), (3, 3, "loop"), (4, 2, "v")]:
        cfg = make_cfg(10, pp, vpp, "llama3")
        held = [
            b
            for r in range(pp)
            for rng in rank_blocks(cfg, r, Placement(pp, vpp, style))
            for b in rng
        ]
        assert sorted(held) == list(range(12))


def test_describe_partition():
    cfg = make_cfg(8, pp=2, vpp=2, balance="uniform")
    cfg.parallel.schedule = "interleaved_1f1b"
    lines = describe_partition(cfg).splitlines()
    assert len(lines) == 5 and "layout E,t,t|t,t|t,t|t,t,L" in lines[0]
    assert "stage  0 (rank 0, chunk 0): E,t,t" in lines[1]
    assert "stage  2 (rank 0, chunk 1): t,t" in lines[3] and "blocks   5-6" in lines[3]
    shares = [float(line.split("cost")[1].strip(" %")) for line in lines[1:]]
    assert sum(shares) == pytest.approx(100, abs=0.3)
    even = describe_partition(cfg, costs=[1.0] * 10).splitlines()
    assert "slowest 1.20x the mean" in even[0] and even[1].endswith("30.0%")


def test_profiled_costs_drive_the_cost_partition():
    cfg = make_cfg(3, pp=2, balance="cost", d_model=16, n_heads=2, vocab_size=32, seq_len=8)
    costs = profile_block_costs(cfg, n_iters=1)
    assert len(costs) == 5 and all(c > 0 for c in costs)
    assert costs[1] == costs[2] == costs[3]  # one layer timed, its cost used for each
    stages = partition(cfg, costs=costs)
    assert max(stage_costs(stages, costs)) == pytest.approx(brute_force_max(costs, 2))
    with pytest.raises(ValueError, match="costs has 4 entries; the model has 5 blocks"):
        partition(cfg, costs=costs[:4])
    with pytest.raises(ValueError, match="cannot split 3 blocks"):
        cost_balanced([1.0, 2.0, 3.0], 4)
