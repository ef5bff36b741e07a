"""The gloo probes of this machine's CPU profile (calibrate.py fits them; the compute probes are
probes.py's): two processes (`threads` threads each, harness.spawn) over loopback, each cell
timed over rounds and pooled over both ranks' samples (`pool_samples`: the median, or for the
waits at collectives the mean, MEAN_CELLS, since a step pays their sum).

  links       all-reduce and a batch_isend_irecv ping-pong (as pipeline/p2p.StageLinks posts
              them) of 1 KiB to 16 MiB; α and β fitted to comm.py's ring formula for n = 2
              (2α + S/β; the ring link, `nvlink_*`, which every collective inside the node uses)
              and α + S/β (the p2p link, `p2p_*`).
  blocking    GEMM loops with and without a blocking all-reduce after each GEMM, in short
              alternating pairs, for what a collective costs beyond the aligned one
              (`collective_*`, calibrate.py).
  step        ~0.1 s of GEMMs then a blocking all-reduce, for the wait at a step's
              synchronisations (`step_skew`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import spawn

GLOO_SIZES = [1 << p for p in range(10, 25, 2)]  # 1 KiB .. 16 MiB
BLOCKING_SIZES = [1 << 16, 1 << 18, 1 << 20]  # a small model's tp activations (64 KiB .. 1 MiB)
SKEW_GEMMS = (256, 384, 512, 640, 768)  # n×n GEMMs between the probe's collectives: ~0.5-11 ms
# the step-scale cell: STEP_GEMMS GEMMs of n = STEP_N between two collectives (~0.1 s, a small
# model's compute between a dp step's or a pipeline message's synchronisations), STEP_SYNCS times
STEP_GEMMS, STEP_N, STEP_SYNCS = 8, 768, 8


def _gloo_probes(rounds: int) -> dict:
    """One rank's samples of every gloo probe (run by harness.spawn on two ranks)."""
    rank = dist.get_rank()
    peer = 1 - rank
    seen: dict = {("all_reduce", s): [] for s in GLOO_SIZES}
    seen.update({("p2p", s): [] for s in GLOO_SIZES})

    def exchange(op, x):
        for work in dist.batch_isend_irecv([dist.P2POp(op, x, peer)]):
            work.wait()

    for _ in range(rounds):
        for size in GLOO_SIZES:
            x = torch.ones(size // 4)
            reps = max(3, min(30, int(3e7 // size)))
            for _ in range(reps):
                dist.barrier()
                began = time.perf_counter()
                dist.all_reduce(x)
                seen["all_reduce", size].append(time.perf_counter() - began)
                dist.barrier()
                began = time.perf_counter()
                first, second = (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)
                exchange(first, x)
                exchange(second, x)
                seen["p2p", size].append((time.perf_counter() - began) / 2)  # one way
    seen.update(_blocking_probe(rounds))
    seen.update(_step_sync_probe(rounds))
    return seen


def _blocking_probe(rounds: int, reps: int = 20, pairs: int = 4) -> dict:
    """{("blocking", bytes, n): [s per all-reduce], ("gemm", n): [s per GEMM]}: a tp layer's
    pattern, an n×n GEMM then a blocking all-reduce, timed against the GEMMs alone (both ranks
    computing in both loops, so their sharing of the cores cancels). The difference is what a
    collective costs in training: the isolated all-reduce (the barrier-aligned probe above)
    plus the ranks' arrival skew and the wake-up of the waiting one, which the aligned probe
    cannot see. The GEMM sizes (SKEW_GEMMS) tell the part that grows with the compute between
    two collectives (the skew of ranks sharing cores) from the part that does not.

    Each cell's `reps` are `pairs` short alone/with pairs, one difference each: the machine's
    speed moves within a second, and with one long pair per cell a burst of other work moved a
    cell by milliseconds (a stored profile's n = 640 cells read 1.1, 0.15 and 4.3 ms for 64 KiB,
    256 KiB and 1 MiB); the median over the pairs drops such a pair."""
    seen: dict = {}
    per = max(reps // pairs, 1)

    def loop(a, b, x=None) -> float:
        dist.barrier()
        began = time.perf_counter()
        for _ in range(per):
            torch.mm(a, b)
            if x is not None:
                dist.all_reduce(x)
        return time.perf_counter() - began

    for _ in range(rounds):
        for n in SKEW_GEMMS:
            a, b = torch.randn(n, n), torch.randn(n, n)
            for size in BLOCKING_SIZES:
                x = torch.ones(size // 4)
                for _ in range(pairs):
                    alone = loop(a, b)
                    extra = (loop(a, b, x) - alone) / per
                    seen.setdefault(("blocking", size, n), []).append(extra)
                    seen.setdefault(("gemm", n), []).append(alone / per)
    return seen


def _step_sync_probe(rounds: int) -> dict:
    """{("step_wait",): [s], ("step_compute",): [s]}: the ranks' mean wait at a blocking
    all-reduce after ~0.1 s of GEMMs each, and their mean compute before it, per
    synchronisation. The waits are measured directly (the time inside the all-reduce), not as
    a difference of loops, which at this scale would be noisier than the wait itself; the two
    ranks' figures are summed by one more all-reduce outside the timed part, so each sample is
    the pair's mean."""
    a, b = torch.randn(STEP_N, STEP_N), torch.randn(STEP_N, STEP_N)
    x, pair = torch.ones(BLOCKING_SIZES[0] // 4), torch.zeros(2)
    seen: dict = {("step_wait",): [], ("step_compute",): []}
    dist.barrier()
    for _ in range(rounds * STEP_SYNCS):
        began = time.perf_counter()
        for _ in range(STEP_GEMMS):
            torch.mm(a, b)
        mid = time.perf_counter()
        dist.all_reduce(x)
        pair[0], pair[1] = time.perf_counter() - mid, mid - began
        dist.all_reduce(pair)
        seen["step_wait",].append(pair[0].item() / 2)
        seen["step_compute",].append(pair[1].item() / 2)
    return seen


def probe_gloo(threads: int = 1, rounds: int = 3) -> dict:
    """{("all_reduce" | "p2p", bytes): (median s, min, max)} between two local processes, and
    the blocking and step probes' cells (_blocking_probe, _step_sync_probe), each over both
    ranks' samples."""
    return pool_samples(spawn(2, _gloo_probes, rounds, threads=threads, timeout_s=120))


# Cells whose centre is the mean of their samples, not the median: the waits at collectives
# (the blocking probe's excess, the step probe's wait and the compute it is a fraction of). A
# step pays the sum of its collectives' waits, i.e. their mean, and the waits are heavy-tailed:
# in a tp2 run of the local-truth config, timed per call on both ranks, a 256 KiB all-reduce
# took 1.19 ms at the median and 1.65 ms on average (1 KiB: 0.59 and 1.10 ms); the median
# priced the first, and tp2's step read ~20% over its projection.
MEAN_CELLS = ("blocking", "step_wait", "step_compute")


def pool_samples(per_rank: list[dict]) -> dict:
    """{key: (centre, min, max)} over every rank's samples of the key: the median, or for
    MEAN_CELLS the mean. Both ranks time the same collectives, and the blocking probe's GEMM
    loops differ by which rank the machine's other work lands on, so neither rank alone stands
    for the pair."""
    keys = per_rank[0].keys()
    pooled = {k: [x for seen in per_rank for x in seen[k]] for k in keys}
    return {k: (_centre(k, v), min(v), max(v)) for k, v in pooled.items()}


def _centre(key: tuple, samples: list[float]) -> float:
    return statistics.fmean(samples) if key[0] in MEAN_CELLS else statistics.median(samples)
