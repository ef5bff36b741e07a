"""Pipeline schedules from the literature as data: ``{rank: [Action, ...]}``.

Every generator takes (pp, microbatches, ...) and returns one ordered action list per rank; the
registry ``SCHEDULES`` (each schedule with its own chunk and option rules, which the config
checks read) and ``build_schedule`` are the entry points, ``placement`` says which global stage
each (rank, chunk) holds. Zero Bubble lives in zero_bubble.py (hand-made) and zb_auto.py
(automatic), V-Half and V-Min in controllable_memory.py, Seq1F1B in seq1f1b.py, DualPipe
and DualPipeV in dualpipe.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megapipe.plan.actions import (
    FORWARD,
    FULL_BACKWARD,
    Action,
    Placement,
    Schedule,
    one_f_one_b_order,
)
from megapipe.plan.controllable_memory import v_half, v_min
from megapipe.plan.dualpipe import dualpipe, dualpipe_v
from megapipe.plan.seq1f1b import seq1f1b
from megapipe.plan.zb_auto import zb_auto
from megapipe.plan.zero_bubble import zb_h1, zb_h2, zb_v


def gpipe(pp: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards (flush).

    Forwards are issued in torchgpipe's deterministic clock-cycle order (Kim et al. 2020 §3.2.1):
    at clock k every (microbatch i, stage j) with i + j = k runs. Backwards run in reverse
    microbatch order, B(i, j) before B(i−1, j), as in the GPipe figure.
    """
    schedule: Schedule = {rank: [] for rank in range(pp)}
    for clock in range(microbatches + pp - 1):
        for stage in range(max(0, clock - microbatches + 1), min(clock + 1, pp)):
            schedule[stage].append(Action(FORWARD, clock - stage))
    for rank in range(pp):
        schedule[rank] += [Action(FULL_BACKWARD, mb) for mb in reversed(range(microbatches))]
    return schedule


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """PipeDream-Flush / DAPPLE 1F1B (Narayanan et al. 2021 §2.2; Fan et al. 2021).

    Rank r warms up with pp−r−1 forwards, so at most pp−r microbatches are in flight.
    """
    schedule = {}
    for rank in range(pp):
        forwards = [Action(FORWARD, mb) for mb in range(microbatches)]
        backwards = [[Action(FULL_BACKWARD, mb)] for mb in range(microbatches)]
        schedule[rank] = one_f_one_b_order(forwards, backwards, warmup=pp - rank - 1)
    return schedule


