"""Pipeline schedules from the literature as data: ``{rank: [Action, ...]}``.

Every generator takes (pp, microbatches, ...) and returns one ordered action list per rank; the
registry ``SCHEDULES`` and ``build_schedule`` are the entry points, ``placement`` says which
global stage each (rank, chunk) holds. Zero Bubble lives in zero_bubble.py, Seq1F1B in seq1f1b.py.
"""

from __future__ import annotations

from megapipe.pipeline.actions import (
    FORWARD,
    FULL_BACKWARD,
    Action,
    Placement,
    Schedule,
    one_f_one_b_order,
)
from megapipe.pipeline.seq1f1b import seq1f1b
from megapipe.pipeline.zero_bubble import zb_h1, zb_h2, zb_v


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


def interleaved_1f1b(pp: int, microbatches: int, vpp: int,
                     microbatch_group: int | None = None) -> Schedule:
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
    backwards = [[Action(FULL_BACKWARD, mb, c)]
                 for g in groups for c in reversed(range(vpp)) for mb in g]
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


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "zb_v": zb_v,
    "seq1f1b": seq1f1b,
    "pipedream_async": pipedream_async,
}
SPLIT_BACKWARD = {"zb_h1", "zb_h2", "zb_v"}  # schedules that emit B and W instead of BW


def placement(name: str, pp: int, vpp: int = 1) -> Placement:
    """Which global stage each (rank, chunk) holds for schedule ``name``."""
    return Placement(pp, vpp, "v" if name == "zb_v" else "loop")


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, seq_segments: int = 1,
                   **opts) -> Schedule:
    """Build schedule ``name``; bad arguments raise a one-line ValueError naming the fix."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1:
        raise ValueError(
            f"pp and microbatches must be >= 1, got pp={pp} microbatches={microbatches}"
        )
    if seq_segments < 1:
        raise ValueError(f"seq_segments must be >= 1, got {seq_segments}")
    if seq_segments > 1 and name != "seq1f1b":
        raise ValueError(f"seq_segments={seq_segments} needs schedule seq1f1b, not {name}")
    if name == "interleaved_1f1b" and vpp < 2:
        raise ValueError(f"interleaved_1f1b needs vpp >= 2, got vpp={vpp}")
    if name == "zb_v" and vpp != 2:
        raise ValueError(f"zb_v needs exactly 2 chunks per rank (vpp=2), got vpp={vpp}")
    if name not in ("interleaved_1f1b", "zb_v") and vpp != 1:
        raise ValueError(f"{name} runs one chunk per rank: set vpp=1 (got {vpp})")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, vpp, **opts)
    if name == "seq1f1b":
        return seq1f1b(pp, microbatches, seq_segments, **opts)
    return SCHEDULES[name](pp, microbatches, **opts)
