"""V-shape schedules from building blocks (Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory", arXiv 2405.15362): V-Min and V-Half.

The paper's framework: a schedule is one microbatch's *building block* (when each pass
F, B, W of each stage starts) repeated every *interval* T, the time one rank needs for one
microbatch (its two chunks' F+B+W; the busiest rank's when they differ). A pass of rank r and
chunk c keeps its activations from the start of its F to the end of its W, its *lifespan* l;
repeated every T, at most ceil(l / T) copies are alive at once, so a rank holds at most
Σ_c ceil(l_c / T) chunk activations (`MicrobatchPasses.lifespan_bound`; `MicrobatchPasses.memory`
counts the most
alive at once exactly).
The steady state has no bubble when no two passes of a rank collide modulo T; warm-up and
cool-down are squeezed: each rank runs the repeated order as early as its inputs allow,
which is what the runtime and the simulator do with an action list, so the list is the block's
passes sorted by their repeated start times (any such order is deadlock-free: every input of a
pass starts earlier).

V-shape blocks: rank r holds stage r (chunk 0) and stage 2p−1−r (chunk 1), so the long
lifespan of chunk 0 on rank 0 pairs with the short one of chunk 1 there, and every rank holds
about the same memory. The *offsets* between a pass and the next stage's pass set the
lifespans. Each block here places every pass at the earliest start that is ready and free modulo
T on its rank (modulo scheduling), after the extra offsets of one choice in OFFSETS; V-Min takes
the block with the least memory (the paper's (p+4)//3 microbatches at F = B = W, a third of
1F1B's p), V-Half the least bubble within (p+2)//2 (a half). The member at 1F1B's memory, V-ZB,
is `zb_v` (zero_bubble.py): the Zero Bubble list schedule at p microbatches, whose order closes
the bubble that a repeated block leaves in warm-up and cool-down (tests compare the two).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from megapipe.plan.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Placement, Schedule
from megapipe.plan.simulate import Costs, action_cost, simulate

# Extra offsets tried between consecutive passes, in units of the pass's own duration:
# (F chunk 0, F chunk 1, B chunk 1, B chunk 0, W after its B).
OFFSETS = tuple(itertools.product((0, 1, 2), (0, 1, 2), (0, 1, 2), (0, 1, 2), range(5)))
PASS = (FORWARD, INPUT_GRAD, WEIGHT_GRAD)


@dataclass(frozen=True, eq=False)  # hashed by identity: `_bubble` caches per block
class MicrobatchPasses:
    """One microbatch's passes: ``start[(kind, stage)]``, repeated every ``interval``."""

    pp: int
    start: dict[tuple[str, int], float]
    duration: dict[tuple[str, int], float]
    interval: float

    def lifespan(self, stage: int) -> float:
        """From the start of the stage's F to the end of its W (activations live that long)."""
        end = self.start[(WEIGHT_GRAD, stage)] + self.duration[(WEIGHT_GRAD, stage)]
        return end - self.start[(FORWARD, stage)]

    def lifespan_bound(self) -> list[float]:
        """Per rank: Σ_c ceil(l_c / T) / 2 microbatches (a chunk is half of one), the paper's
        bound on the activations alive at once."""
        where = Placement(self.pp, 2, "v")
        return [
            sum(math.ceil(self.lifespan(where.stage(r, c)) / self.interval - 1e-9) for c in (0, 1))
            / 2
            for r in range(self.pp)
        ]

    def memory(self) -> list[float]:
        """Per rank: the most microbatches alive at once in the repeated order (steady state),
        at most `lifespan_bound`: the chunks' peaks need not coincide. Counted at each F start:
        the F's begun minus the W's begun before it (the next F waits for that W's end)."""
        where, T = Placement(self.pp, 2, "v"), self.interval
        reach = 2 + max(math.ceil(self.lifespan(s) / T) for s in range(2 * self.pp))
        out = []
        for r in range(self.pp):
            stages = [where.stage(r, c) for c in (0, 1)]
            peak = 0
            for t in (self.start[(FORWARD, s)] for s in stages):
                alive = 0
                for s in stages:
                    f, w = self.start[(FORWARD, s)], self.start[(WEIGHT_GRAD, s)]
                    for j in range(-reach, reach + 1):
                        alive += (f + j * T <= t + 1e-9) - (w + j * T < t - 1e-9)
                peak = max(peak, alive)
            out.append(peak / 2)
        return out

    def repeat(self, microbatches: int) -> Schedule:
        """Each rank's actions in the order of their repeated start times (the squeeze)."""
        where = Placement(self.pp, 2, "v")
        timed: dict[int, list] = {r: [] for r in range(self.pp)}
        for (kind, stage), t in self.start.items():
            rank, chunk = where.locate(stage)
            for mb in range(microbatches):
                timed[rank].append((t + mb * self.interval, Action(kind, mb, chunk)))
        return {r: [a for _, a in sorted(timed[r])] for r in range(self.pp)}