def interleaved_1f1b(
    pp: int, microbatches: int, vpp: int, microbatch_group: int | None = None
) -> Schedule:
    """Megatron interleaved 1F1B (Narayanan et al. 2021 §2.2) with Llama 3's any-m groups.

    Loop placement: chunk c of rank r is stage c·pp + r. Microbatches go in groups: a rank runs a
    group through chunk 0, then chunk 1, ...; backwards visit chunks in reverse. Megatron fixes the
    group at pp and needs m % pp == 0; Llama 3 (Dubey et al. 2024 §3.3.2) makes the number of
    consecutive microbatches per chunk tunable. Here ``microbatch_group`` N (default pp, must be
    >= pp) sets the group size and any m works: m is cut into max(1, m // N) groups whose sizes
    differ by at most one, largest first. A group smaller than pp would make a rank's forward wait
    on its own backward (deadlock), which is why N >= pp and why m < pp is one group.
    """
    group = microbatch_group or pp
    if group < pp:
        raise ValueError(f"microbatch_group must be >= pp ({pp}), got {group}")
    rounds = max(1, microbatches // group)
    sizes = [microbatches // rounds + (i < microbatches % rounds) for i in range(rounds)]
    starts = [sum(sizes[:i]) for i in range(rounds)]
    groups = [range(start, start + size) for start, size in zip(starts, sizes)]
    forwards = [Action(FORWARD, mb, c) for g in groups for c in range(vpp) for mb in g]
    backwards = [
        [Action(FULL_BACKWARD, mb, c)] for g in groups for c in reversed(range(vpp)) for mb in g
    ]
    schedule = {}
    for rank in range(pp):
        # warm-up: enough forwards for the first backward (stage vpp·pp−1) to come back to this
        # rank: (vpp−1) groups, plus 2 per downstream rank for the F/B round trip (Megatron).
        warmup = (vpp - 1) * sizes[0] + 2 * (pp - 1 - rank)
        schedule[rank] = one_f_one_b_order(forwards, backwards, warmup)
    return schedule


def pipedream_async(pp: int, microbatches: int, weight_sync: str = "stash") -> Schedule:
    """PipeDream 1F1B without a flush (Narayanan et al. SOSP'19 §3.3), with weight versions.

    Each stage updates its weights after every backward, so version n means "after n updates of
    this stage" (0 = initial weights). ``stash``: a forward uses the newest local version and its
    backward reuses it (weight stashing). ``vertical``: every stage uses the version the
    microbatch entered the pipeline with, i.e. stage 0's version at its forward (vertical sync).
    The action order is 1F1B's: the NOAM warm-up of pp−r−1 forwards, then one F, one BW.
    """
    if weight_sync not in ("stash", "vertical"):
        raise ValueError(f"weight_sync must be 'stash' or 'vertical', got {weight_sync!r}")
    base = one_f_one_b(pp, microbatches)
    entry_version = _forward_versions(base[0])
    schedule = {}
    for rank, actions in base.items():
        local = _forward_versions(actions)
        version = entry_version if weight_sync == "vertical" else local
        schedule[rank] = [a._replace(version=version[a.microbatch]) for a in actions]
    return schedule


def _forward_versions(actions: list[Action]) -> dict[int, int]:
    """Number of weight updates (backwards) done on this rank before each microbatch's forward."""
    updates, versions = 0, {}
    for a in actions:
        if a.kind == FORWARD:
            versions[a.microbatch] = updates
        else:
            updates += 1
    return versions


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule's generator and its own rules: the config checks and the CLI read these."""

    build: Callable[..., Schedule]  # (pp, microbatches, vpp, seq_segments, **options)
    chunks: tuple[int, int | None] = (1, 1)  # allowed vpp: (least, most; None = no limit)
    placement: str = "loop"  # Placement style of its chunks
    split_backward: bool = False  # emits B and W instead of BW (Zero Bubble)
    segmented: bool = False  # runs Seq1F1B sequence segments (reads seq_segments)
    options: tuple[str, ...] = ()  # keyword options its generator takes
    microbatches_per_rank: int = 0  # least microbatches per pp rank (DualPipe: 2)

    @property
    def built_for_costs(self) -> bool:
        """Built for given F/B/W costs: parallel.schedule_costs applies (profile: rebuilt from
        the costs measured in training's second step)."""
        return "costs" in self.options

    def chunk_problem(self, vpp: int, key: str = "vpp") -> str | None:
        """Why `vpp` chunks per rank cannot run this schedule (None: they can)."""
        least, most = self.chunks
        if most == 1 and vpp != 1:
            return f"runs one chunk per rank: set {key}=1 (got {vpp})"
        if least == most and vpp != least:  # ZB-V's V folds exactly two chunks (Qi et al. 2024)
            return f"needs exactly {least} chunks per rank ({key}={least}), got {key}={vpp}"
        if vpp < least:  # interleaving loops over several chunks (Narayanan et al. 2021 §2.2)
            return f"needs {key} >= {least}, got {key}={vpp}"
        return None

    def microbatch_problem(
        self, pp: int, microbatches: int, key: str = "microbatches"
    ) -> str | None:
        """Why `microbatches` cannot run this schedule on `pp` ranks (None: they can)."""
        least = self.microbatches_per_rank * pp
        if microbatches < least:
            return f"needs {key} >= {self.microbatches_per_rank}*pp = {least}, got {microbatches}"
        if self.placement == "dual" and (pp % 2 or microbatches % 2):  # half go either way
            return f"needs an even pp and an even {key}, got pp={pp} {key}={microbatches}"
        return None


# V-Half and V-Min (Qi et al. 2024): a building block in V placement, built for given F/B/W costs
V_SHAPE_BLOCK = dict(chunks=(2, 2), placement="v", split_backward=True, options=("costs",))

SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(lambda pp, m, v, k: gpipe(pp, m)),
    "1f1b": ScheduleSpec(lambda pp, m, v, k: one_f_one_b(pp, m)),
    "interleaved_1f1b": ScheduleSpec(
        lambda pp, m, v, k, **o: interleaved_1f1b(pp, m, v, **o), chunks=(2, None),
        options=("microbatch_group",)),
    "zb_h1": ScheduleSpec(lambda pp, m, v, k: zb_h1(pp, m), split_backward=True),
    "zb_h2": ScheduleSpec(lambda pp, m, v, k: zb_h2(pp, m), split_backward=True),
    "zb_v": ScheduleSpec(lambda pp, m, v, k, **o: zb_v(pp, m, **o), chunks=(2, 2),
                         placement="v", split_backward=True, options=("memory_limit", "costs")),
    "zb_auto": ScheduleSpec(lambda pp, m, v, k, **o: zb_auto(pp, m, **o), split_backward=True,
                            options=("memory", "costs", "w_share")),
    "v_half": ScheduleSpec(lambda pp, m, v, k, **o: v_half(pp, m, **o), **V_SHAPE_BLOCK),
    "v_min": ScheduleSpec(lambda pp, m, v, k, **o: v_min(pp, m, **o), **V_SHAPE_BLOCK),
    "seq1f1b": ScheduleSpec(lambda pp, m, v, k: seq1f1b(pp, m, k), segmented=True),
    "dualpipe_v": ScheduleSpec(lambda pp, m, v, k: dualpipe_v(pp, m), chunks=(2, 2), placement="v",
                               split_backward=True, microbatches_per_rank=2),
    "dualpipe": ScheduleSpec(lambda pp, m, v, k: dualpipe(pp, m), chunks=(2, 2), placement="dual",
                             split_backward=True, microbatches_per_rank=2),
    "pipedream_async": ScheduleSpec(lambda pp, m, v, k, **o: pipedream_async(pp, m, **o),
                                    options=("weight_sync",)),
}  # fmt: skip
SPLIT_BACKWARD = {name for name, spec in SCHEDULES.items() if spec.split_backward}


def placement(name: str, pp: int, vpp: int = 1) -> Placement:
    """Which global stage each (rank, chunk) holds for schedule ``name``."""
    return Placement(pp, vpp, SCHEDULES[name].placement)


def build_schedule(
    name: str, pp: int, microbatches: int, vpp: int = 1, seq_segments: int = 1, **opts
) -> Schedule:
    """Build schedule ``name``; bad arguments raise a one-line ValueError naming the fix."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    if pp < 1 or microbatches < 1:
        raise ValueError(
            f"pp and microbatches must be >= 1, got pp={pp} microbatches={microbatches}"
        )
    if seq_segments < 1:
        raise ValueError(f"seq_segments must be >= 1, got {seq_segments}")
    if seq_segments > 1 and not spec.segmented:
        raise ValueError(f"seq_segments={seq_segments} needs schedule seq1f1b, not {name}")
    if problem := spec.chunk_problem(vpp) or spec.microbatch_problem(pp, microbatches):
        raise ValueError(f"{name} {problem}")
    if unknown := set(opts) - set(spec.options):
        raise ValueError(f"{name} takes no option {', '.join(sorted(unknown))}")
    return spec.build(pp, microbatches, vpp, seq_segments, **opts)
