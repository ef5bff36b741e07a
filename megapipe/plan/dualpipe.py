"""DualPipe and DualPipeV (DeepSeek-V3, Liu et al. 2024, arXiv 2412.19437 §3.2.1).

DualPipe feeds microbatches from both ends of the pipeline and overlaps the forward of one chunk
with the backward of another (an F&B pair, which hides the other's communication). Its model is
cut into pp stages, each held twice (`Placement` "dual": parameters 2×): rank r runs stage r for
the microbatches going down and stage pp−1−r for those going up. DualPipeV, the "cut in half"
variant, folds the two directions into the two arms of ZB-V's V (Qi et al. 2024) on pp ranks of
a 2·pp-stage model: rank r holds stage r as chunk 0 (the way down) and stage 2·pp−1−r as chunk 1
(the way up), each parameter once, and every microbatch enters at rank 0. DualPipeV's per-rank
order is the one torch.distributed.pipelining's `ScheduleDualPipeV` defines (after
deepseek-ai/DualPipe), which a test holds equal; DualPipe's rank r runs DualPipeV's order for
pp/2 ranks at its distance from the nearer end, min(r, pp−1−r), its logical chunks swapped on
the second half of the ranks (the two halves mirror each other, as in deepseek-ai/DualPipe).

A pair is marked on its forward (`Action.pair`): the simulator starts it once both inputs are
there and, with `Costs.FB`, prices it as one overlapped unit (DeepSeek's pair hides the
expert-parallel all-to-all and p2p of each half under the other's compute). The runtime, on
gloo and NCCL alike, runs the pair's F then its backward in turn, as torch's runtime runs
OVERLAP_F_B without a custom function: its p2p is already asynchronous (sends overlap the next
action, the next receive is posted with them), and it has no all-to-all inside a chunk to hide,
so nothing is overlapped beyond what every action gets; the F does not wait for the backward's
input, so the runtime can only start a pair earlier than the simulation does. The two copies of
a DualPipe stage train as one (pipeline/dual.py).
"""

from __future__ import annotations

from megapipe.plan.actions import FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Schedule


class _RankOrder:
    """One rank's list being built: the next microbatch per (chunk, F | backward) and the W's
    owed by split backwards, oldest first."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.owed: list[tuple[int, int]] = []

    def _take(self, kind: str, chunk: int) -> int:
        mb = self.next.get((kind, chunk), 0)
        self.next[kind, chunk] = mb + 1
        return mb

    def forward(self, chunk: int, pair: bool = False) -> None:
        self.actions.append(Action(FORWARD, self._take(FORWARD, chunk), chunk, pair=pair))

    def backward(self, chunk: int, split: bool = False) -> None:
        """BW, or B with its W owed (Zero Bubble's split, Qi et al. 2023)."""
        mb = self._take(FULL_BACKWARD, chunk)
        self.actions.append(Action(INPUT_GRAD if split else FULL_BACKWARD, mb, chunk))
        if split:
            self.owed.append((mb, chunk))

    def weight(self) -> None:
        """The oldest owed W, if any."""
        if self.owed:
            mb, chunk = self.owed.pop(0)
            self.actions.append(Action(WEIGHT_GRAD, mb, chunk))

    def pair(self, forward_chunk: int, backward_chunk: int) -> None:
        """An F&B pair: a forward overlapped with a full backward of the other chunk."""
        self.forward(forward_chunk, pair=True)
        self.backward(backward_chunk)


def dualpipe_v(pp: int, microbatches: int) -> Schedule:
    """DualPipeV on the V placement; needs microbatches >= 2·pp (the V's stage count)."""
    if microbatches < 2 * pp:
        raise ValueError(f"dualpipe_v needs microbatches >= 2*pp ({2 * pp}), got {microbatches}")
    return {r: _dualpipe_v_rank(pp, microbatches, r) for r in range(pp)}


def dualpipe(pp: int, microbatches: int) -> Schedule:
    """DualPipe on the "dual" placement: an even pp, an even number of microbatches >= 2·pp,
    half of them (the even ones) entering at rank 0, the other half at rank pp−1."""
    if pp % 2 or microbatches % 2 or microbatches < 2 * pp:
        raise ValueError(
            f"dualpipe needs an even pp and an even microbatches >= 2*pp, got pp={pp} "
            f"microbatches={microbatches}"
        )
    schedule = {}
    for r in range(pp):
        half, second = min(r, pp - 1 - r), int(r >= pp // 2)
        # logical chunk c is direction c ^ second; a direction's k-th microbatch is 2k + dir
        schedule[r] = [
            a._replace(microbatch=2 * a.microbatch + (a.chunk ^ second), chunk=a.chunk ^ second)
            for a in _dualpipe_v_rank(pp // 2, microbatches // 2, half)
        ]
    return schedule


def _dualpipe_v_rank(pp: int, m: int, r: int) -> list[Action]:
    o, down, up = _RankOrder(), 0, 1
    # warm-up: fill the way down, then alternate down and up forwards
    for _ in range(2 * (pp - r - 1)):
        o.forward(down)
    for _ in range(r + 1):
        o.forward(down)
        o.forward(up)
    # the first backwards of the up arm, split (zero bubble): B, its W at once, F
    for _ in range(pp - r - 1):
        o.backward(up, split=True)
        o.weight()
        o.forward(up)
    # steady state: F down & BW up, then F up & BW down (the last rank's first one unpaired,
    # which shortens the bubble, as DeepSeek's code does)
    for i in range(m - 2 * pp + r + 1):
        if i == 0 and r == pp - 1:
            o.forward(down)
            o.backward(up)
        else:
            o.pair(down, up)
        o.pair(up, down)
    # cool-down: forwards run out; up backwards alone, each with a paired down backward
    for _ in range(pp - r - 1):
        o.backward(up)
        o.pair(up, down)
    # drain: both arms' backwards, the second half split so that W's fill the tail
    split, half = False, (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        o.backward(up, split)
        split = split or (i == half and r % 2 == 0)
        o.backward(down, split)
    for _ in range(pp - r - 1):
        o.weight()
        o.backward(down, split)
    for _ in range(r + 1):
        o.weight()
    return o.actions
