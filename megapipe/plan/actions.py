"""Pipeline actions, stage placement and the per-rank grid printer.

A schedule is data: ``{rank: [Action, ...]}``. Each rank runs its list in order; the runtime and
the simulator read the same lists.

Compact action format (``str(action)``), read left to right::

    F3        forward of microbatch 3 on chunk 0
    B3.c1     input-grad backward of microbatch 3 on local chunk 1 (virtual stage)
    W3        deferred weight-grad backward (Zero Bubble)
    BW3       full backward (input-grad and weight-grad together)
    F3s2      forward of sequence segment 2 of microbatch 3 (Seq1F1B)
    F3@5      forward of microbatch 3 with weight version 5 (PipeDream async)
    F3&       forward of microbatch 3 paired with the next action: an F&B pair (DualPipe)

The chunk suffix is left out for chunk 0, the segment suffix for unsegmented schedules and the
version suffix for synchronous schedules, so ``F3.c1s2@5`` is the longest form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

FORWARD, INPUT_GRAD, WEIGHT_GRAD, FULL_BACKWARD = "F", "B", "W", "BW"
KINDS = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, FULL_BACKWARD)

_ACTION_RE = re.compile(r"^(BW|F|B|W)(\d+)(?:\.c(\d+))?(?:s(\d+))?(?:@(\d+))?(&)?$")


class Action(NamedTuple):
    """One unit of work on one rank: ``kind`` of ``microbatch`` on local ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0
    segment: int | None = None  # Seq1F1B sequence segment; None when unsegmented
    version: int | None = None  # PipeDream weight version; None for flushed schedules
    # DualPipe (DeepSeek-V3 §3.2.1): this forward and the next action on its rank (a backward
    # of another chunk) form one overlapped F&B pair, which starts once both inputs are there
    pair: bool = False

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}"
        if self.chunk:
            text += f".c{self.chunk}"
        if self.segment is not None:
            text += f"s{self.segment}"
        if self.version is not None:
            text += f"@{self.version}"
        return text + "&" * self.pair

    @property
    def seg(self) -> int:
        """Segment index with unsegmented actions counted as segment 0."""
        return 0 if self.segment is None else self.segment

    @property
    def unit(self) -> tuple[int, int, int]:
        """(microbatch, chunk, segment): what one F and one backward are done for."""
        return (self.microbatch, self.chunk, self.seg)

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str(action)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"bad action {text!r}: expected e.g. F3, B3.c1, BW3s2, F3@5")
        kind, mb, chunk, seg, ver, pair = match.groups()
        return Action(
            kind,
            int(mb),
            int(chunk or 0),
            None if seg is None else int(seg),
            None if ver is None else int(ver),
            pair is not None,
        )


Schedule = dict[int, list[Action]]


@dataclass(frozen=True)
class Placement:
    """Maps (rank, local chunk) to a global pipeline stage.

    ``loop`` (Megatron interleaving, Narayanan et al. 2021 §2.2): chunk c of rank r holds stage
    c·pp + r, so a microbatch loops over all ranks v times.
    ``v`` (Zero Bubble ZB-V, Qi et al. 2024): two chunks; rank r holds stage r as chunk 0 and stage
    2·pp−1−r as chunk 1, so the first and last stage share rank 0.
    ``dual`` (DualPipe, DeepSeek-V3 §3.2.1): the model in pp stages, each held twice; rank r holds
    stage r as chunk 0 for the microbatches going down (even ones, entering at rank 0) and stage
    pp−1−r as chunk 1 for those going up (odd ones, entering at rank pp−1).
    """

    pp: int
    vpp: int = 1
    style: str = "loop"

    @property
    def num_stages(self) -> int:
        return self.pp if self.style == "dual" else self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        if self.style == "v":
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        if self.style == "dual":
            return rank if chunk == 0 else self.pp - 1 - rank
        return chunk * self.pp + rank

    def locate(self, stage: int, microbatch: int = 0) -> tuple[int, int]:
        """Inverse of ``stage``: the (rank, chunk) holding a global stage (under ``dual``, the
        copy that `microbatch`'s direction runs)."""
        if self.style == "v":
            return (stage, 0) if stage < self.pp else (2 * self.pp - 1 - stage, 1)
        if self.style == "dual":
            return (stage, 0) if microbatch % 2 == 0 else (self.pp - 1 - stage, 1)
        return stage % self.pp, stage // self.pp

    @property
    def passes(self) -> int:
        """Chunks of a rank one microbatch runs through (what a rank's share of the model, the
        simulator's unit of cost and activations, is split over): one under ``dual``."""
        return 1 if self.style == "dual" else self.vpp

    def runs(self, microbatch: int, chunk: int) -> bool:
        """Whether `microbatch` passes through local `chunk` (under ``dual``: its direction's)."""
        return self.style != "dual" or chunk == microbatch % 2

    def as_dict(self) -> dict[tuple[int, int], int]:
        return {(r, c): self.stage(r, c) for r in range(self.pp) for c in range(self.vpp)}


def one_f_one_b_order(
    forwards: list[Action], backwards: list[list[Action]], warmup: int, tail: list[Action] = ()
) -> list[Action]:
    """Warm-up forwards, then one forward + one backward group per step, then the rest."""
    warmup = min(warmup, len(forwards))
    order = list(forwards[:warmup])
    # steady state: each new forward is followed by the oldest outstanding backward group
    for step, forward in enumerate(forwards[warmup:]):
        order.append(forward)
        order.extend(backwards[step])
    # cool-down: drain the backward groups still outstanding
    for group in backwards[len(forwards) - warmup :]:
        order.extend(group)
    return order + list(tail)


def format_grid(schedule: Schedule, width: int = 0) -> str:
    """Per-rank grid, one line per rank, actions in execution order (not aligned in time)."""
    cells = {rank: [str(a) for a in actions] for rank, actions in schedule.items()}
    width = width or max((len(c) for row in cells.values() for c in row), default=1)
    lines = []
    for rank in sorted(cells):
        row = " ".join(c.ljust(width) for c in cells[rank]).rstrip()
        lines.append(f"rank {rank}: {row}")
    return "\n".join(lines)
