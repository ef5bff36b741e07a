"""Per-channel message order: what a backend that ignores p2p tags (NCCL) needs from a schedule.

NCCL has no tags: between one sender and one receiver, the k-th send matches the k-th receive.
The runtime sends in its action order (outputs as produced) and consumes in its action order (the
input of the next action). Where, for a directed pair of ranks, those two orders differ
(`fifo_mismatch`: interleaved 1F1B and ZB-V for some m), the receiver posts its receives in the
sender's order instead (`arrival_order`, p2p.StageLinks.expect) and holds early arrivals.
Messages between two stages on one rank (ZB-V's turn) are handed over in memory and take no
channel.
"""

from __future__ import annotations

from collections import defaultdict

from megapipe.plan.actions import Placement, Schedule
from megapipe.plan.messages import Message, received, sent


def channel_orders(schedule: Schedule, placement: Placement) -> tuple[dict, dict]:
    """({(src, dst): messages in send order}, {(src, dst): messages in receive order});
    messages between two stages of one rank take no channel."""
    last = placement.num_stages - 1
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, actions in schedule.items():
        for a in actions:
            stage = placement.stage(rank, a.chunk)
            if (msg := sent(a, stage, last)) is not None:
                peer = placement.locate(msg.dest_stage(), msg.microbatch)[0]
                if peer != rank:
                    sends[(rank, peer)].append(msg)
            if (msg := received(a, stage, last)) is not None:
                peer = placement.locate(msg.source_stage(), msg.microbatch)[0]
                if peer != rank:
                    recvs[(peer, rank)].append(msg)
    return dict(sends), dict(recvs)


def fifo_mismatch(schedule: Schedule, placement: Placement) -> str | None:
    """None when every rank pair's receive order equals its send order; else the first
    mismatch, one line (rank pair, position, the two messages)."""
    sends, recvs = channel_orders(schedule, placement)
    for pair in sorted(set(sends) | set(recvs)):
        out, got = sends.get(pair, []), recvs.get(pair, [])
        for i, (s, r) in enumerate(zip(out, got)):
            if s != r:
                return (
                    f"ranks {pair[0]}->{pair[1]}: message {i} sent {_text(s)} but received "
                    f"{_text(r)}"
                )
        if len(out) != len(got):
            return f"ranks {pair[0]}->{pair[1]}: {len(out)} sends but {len(got)} receives"
    return None


def _text(msg: Message) -> tuple:
    """(act | grad, microbatch, segment, boundary): a message as the mismatch line prints it."""
    seg = 0 if msg.segment is None else msg.segment
    return ("grad" if msg.grad else "act", msg.microbatch, seg, msg.boundary)


def arrival_order(schedule: Schedule, placement: Placement, rank: int) -> dict[int, list[Message]]:
    """{source rank: the messages it sends to `rank`, in its send order}: the order in which
    `rank` must post its receives when matching ignores tags (p2p.StageLinks.expect)."""
    sends, _ = channel_orders(schedule, placement)
    return {src: msgs for (src, dst), msgs in sends.items() if dst == rank}
