"""Where a training step's matmul time goes: every matmul of a few steps (megapipe eager, or
transformers as `bench.py train` steps it), grouped by shape and strides, with its time per
step, its rate and the page faults taken inside it.

Each aten mm / addmm / addmm_ call is timed on its own under a dispatch mode, and the process's
minor page faults (getrusage) are read around it. A rate well below the same matmul's alone,
with faults beside it, is a matmul writing into memory the kernel had to hand out fresh:
parallel/autograd/kept_buffers.py says why that happens on the CPU and what megapipe does.

    python -m benchmarks.bench matmuls [--preset default|124m|...] [--variant eager|transformers]
        [--steps 3 --threads 2] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from benchmarks import bench_train
from megapipe._torch_compat import DispatchMode

MATMULS = ("mm", "addmm", "addmm_")


class MatmulLog(DispatchMode):
    """Per (op, operand shapes and strides, out= given): calls, seconds, FLOPs, page faults."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = collections.defaultdict(lambda: [0, 0.0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in MATMULS:
            return func(*args, **kwargs)
        faults, began = bench_train.minor_faults(), time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - began
        mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2][-2:]
        key = (name, tuple((tuple(m.shape), m.stride()) for m in mats), "out" in kwargs)
        row = self.rows[key]
        row[0] += 1
        row[1] += seconds
        row[2] += 2 * mats[0].shape[0] * mats[0].shape[1] * mats[1].shape[1]
        row[3] += bench_train.minor_faults() - faults
        return out


def report(log: MatmulLog, steps: int, top: int) -> None:
    rows = sorted(log.rows.items(), key=lambda kv: -kv[1][1])
    total = sum(r[1] for r in log.rows.values()) / steps
    print(f"matmuls: {1e3 * total:.1f} ms per step over {len(rows)} kinds")
    print("| op | A (shape, strides) | B (shape, strides) | out= | calls/step | ms/step "
          "| GFLOP/s | page faults/step |")  # fmt: skip
    print("|---" * 8 + "|")
    for (name, mats, out), (calls, seconds, flops, faults) in rows[:top]:
        a, b = (f"{s} {st}" for s, st in mats)
        print(f"| {name} | {a} | {b} | {'yes' if out else ''} | {calls // steps} | "
              f"{1e3 * seconds / steps:.1f} | {flops / seconds / 1e9:.0f} | "
              f"{faults // steps} |")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="124m", choices=sorted(bench_train.PRESETS))
    parser.add_argument("--variant", default="eager", choices=["eager", "transformers"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape_args = argparse.Namespace(device="cpu", dtype=None, layers=0, d_model=0, heads=0,
                                    vocab=0, batch=0, seq_len=0)  # fmt: skip
    shape = bench_train.shape_of(args.preset, shape_args)
    runner = bench_train.make_runner(args.variant, shape, argparse.Namespace(rounds=1, steps=1))
    batch = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len + 1))
    for _ in range(2):  # warm-up: optimizer state, kept buffers, allocator
        runner.step(batch)
    with MatmulLog() as log:
        for _ in range(args.steps):
            runner.step(batch)
    print(f"{args.variant}, preset {args.preset}: batch {shape.batch} x seq {shape.seq_len}, "
          f"{args.threads} threads, {args.steps} steps")  # fmt: skip
    report(log, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
