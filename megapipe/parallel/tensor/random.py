"""Dropout RNG under tensor parallelism: Megatron's model-parallel RNG tracker.

Shoeybi et al. 2019, §3: dropout on activations every tp rank holds whole (the residual stream)
must draw the same mask on every rank, so it uses the default generator, seeded alike; dropout
on tp-split activations (attention probabilities of this rank's heads, and with sequence
parallelism this rank's sequence chunk) must draw independent masks, so it runs inside a fork
of the RNG whose state is seeded by (seed, tp_rank). With tp size 1 nothing is forked, so the
single-process model draws exactly what it always drew.
"""

from __future__ import annotations

import contextlib

import torch

from megapipe.parallel.tensor.sharding import NO_TP, TPInfo

TRACKER_SEED_OFFSET = 2718  # Megatron's model-parallel seed offset


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class TPRNGTracker:
    """A separate generator state for tp-split regions, swapped in by `fork()`."""

    def __init__(self, seed: int, tp_rank: int, device_type: str = "cpu") -> None:
        self.device_type = device_type
        saved = _get_state(device_type)
        if device_type == "cuda":
            torch.cuda.manual_seed(seed + TRACKER_SEED_OFFSET + tp_rank)
        else:
            torch.manual_seed(seed + TRACKER_SEED_OFFSET + tp_rank)
        self.state = _get_state(device_type)
        _set_state(device_type, saved)

    @contextlib.contextmanager
    def fork(self):
        """Run the body on the tracker's stream; the default stream is left untouched."""
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self.state)
        try:
            yield
        finally:
            self.state = _get_state(self.device_type)
            _set_state(self.device_type, saved)


def sharded_rng(tp) -> contextlib.AbstractContextManager:
    """The tracker's fork for a tp-split region, or nothing (tp size 1, no tracker)."""
    if tp.size == 1 or tp.rng is None:
        return contextlib.nullcontext()
    return tp.rng.fork()


def replayable(fn, tp):
    """`fn` whose second call (activation recompute) replays the tracker from the first call.

    torch.utils.checkpoint restores the default RNG for the recompute; this does the same for
    the tracker (Megatron's CheckpointFunction restores both) and then puts the tracker back.
    """
    if tp.size == 1 or tp.rng is None:
        return fn
    # the state as the forward found it: generator states are new tensors, never changed in
    # place (fork() and run() rebind them), so no copy is needed; a tensor op here would make
    # a fake tensor under --fake-ranks, which set_rng_state cannot take
    tracker, at_forward, calls = tp.rng, tp.rng.state, [0]

    def run(*args):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*args)
        current, tracker.state = tracker.state, at_forward
        try:
            return fn(*args)
        finally:
            tracker.state = current

    return run


def tp_info(mesh, sequence_parallel: bool = False, seed: int = 0, overlap: bool = False) -> TPInfo:
    """TPInfo of this rank of `mesh` (None: one process), with the dropout RNG tracker seeded by
    (seed, tp_rank); `overlap`: parallel.tp_overlap."""
    if mesh is None or mesh.size("tp") == 1:
        return NO_TP
    tp_rank = mesh.coord("tp")
    rng = TPRNGTracker(seed, tp_rank, mesh.device_type)
    return TPInfo(mesh.size("tp"), tp_rank, mesh.group("tp"), sequence_parallel, rng, overlap)
