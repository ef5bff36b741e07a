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

The agreement carries how long ago the earliest signalled rank got its signal (each rank times
its own, so no clocks are compared). `in_time` is whether the stop's save, as long as the
longest save of this run so far (`timed`), still ends within `checkpoint.preempt_grace_s` of
the signal: the time a launcher waits before it SIGKILLs (torchrun's agent: 30 s,
TORCH_ELASTIC_SHUTDOWN_TIMEOUT; SLURM: KillWait). When it would not, the ranks exit without a
checkpoint rather than be killed half-way through one; resume=auto then takes the newest
earlier checkpoint (a save cut short is never picked anyway: train/checkpoint.py renames a
complete one into place).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

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
        self.stopped_step: int | None = None  # where the loop stopped, saved or not
        self.grace_s = cfg.checkpoint.preempt_grace_s
        self.waited_s = -1.0  # seconds since the earliest signal, as agreed; < 0: none
        self.longest_save_s = 0.0  # this rank's longest checkpoint save of the run (`timed`)
        self._save_s = 0.0  # the longest over the ranks, as agreed
        self._at = 0.0  # time.monotonic() when this rank got its signal
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
            self.received, self._at = signal.Signals(signum), time.monotonic()

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
        waited = time.monotonic() - self._at if self.received is not None else -1.0
        if self.mesh is None or not (dist.is_available() and dist.is_initialized()):
            return self._agree(waited, self.longest_save_s)
        device = torch.device(self.mesh.device_type)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        # both figures as MAX over the ranks, so every rank decides `in_time` alike
        t = torch.tensor([waited, self.longest_save_s], dtype=torch.float64, device=device)
        group = self.mesh.world_group
        if not deferred:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return self._agree(*t.tolist())
        before = self.finish()
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._in_flight = (t, work)
        return before

    def finish(self) -> bool:
        """Wait for a deferred agreement in flight; whether it says stop (False: none)."""
        if self._in_flight is None:
            return False
        t, work = self._in_flight
        self._in_flight = None
        work.wait()
        return self._agree(*t.tolist())  # as of its launch: a step early, the same on every rank

    def _agree(self, waited: float, save_s: float) -> bool:
        self.waited_s, self._save_s = waited, save_s
        return waited >= 0

    def in_time(self) -> bool:
        """Whether the stop's save would end within checkpoint.preempt_grace_s of the signal
        (True without a signal, or with the grace 0: no limit). The same on every rank."""
        if self.waited_s < 0 or self.grace_s <= 0:
            return True
        return self.waited_s + self._save_s <= self.grace_s

    def unsaved_line(self, saved: list[str]) -> str:
        """What rank 0 says when the stop came too late to save (`saved`: complete ones)."""
        return (
            f"stopped at step {self.stopped_step} without a checkpoint: the signal came "
            f"{self.waited_s:.0f} s before and a save takes up to {self._save_s:.0f} s, past "
            f"checkpoint.preempt_grace_s={self.grace_s:g}; run the same command to resume from "
            + (saved[-1] if saved else "the start (no checkpoint yet)")
        )

    @contextlib.contextmanager
    def timed(self):
        """Time a checkpoint save (as long as the step waits for it) for `in_time`."""
        began = time.monotonic()
        yield
        self.longest_save_s = max(self.longest_save_s, time.monotonic() - began)