def v_block(pp: int, costs: Costs, offsets: tuple[int, ...]) -> MicrobatchPasses:
    """The V-shape block with these extra `offsets` (see OFFSETS), modulo-scheduled."""
    where = Placement(pp, 2, "v")
    dur, interval = _durations(pp, costs)
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in range(pp)}
    start: dict[tuple[str, int], float] = {}

    def place(kind: str, stage: int, ready: float, extra: int) -> float:
        rank = where.locate(stage)[0]
        d = dur[(kind, stage)]
        t = _earliest_free(busy[rank], ready + extra * d, d, interval)
        busy[rank].append(((t % interval), d))
        start[(kind, stage)] = t
        return t + d

    def hop(src: int, dst: int) -> float:  # a message between ranks pays comm
        return costs.comm if where.locate(src)[0] != where.locate(dst)[0] else 0.0

    f0, f1, b1, b0, w = offsets
    end = place(FORWARD, 0, 0.0, 0)
    for s in range(1, 2 * pp):  # the forward goes down chunk 0, turns, comes back up chunk 1
        end = place(FORWARD, s, end + hop(s - 1, s), (f0 if s < pp else f1) * (s != pp))
    for s in reversed(range(2 * pp)):  # the backward retraces it; each W follows its B
        ready = end + (hop(s + 1, s) if s < 2 * pp - 1 else 0.0)
        end = place(INPUT_GRAD, s, ready, (b1 if s >= pp else b0) * (s not in (2 * pp - 1, pp - 1)))
        place(WEIGHT_GRAD, s, end, w)
    return MicrobatchPasses(pp, start, dur, interval)


@functools.lru_cache(maxsize=256)
def _durations(pp: int, costs: Costs) -> tuple[dict[tuple[str, int], float], float]:
    """Each pass's seconds as the simulator prices it (rank 0 also embeds and runs the head and
    loss) and the interval T: the same for every offset choice, so priced once per build."""
    where = Placement(pp, 2, "v")
    dur = {
        (k, s): action_cost(Action(k, 0, where.locate(s)[1]), s, costs, where, [1.0])
        for k in PASS
        for s in range(2 * pp)
    }
    interval = max(
        sum(dur[(k, where.stage(r, c))] for k in PASS for c in (0, 1)) for r in range(pp)
    )
    return dur, interval


def _earliest_free(busy: list[tuple[float, float]], ready: float, d: float, T: float) -> float:
    """The earliest t >= ready with [t, t+d) free of `busy` (start mod T, length) modulo T."""
    candidates = sorted({ready} | {ready + (s + dd - ready) % T for s, dd in busy})
    for t in candidates:
        a = t % T
        for s, dd in busy:  # [a, a+d) and [s, s+dd) overlap on the circle of length T
            gap = (s - a) % T
            if gap < d - 1e-9 or T - gap < dd - 1e-9:
                break
        else:  # inlined, not a call per pair: a V-Half build asks this ~10^5 times
            return t
    # Unequal F, B, W can leave no gap long enough: overlap at `ready`. The order stays valid
    # (sorted by start, every input starts earlier) and Σ ceil(l / T) still bounds memory; the
    # steady state then idles, which the block choice's simulated bubble sees.
    return ready


@functools.lru_cache(maxsize=256)
def _blocks(pp: int, costs: Costs) -> tuple[tuple[MicrobatchPasses, float], ...]:
    """Every offset choice's block with its peak memory."""
    blocks = (v_block(pp, costs, offsets) for offsets in OFFSETS)
    return tuple((block, max(block.memory())) for block in blocks)


@functools.lru_cache(maxsize=4096)
def _bubble(block: MicrobatchPasses, costs: Costs) -> float:
    """The block's bubble rate (Zero Bubble's, per rank span) simulated at m = 4p."""
    return _order_bubble(_order(block.repeat(4 * block.pp)), block.pp, costs)


def _order(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's action list, frozen (a key)."""
    return tuple(tuple(schedule[r]) for r in range(len(schedule)))


@functools.lru_cache(maxsize=1024)
def _order_bubble(order: tuple[tuple[Action, ...], ...], pp: int, costs: Costs) -> float:
    """The bubble rate of one action order: the simulator reads the order and the costs only,
    not the block's start times, so blocks whose starts sort alike share it (of a V-Half's
    ~120 candidate blocks ~25 orders are distinct; each simulation is most of a build)."""
    return simulate(
        {r: list(a) for r, a in enumerate(order)}, costs, Placement(pp, 2, "v")
    ).bubble_rate_paper


def _least_bubble(pp: int, costs: Costs, cap: float) -> MicrobatchPasses:
    """Among the blocks within `cap` microbatches of memory: least bubble, then least memory."""
    fits = [(b, mem) for b, mem in _blocks(pp, costs) if mem <= cap + 1e-9]
    return min(fits, key=lambda f: (round(_bubble(f[0], costs), 9), f[1]))[0]


def v_min(pp: int, microbatches: int, costs: Costs | None = None) -> Schedule:
    """V-Min: the blocks with the least activation memory; of those the least bubble."""
    costs = costs or Costs()
    least = min(mem for _, mem in _blocks(pp, costs))
    return _least_bubble(pp, costs, least).repeat(microbatches)


def v_half(pp: int, microbatches: int, costs: Costs | None = None) -> Schedule:
    """V-Half: the least bubble within half of 1F1B's memory, (p+2)//2 microbatches."""
    costs = costs or Costs()
    cap = max(half_memory(pp), min(mem for _, mem in _blocks(pp, costs)))
    return _least_bubble(pp, costs, cap).repeat(microbatches)


def min_memory(pp: int) -> int:
    """The paper's V-Min activation memory in microbatches, (p+4)//3 (1F1B: p)."""
    return (pp + 4) // 3


def half_memory(pp: int) -> int:
    """The paper's V-Half activation memory in microbatches, (p+2)//2 (1F1B: p)."""
    return (pp + 2) // 2
