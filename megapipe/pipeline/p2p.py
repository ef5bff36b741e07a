"""Tensors between pipeline stages: batched isend/irecv to other pp ranks, hand-off on one rank.

Every tensor that crosses a stage boundary is a `Message` (plan/messages.py: the one rule of what
each action sends and needs). Its shape is known from the config (per segment
under Seq1F1B), so receives are posted ahead (prefetch) into fresh buffers and sends are
fire-and-forget, waited lazily at the end of the step (Megatron's p2p_communication, Narayanan
et al. 2021 §4.1: batched isend/irecv overlapped with compute). When both stages sit on one rank
(the turn of ZB-V's V, Qi et al. 2024 §4) the tensor is handed over in memory, no p2p.

Messages carry no tag, as under NCCL, which matches the k-th send between two ranks with the
k-th receive: the receiver must post its receives in the order the sender sends. Every rank knows
the whole schedule, so `expect` takes, per source rank, the order that rank sends in
(channels.arrival_order), and asking for a message posts the receives due before it too, into
fresh buffers (interleaved schedules consume some messages out of their send order). Gloo, with
one tag, matches in the same order, so the CPU tests run exactly the matching NCCL will.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from megapipe.distributed.mesh import rank_at
from megapipe.plan.actions import Placement
from megapipe.plan.messages import Message

# Tags of the exchanges outside the schedule's messages (which go untagged, 0), so a grad swap
# never matches a pipeline message posted to the same peer.
TIED_TAG = 1 << 30  # the tied embedding's two copies (tied.py)
TWIN_TAG = (1 << 30) + 1  # dualpipe's two copies of each stage (dual.py)


def swap_with_pp_peer(tensor: torch.Tensor, peer_pp: int, mesh, tag: int) -> torch.Tensor:
    """Send `tensor` to the rank at pp coordinate `peer_pp` (same dp, cp, tp) and return the
    tensor of the same shape it sends back: one batched isend/irecv pair."""
    peer = rank_at(mesh.sizes, **{**mesh.coords, "pp": peer_pp})
    theirs = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, peer, tag=tag),
        dist.P2POp(dist.irecv, theirs, peer, tag=tag),
    ]
    mesh.progress.wait("swap tied grads" if tag == TIED_TAG else "swap twin grads", peer)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    mesh.progress.waited()
    return theirs


class StageLinks:
    """This rank's p2p endpoints: prefetched receives, pending sends, the local mailbox."""

    def __init__(
        self,
        mesh,
        placement: Placement,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        segments: tuple[int, ...] = (),
    ) -> None:
        """`shape`: (b, T, d) of a message; `segments`: Seq1F1B's local T of each segment."""
        self.placement, self.shape, self.dtype, self.device = placement, shape, dtype, device
        self.segments = segments
        self.pp_rank = mesh.coord("pp")
        self.progress = mesh.progress  # each wait recorded (distributed/progress.py)
        self.peers = [
            rank_at(mesh.sizes, **{**mesh.coords, "pp": r}) for r in range(mesh.size("pp"))
        ]  # global rank of each pp rank
        self.receiving: dict[Message, tuple[torch.Tensor, list]] = {}
        self.sending: list[tuple[torch.Tensor, list]] = []
        self.local: dict[Message, torch.Tensor] = {}
        self.arrivals: dict[int, deque[Message]] = {}  # source pp rank -> messages due, in order
        self.waited = 0.0  # seconds spent in `take` waiting for receives (runtime events)

    def _rank_of(self, stage: int, microbatch: int) -> int:
        """The pp rank holding `stage` (for DualPipe's two copies: `microbatch`'s direction)."""
        return self.placement.locate(stage, microbatch)[0]

    def expect(self, arrivals: dict[int, list[Message]] | None) -> None:
        """The order each source rank sends in this step (None: receives posted on demand)."""
        self.arrivals = {src: deque(msgs) for src, msgs in (arrivals or {}).items()}

    def _due(self, msg: Message) -> list[Message]:
        """`msg` and every message its sender sends before it that is not yet posted."""
        src = self._rank_of(msg.source_stage(), msg.microbatch)
        queue = self.arrivals.get(src)
        if not queue:
            return [msg]
        due = []
        while queue:
            due.append(queue.popleft())
            if due[-1] == msg:
                return due
        raise RuntimeError(f"pipeline receive {msg} is not in rank {src}'s send order")

    def _shape(self, msg: Message) -> tuple[int, ...]:
        if msg.segment is None:
            return self.shape
        return (self.shape[0], self.segments[msg.segment], *self.shape[2:])  # (b, n_i, d)

    def is_local(self, msg: Message) -> bool:
        return self._rank_of(msg.source_stage(), msg.microbatch) == self._rank_of(
            msg.dest_stage(), msg.microbatch
        )

    def exchange(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> None:
        """Post the sends and (not yet posted) receives as one batch; local ones go to memory."""
        ops, posted = [], []
        for msg, tensor in sends:
            if self.is_local(msg):
                self.local[msg] = tensor
                continue
            peer = self.peers[self._rank_of(msg.dest_stage(), msg.microbatch)]
            ops.append(dist.P2POp(dist.isend, tensor, peer))
            posted.append((None, tensor))
        for msg in recvs:
            if self.is_local(msg) or msg in self.receiving:
                continue
            for due in self._due(msg):
                buf = torch.empty(self._shape(due), dtype=self.dtype, device=self.device)
                peer = self.peers[self._rank_of(due.source_stage(), due.microbatch)]
                ops.append(dist.P2POp(dist.irecv, buf, peer))
                posted.append((due, buf))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for (msg, tensor), work in zip(posted, works):
            if msg is None:
                self.sending.append((tensor, [work]))
            else:
                self.receiving[msg] = (tensor, [work])
        self._reap()

    def take(self, msg: Message) -> torch.Tensor:
        """The tensor of `msg`: from the mailbox, or wait for its (posted if need be) receive."""
        if self.is_local(msg):
            return self.local.pop(msg)
        self.exchange([], [msg])
        buf, works = self.receiving.pop(msg)
        began = time.perf_counter()
        peer = self.peers[self._rank_of(msg.source_stage(), msg.microbatch)]
        self.progress.wait("recv B" if msg.grad else "recv F", peer, msg.microbatch)
        for work in works:
            work.wait()
        self.progress.waited()
        self.waited += time.perf_counter() - began
        self._reap()  # sends done while this waited free their buffers before the action runs
        return buf

    def _reap(self) -> None:
        """Drop finished sends, freeing their buffers (the output is only kept for backward)."""
        self.sending = [(t, w) for t, w in self.sending if not all(x.is_completed() for x in w)]

    def flush(self) -> None:
        """Wait for every send: end of step, before any buffer could be reused."""
        self.progress.wait("send (end of step)")
        for _, works in self.sending:
            for work in works:
                work.wait()
        self.progress.waited()
        self.sending.clear()
        if self.receiving or self.local:
            raise RuntimeError(
                f"pipeline step ended with unconsumed messages: "
                f"{sorted(self.receiving) + sorted(self.local)}"
            )
