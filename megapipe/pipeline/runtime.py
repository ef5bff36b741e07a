"""One runtime for every schedule: walk this pp rank's action list.

See docs/architecture.md, "Invariants" (one runtime).

F: take the input (token ids on stage 0, else the previous stage's activation), run the chunk,
send the output on; the last stage computes the loss (summed cross entropy over the global token
count, as train/step.train_step). BW: take the output-grad (the last stage starts from its loss),
backward, send the input-grad back. B/W (Zero Bubble, Qi et al. 2023 §2): B backpropagates the
input-grad only while the linear layers queue their weight-grad work, W does that work later.
Sends overlap the next action's compute (Megatron, Narayanan et al. 2021 §4.1); the receive the
next action needs is posted in the same batch. Each action's start and end are recorded. Once an
output is handed to its send, the stash keeps only its autograd node: the (b, T, d) storage goes
with the send (Megatron's deallocate_output_tensor), since backward starts from the received
grad and never reads the output's values.

Which stage a local chunk runs comes from the schedule's `Placement`, so the loop placement of
interleaved 1F1B and the V placement of ZB-V run unchanged. Seq1F1B actions (Sun et al. 2024) run
one sequence segment [s, e) of a microbatch: tokens, positions and messages are the segment's,
and attention reads the earlier segments' K/V kept in a `SegmentKV`
(parallel/autograd/segment_kv.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from megapipe.distributed.progress import NO_PROGRESS, Progress
from megapipe.parallel.autograd.outputs import backward_from, release_values
from megapipe.parallel.autograd.segment_kv import SegmentKV
from megapipe.parallel.autograd.weight_grad import defer_weight_grads, run_weight_grads
from megapipe.pipeline.p2p import StageLinks
from megapipe.plan.actions import FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Placement
from megapipe.plan.messages import Message, received, sent

GRAD_KINDS = (INPUT_GRAD, WEIGHT_GRAD, FULL_BACKWARD)


class MicroBatch(NamedTuple):
    inputs: torch.Tensor  # (b, T) token ids (this cp rank's zigzag slice under cp)
    targets: torch.Tensor  # (b, T) next tokens
    # document masking (parallel/context/documents.py); None: off, positions are the runtime's
    positions: torch.Tensor | None = None  # (b, T) position in its document (cp: the slice)
    documents: torch.Tensor | None = None  # (b, T) document ids of the whole rows (no cp slice)

    def position_ids(self, default: torch.Tensor) -> torch.Tensor:
        """This microbatch's positions: its own per document, else `default` (T/cp,)."""
        return default if self.positions is None else self.positions

    def target_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """log softmax(logits)[target] per token, (b, T) float64, from the whole-vocabulary
        logits (b, T, V): what a scorer sums over a continuation (train/choices.py). The
        log-softmax runs in float64 as tools/evaluate.py's, one row at a time so that only one
        row's float64 copy of the logits is held."""
        rows = [
            torch.log_softmax(row.double(), dim=-1).gather(1, t[:, None]).squeeze(1)
            for row, t in zip(logits, self.targets)
        ]
        return torch.stack(rows)


class Hooks:
    """What a driver may add to each action (PipeDream, pipedream.py): the weights its compute
    runs under, and work after its sends are posted (the per-microbatch optimizer step).
    These defaults add nothing."""

    def weights(self, action: Action) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after(self, action: Action) -> None:
        return None


NO_HOOKS = Hooks()


@dataclass
class Event:
    """One executed action and its wall-clock span (perf_counter seconds)."""

    action: Action
    t0: float
    t1: float
    wait: float = 0.0  # of t1 - t0, seconds spent waiting for the input to arrive (at the start)


