"""Preemption: the signals in `checkpoint.signals` (a cluster's SIGTERM, SLURM's early SIGUSR1)
stop the run at the next step boundary with a checkpoint, as docs/architecture.md says.

While a run lasts, `StopSignals` replaces those signals' handlers with one that only records the
signal (no work in a handler: it may interrupt anything, a save or a collective included). After
every step `agreed` asks every rank with one tiny all-reduce (MAX of a 0/1 flag over the world
group), so all ranks stop after the same step even when only one was signalled, and none waits in
a collective the others skipped. The previous handlers come back when the run ends.

Under `parallel.post_validation` (Zero Bubble §4) no collective may join the ranks between two
steps, or the next step's warm-up could not overlap this one's cool-down: the agreement is then
launched in the background after each step and read after the next (`agreed(deferred=True)`),
so a signal stops the run one step later; `finish` waits for the last one in flight.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.config.checks import signal_names


class StopSignals:
    """A context manager over a run: the handlers of `checkpoint.signals`, the flag they set, and
    the one agreement per step. `saved_step` is set by the loop when it stopped with a save."""

    def __init__(self, cfg: Config, mesh=None) -> None:
        self.signals = [signal.Signals[name] for name in signal_names(cfg.checkpoint.signals)]
        self.mesh = mesh  # None: one process, no agreement to reach
        self.received: signal.Signals | None = None  # the first stop signal seen by this rank
        self.saved_step: int | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._in_flight: tuple[torch.Tensor, object] | None = None  # a deferred agreement

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only; nothing to install
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            # None: the handler was not set from Python; the default is the closest we can restore
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        """Only record the signal: the loop acts at the next step boundary."""
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def enabled(self) -> bool:
        return bool(self.signals)

    def agreed(self, deferred: bool = False) -> bool:
        """Whether any rank received a stop signal; every rank calls it once per step, after the
        step (the same call on every rank, as `checkpoint.signals` is the same config).
        `deferred`: the answer of the agreement launched after the previous step; this step's
        is launched in the background (see the module docstring)."""
        if not self.enabled:
            return False
        flag = self.received is not None
        if self.mesh is None or not (dist.is_available() and dist.is_initialized()):
            return flag
        device = torch.device(self.mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        group = self.mesh.world_group
        if not deferred:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return bool(t.item())
        before = self.finish()
        self._in_flight = (t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True))
        return before

    def finish(self) -> bool:
        """Wait for a deferred agreement in flight; whether it says stop (False: none)."""
        if self._in_flight is None:
            return False
        t, work = self._in_flight
        self._in_flight = None
        work.wait()
        return bool(t.item())
