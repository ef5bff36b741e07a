"""Ring attention (context parallelism) time per rank against one process, and achieved overlap.

    python -m benchmarks.bench cp [--seq 2048 --batch 1 --heads 8 --kv-heads 8 --head-dim 64
                              --cp 2 4 --repeats 5]

Causal zigzag ring attention, float32, under gloo with one thread per rank; the baseline is
`scaled_dot_product_attention(is_causal=True)` on the whole sequence in one process, one thread.
Definitions (all medians over --repeats timed runs after one warm-up):

- per-rank time: forward + backward of one `ring_attention` call on a rank, slowest rank shown
  (a ring step is as slow as its slowest member).
- compute: per ring step, the time from starting the step's transfer to the end of its block
  kernels (RingStats); summed over the steps of forward and backward.
- exposed wait: per ring step, the time blocked in `Work.wait()` after the compute, summed over
  forward, backward and the last dK/dV hop home: the communication the compute did not cover.
- comm alone: the same transfers (cp−1 kv hops forward; cp−1 kv hops and cp dK/dV hops
  backward) started and waited at once with nothing in between: what they cost unhidden.
- hidden fraction = 1 − exposed wait / comm alone, clipped to [0, 1]: the share of the
  transfer time that double buffering hid behind compute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import spawn
from megapipe.parallel.context.ring import RingComm, RingStats, ring_attention
from megapipe.parallel.context.zigzag import zigzag_shard


def make_inputs(args, seed: int = 0):
    """Full-sequence q (B, H, S, hd), k, v (B, Hkv, S, hd) and the output-grad."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(args.batch, args.heads, args.seq, args.head_dim, generator=g)
               for _ in range(2))  # fmt: skip
    k, v = (torch.randn(args.batch, args.kv_heads, args.seq, args.head_dim, generator=g)
            for _ in range(2))  # fmt: skip
    return q, k, v, dout


def time_one_process(args) -> float:
    """Median fwd+bwd seconds of full causal attention on one process, one thread."""
    torch.set_num_threads(1)
    q, k, v, dout = make_inputs(args)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    gqa, times = args.kv_heads != args.heads, []
    for _ in range(args.repeats + 1):
        began = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).backward(dout)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def _timed_ring(args, rank: int, cp: int, group) -> dict:
    """Median per-rank fwd+bwd seconds and the RingStats split of one ring attention call."""
    q, k, v, dout = (zigzag_shard(t, cp, rank, 2) for t in make_inputs(args))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rows = []
    for _ in range(args.repeats + 1):
        stats = RingStats()
        dist.barrier(group)
        began = time.perf_counter()
        ring_attention(q, k, v, group, stats=stats).backward(dout)
        total = time.perf_counter() - began
        compute = stats.seconds("fwd", "compute") + stats.seconds("bwd", "compute")
        wait = stats.seconds("fwd", "wait") + stats.seconds("bwd", "wait")
        rows.append((total, compute, wait))
    return {key: statistics.median(r[i] for r in rows[1:])
            for i, key in enumerate(("total", "compute", "wait"))}  # fmt: skip


def _comm_alone(args, cp: int, group) -> float:
    """Median seconds of the ring's transfers with no compute between start and wait."""
    kv_shape = (args.batch, args.kv_heads, args.seq // cp, args.head_dim)
    kv = [torch.randn(kv_shape) for _ in range(2)]
    ring, times = RingComm(group, None, torch.device("cpu")), []
    for _ in range(args.repeats + 1):
        dist.barrier(group)
        began = time.perf_counter()
        for _ in range(2 * (cp - 1) + cp):  # kv hops fwd and bwd, dK/dV hops bwd (fp32 both)
            ring.wait(ring.start(kv, 0))
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def _rank_job(args, cp: int) -> dict:
    """This rank's timing dict (run on each of the cp ranks)."""
    group = dist.group.WORLD
    result = _timed_ring(args, dist.get_rank(), cp, group)
    result["comm_alone"] = _comm_alone(args, cp, group)
    return result


def run_ring(args, cp: int) -> list[dict]:
    """Per-rank timing dicts of ring attention on cp spawned gloo ranks."""
    return spawn(cp, _rank_job, args, cp)


def tables(args) -> tuple[str, str]:
    one = time_one_process(args)
    speed = [
        "| cp | per-rank fwd+bwd | one process | one process / cp | speed-up |",
        "|---|---|---|---|---|",
        f"| 1 | {one * 1e3:.1f} ms | {one * 1e3:.1f} ms | {one * 1e3:.1f} ms | 1.00 |",
    ]
    overlap = ["| cp | compute | exposed wait | comm alone | hidden fraction |",
               "|---|---|---|---|---|"]  # fmt: skip
    for cp in args.cp:
        ranks = run_ring(args, cp)
        slow = max(ranks, key=lambda r: r["total"])
        speed.append(f"| {cp} | {slow['total'] * 1e3:.1f} ms | {one * 1e3:.1f} ms | "
                     f"{one / cp * 1e3:.1f} ms | {one / slow['total']:.2f} |")  # fmt: skip
        comm = max(r["comm_alone"] for r in ranks)
        hidden = min(max(1 - slow["wait"] / comm, 0.0), 1.0)
        overlap.append(f"| {cp} | {slow['compute'] * 1e3:.1f} ms | {slow['wait'] * 1e3:.1f} ms | "
                       f"{comm * 1e3:.1f} ms | {hidden:.2f} |")  # fmt: skip
    return "\n".join(speed), "\n".join(overlap)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=2048, help="total sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    for cp in args.cp:
        if args.seq % (2 * cp):
            p.error(f"--seq {args.seq} must be a multiple of 2·cp = {2 * cp} (zigzag)")
    return args


def main(argv=None, prog: str = "python -m benchmarks.bench cp") -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"$ {' '.join([prog, *argv])}\n")
    load = os.getloadavg()[0]  # other processes on the cores skew every number below
    speed, overlap = tables(args)
    print(f"Causal attention fwd+bwd, S={args.seq}, B={args.batch}, H={args.heads}, "
          f"Hkv={args.kv_heads}, hd={args.head_dim}, float32; gloo, 1 thread per rank, "
          f"{os.cpu_count()} cores, load average {load:.1f} before the run:\n")  # fmt: skip
    print(speed)
    print("\nOverlap inside the ring (slowest rank; definitions in benchmarks/bench_cp.py):\n")
    print(overlap)
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.bench_cp"))
