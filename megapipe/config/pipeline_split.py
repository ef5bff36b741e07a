"""The config's pipeline partition: plan.partition's arithmetic fed from the config, its errors
as one-line ConfigErrors, and the split as `--dry-run` prints it.

Every consumer (the pipeline's chunks, the dry run, the config checks) asks here, so what the
dry run reports is the split training uses.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.config.flops import block_costs_from_flops
from megapipe.config.memory_terms import layer_deferred, layer_terms, segments
from megapipe.config.schema import Config, ConfigError
from megapipe.plan import partition as blocks
from megapipe.plan.actions import Placement, Schedule
from megapipe.plan.schedules import SCHEDULES, build_schedule
from megapipe.plan.schedules import placement as schedule_placement
from megapipe.plan.simulate import Costs


def partition(
    cfg: Config, n_stages: int | None = None, costs: Sequence[float] | None = None
) -> list[range]:
    """One contiguous block range per global stage (default the placement's: pp·vpp, or pp
    under DualPipe's two copies of each stage), covering 0..L+1."""
    p = cfg.parallel
    n_stages = placement_of(cfg).num_stages if n_stages is None else n_stages
    if costs is None and p.balance.strip() == "cost":
        costs = block_costs_from_flops(cfg)
    try:
        return blocks.partition(cfg.model.n_layers, n_stages, p.balance, costs)
    except ValueError as err:  # plan's errors already name the key and the fix
        raise ConfigError(str(err)) from None


def placement_of(cfg: Config) -> Placement:
    """The placement of the configured schedule's chunks."""
    return schedule_placement(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.vpp)


def schedule_costs(cfg: Config) -> Costs:
    """The costs the schedule is built with: the given ones of a schedule built for costs
    (zb_v, zb_auto), else unit costs (`profile` starts from the unit-cost schedule and
    rebuilds from step 2's measurements)."""
    p = cfg.parallel
    if SCHEDULES[p.schedule].built_for_costs and p.schedule_costs not in ("profile", "unit"):
        return Costs.parse(p.schedule_costs)
    return Costs()


def zb_w_share(cfg: Config) -> float:
    """Zero Bubble's M_W / M_B (Qi et al. 2023, Table 1) for this model: what a transformer
    layer keeps from its B to its W (the linears' inputs and output grads) over all it saves for
    backward at the configured recompute mode (config/memory_terms.py, on CUDA as the dry run
    counts). At most 1: under full recompute W keeps more than F saved, and a microbatch then
    counts whole until its W."""
    kept = sum(sum(layer_deferred(cfg, i).values()) for i in segments(cfg))
    held = sum(sum(layer_terms(cfg, None, "cuda", i).values()) for i in segments(cfg))
    return min(1.0, kept / held) if held > 0 else 1.0


def schedule_of(cfg: Config, costs: Costs | None = None) -> Schedule:
    """The configured schedule with its options (schedule_options). The pipeline runs it and
    the dry run simulates it."""
    p = cfg.parallel
    opts = schedule_options(cfg, costs)
    return build_schedule(p.schedule, p.pp, p.microbatches, p.vpp, p.seq_segments, **opts)


def schedule_options(cfg: Config, costs: Costs | None = None) -> dict:
    """The options schedule_of builds the schedule with: the costs a schedule built for costs
    gets (`costs`, e.g. measured, else the given ones), zb_auto's memory limit and M_W / M_B,
    PipeDream's weight sync."""
    p = cfg.parallel
    spec = SCHEDULES[p.schedule]
    opts: dict = {"weight_sync": p.weight_sync} if p.schedule == "pipedream_async" else {}
    if spec.built_for_costs and (costs or p.schedule_costs not in ("profile", "unit")):
        opts["costs"] = costs or schedule_costs(cfg)
    if "memory" in spec.options:
        opts |= {"memory": p.zb_memory, "w_share": zb_w_share(cfg)}
    return opts


def rank_blocks(
    cfg: Config, rank: int, placement: Placement | None = None, costs: Sequence[float] | None = None
) -> list[range]:
    """Block ranges of each local chunk of pp rank `rank`: build chunk c with
    `GPT(cfg.model, blocks=ranges[c])`. The placement defaults to the configured schedule's."""
    placement = placement or placement_of(cfg)
    stages = partition(cfg, placement.num_stages, costs)
    return [stages[placement.stage(rank, chunk)] for chunk in range(placement.vpp)]


def describe_partition(
    cfg: Config, costs: Sequence[float] | None = None, placement: Placement | None = None
) -> str:
    """For --dry-run: one line per stage with its (rank, chunk), blocks and share of the cost."""
    placement = placement or placement_of(cfg)
    stages = partition(cfg, placement.num_stages, costs)
    costs = block_costs_from_flops(cfg) if costs is None else costs
    total, head = sum(costs), cfg.model.n_layers + 1
    shares = [sum(costs[b] for b in stage) / total for stage in stages]
    lines = [
        f"partition (parallel.balance={cfg.parallel.balance}): {len(stages)} stages, "
        f"slowest {max(shares) * len(stages):.2f}x the mean; layout {blocks.format_layout(stages)}"
    ]
    for stage, (held, share) in enumerate(zip(stages, shares)):
        rank, chunk = placement.locate(stage)
        text = blocks.stage_text(held, head)
        lines.append(
            f"  stage {stage:>2} (rank {rank}, chunk {chunk}): {text:<14} "
            f"blocks {held.start:>3}-{held.stop - 1:<3} cost {share:6.1%}"
        )
    return "\n".join(lines)


def check_partition(cfg: Config) -> None:
    """Config check: ConfigError when pp·vpp stages cannot hold the blocks as balance asks."""
    p = cfg.parallel
    if p.balance.strip() == "cost":  # the DP always succeeds once the count fits
        try:
            blocks.check_stage_count(placement_of(cfg).num_stages, cfg.model.n_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    else:
        partition(cfg)