class PipelineRuntime:
    """Runs one rank's action list over its local chunks; holds only what backward still needs."""

    def __init__(
        self,
        chunks: list[nn.Module],
        placement: Placement,
        pp_rank: int,
        links: StageLinks,
        positions: torch.Tensor,
        autocast=contextlib.nullcontext,
        segments: list[tuple[int, int]] | None = None,
        progress: Progress = NO_PROGRESS,
    ) -> None:
        """`progress`: this rank's record, each action written to it before it runs
        (distributed/progress.py)."""
        self.chunks, self.placement, self.links = chunks, placement, links
        self.progress = progress
        self.stages = [placement.stage(pp_rank, c) for c in range(len(chunks))]
        self.last_stage = placement.num_stages - 1
        self.autocast = autocast
        self.positions = positions  # this cp rank's (all under cp=1); SP stages hold T/tp of it
        self.segments = segments or [(0, len(positions))]  # Seq1F1B: [(s_i, e_i)]
        self.events: list[Event] = []
        self._handlers = {
            FORWARD: self._forward,
            INPUT_GRAD: self._input_grad,
            FULL_BACKWARD: self._backward,
            WEIGHT_GRAD: self._weight_grad,
        }

    def run(
        self,
        actions: list[Action],
        micro: list[MicroBatch],
        loss_scale: float,
        reducers: list | None = None,
        arrivals: dict | None = None,
        hooks: Hooks = NO_HOOKS,
    ) -> torch.Tensor:
        """Execute `actions`; returns this rank's summed (unscaled) loss, float64 (0 if no head).

        `reducers[c]` (dp gradient buckets of chunk c) syncs only during the chunk's last
        gradient action, so its buckets all-reduce while that backward still runs.
        `arrivals` (channels.arrival_order): the order each peer sends in, for tagless matching.
        `hooks`: a driver's additions to each action (Hooks).
        """
        self.micro, self.loss_scale = micro, loss_scale
        self.links.expect(arrivals)
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.stash: dict[tuple[int, ...], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.kv: dict[tuple[int, int], SegmentKV] = {}  # Seq1F1B: per (microbatch, chunk)
        self.events, self.deferred_matmuls = [], 0
        final = {a.chunk: i for i, a in enumerate(actions) if a.kind in GRAD_KINDS}
        for i, action in enumerate(actions):
            reducer = reducers[action.chunk] if reducers else None
            sync = None
            if reducer is not None:  # a forward makes no grads: it never syncs
                grads = action.kind in GRAD_KINDS
                sync = reducer.backward_of(final[action.chunk] == i) if grads else reducer.no_sync()
            t0, waited = time.perf_counter(), self.links.waited
            chunk = action.chunk if len(self.chunks) > 1 else -1
            self.progress.doing(action.kind, action.microbatch, chunk)
            with sync or contextlib.nullcontext(), hooks.weights(action):
                sends = self._handlers[action.kind](action)
            following = self._input_message(actions[i + 1]) if i + 1 < len(actions) else None
            # Send now, and post the receive the next action needs in the same batch.
            self.links.exchange(sends, [following] if following else [])
            del sends  # a sent output is the link's until its send is done, not held past it
            hooks.after(action)
            self.events.append(Event(action, t0, time.perf_counter(), self.links.waited - waited))
        self.links.flush()
        if self.stash or self.kv:
            raise RuntimeError(
                f"actions left activations without backward: {sorted(self.stash) + sorted(self.kv)}"
            )
        return self.loss_sum

    def _input_message(self, a: Action) -> Message | None:
        """What `a` must receive: the previous stage's activation or the next stage's grad."""
        return received(a, self.stages[a.chunk], self.last_stage)

    def _output_message(self, a: Action) -> Message | None:
        """What `a` sends when done: its activation onward or its input-grad back."""
        return sent(a, self.stages[a.chunk], self.last_stage)

    def _tokens(self, a: Action) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs, targets (b, n) and positions (n,) of `a`: a segment's [s, e) or all."""
        micro = self.micro[a.microbatch]
        positions = micro.position_ids(self.positions)
        if a.segment is None:
            return micro.inputs, micro.targets, positions
        s, e = self.segments[a.segment]
        return micro.inputs[:, s:e], micro.targets[:, s:e], positions[..., s:e]

    def _kv(self, a: Action) -> SegmentKV | None:
        """The kept K/V of `a`'s microbatch and chunk when its sequence is in segments."""
        if a.segment is None or len(self.segments) == 1:
            return None
        key = (a.microbatch, a.chunk)
        if key not in self.kv:
            starts = tuple(s for s, _ in self.segments)
            targets = self.micro[a.microbatch].targets  # (b, T): MTP reads past the segment
            self.kv[key] = SegmentKV(len(starts), self.segments[-1][1], starts, targets)
        return self.kv[key]

    def _forward(self, a: Action) -> list[tuple[Message, torch.Tensor]]:
        stage, (x, targets, positions) = self.stages[a.chunk], self._tokens(a)
        # x: (b, T) token ids on stage 0, else the (b, T[/tp], d) activation (T: the segment's)
        if stage > 0:
            x = self.links.take(self._input_message(a)).requires_grad_()
        last = stage == self.last_stage
        kv = self._kv(a)
        with self.autocast():
            out = self.chunks[a.chunk](
                x,
                targets=targets if last else None,
                positions=positions,
                segment=kv.scope(a.seg) if kv else None,
                documents=self.micro[a.microbatch].documents,
            )
        if last:  # summed CE over this microbatch; backward starts from sum / global tokens
            self.loss_sum += out.detach()
            out = out / self.loss_scale
        values = out.detach()  # shares the storage, which the send (or the next chunk) holds
        if not last:
            release_values(out)
        self.stash[a.unit] = (x if stage > 0 else None, out)
        return [] if last else [(self._output_message(a), values)]

    def _backward(self, a: Action) -> list[tuple[Message, torch.Tensor]]:
        x, out = self.stash.pop(a.unit)
        message = self._input_message(a)
        grad = None if message is None else self.links.take(message)
        kv = self._kv(a)
        if kv is None:
            backward_from(out, grad)
        else:  # also from the K/V later segments read; segment 0 is the last to run
            kv.backward(a.seg, out, grad)
            if kv.empty:
                del self.kv[(a.microbatch, a.chunk)]
        return [] if x is None else [(self._output_message(a), x.grad)]

    def _input_grad(self, a: Action) -> list[tuple[Message, torch.Tensor]]:
        with defer_weight_grads(self.chunks[a.chunk], a.unit):
            return self._backward(a)

    def _weight_grad(self, a: Action) -> list[tuple[Message, torch.Tensor]]:
        self.deferred_matmuls += run_weight_grads(self.chunks[a.chunk], a.unit)
        return []
