"""The cost of each rank's progress record (megapipe/distributed/progress.py) against a step.

    python -m benchmarks.bench progress [--layers 4 --d-model 256 --seq-len 128 --steps 8]

1. One update in this process, timed over many calls: `doing` (a pipeline action), a wait and
   its end (`wait` + `waited`), with the record open and with NO_PROGRESS (nothing recorded).
2. Real training steps (train/build.py's job, the pipeline runtime, the step core) in a gloo
   world of two spawned processes, pp=2 then dp=2, each rank's mesh carrying a recorder that
   counts its updates: updates per step × the cost of one, against the measured step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.harness import ROOT, add_model_args, echo_command, spawn, write_json
from megapipe.config import load_config
from megapipe.data.loader import build_data
from megapipe.distributed.mesh import MeshSizes, ParallelMesh, coords
from megapipe.distributed.progress import NO_PROGRESS, Progress
from megapipe.train.build import build

COORDS = {"pp": 0, "dp": 0, "cp": 0, "tp": 0}


class Counted(Progress):
    """A recorder that also counts its updates."""

    updates = 0

    def doing(self, what: str, microbatch: int = -1, chunk: int = -1) -> None:
        self.updates += 1
        super().doing(what, microbatch, chunk)

    def wait(self, what: str, peer: int = -1, microbatch: int = -1, group: str = "") -> None:
        self.updates += 1
        super().wait(what, peer, microbatch, group)

    def waited(self) -> None:
        self.updates += 1
        super().waited()


def per_update_ns(calls: int, rounds: int) -> dict[str, float]:
    """Median nanoseconds of one update of each kind, open and NO_PROGRESS."""
    p = Progress(0, 1, COORDS, 600.0)
    p.open(tempfile.mkdtemp())
    cases = {
        "doing": lambda q: q.doing("F", 3, 1),
        "wait + waited": lambda q: (q.wait("recv F", 1, 3), q.waited()),
    }
    out = {}
    try:
        for name, fn in cases.items():
            for label, q in (("open", p), ("NO_PROGRESS", NO_PROGRESS)):
                times = []
                for _ in range(rounds):
                    began = time.perf_counter()
                    for _ in range(calls):
                        fn(q)
                    times.append((time.perf_counter() - began) / calls * 1e9)
                out[f"{name} ({label})"] = statistics.median(times)
    finally:
        p.close()
    return out


def make_config(args, pp: int, dp: int):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}", f"train.global_batch={args.batch}",
        f"train.steps={args.warmup + args.steps}", f"parallel.pp={pp}", f"parallel.dp={dp}",
        f"parallel.microbatches={args.microbatches}", f"run.dir={tempfile.mkdtemp()}",
    ])  # fmt: skip


def measure(args, pp: int, dp: int) -> dict:
    """On each rank: the median step seconds and the recorder's updates per step."""
    cfg = make_config(args, pp, dp)
    sizes, rank = MeshSizes(pp=pp, dp=dp), dist.get_rank()
    progress = Counted(rank, sizes.world, coords(rank, sizes), cfg.parallel.timeout_s)
    progress.open(cfg.run.dir)
    torch.manual_seed(cfg.train.seed)
    job = build(cfg, ParallelMesh(sizes, progress=progress), "cpu")
    optimizer, data = job.optimizer(), build_data(cfg.data, cfg.model, cfg.train.seed)
    times, updates = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        before, began = progress.updates, time.perf_counter()
        job.train_step(optimizer, data.batch(i, cfg.train.global_batch), i)
        times.append(time.perf_counter() - began)
        updates.append(progress.updates - before)
    progress.close()
    return {"step_s": statistics.median(times[args.warmup :]), "updates": max(updates)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, vocab=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mesh")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calls", type=int, default=200_000, help="updates per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="also write the figures here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    echo_command("progress", argv)
    torch.set_num_threads(1)
    ns = per_update_ns(args.calls, args.rounds)
    print(f"1. One update, median of {args.rounds} rounds of {args.calls:,} calls:\n")
    print("| update | ns |\n|---|---:|")
    for name, value in ns.items():
        print(f"| {name} | {value:.0f} |")
    cost = max(ns["doing (open)"], ns["wait + waited (open)"] / 2) * 1e-9  # s per update
    print(
        f"\n2. Training steps ({args.layers} layers, d={args.d_model}, seq {args.seq_len}, "
        f"global batch {args.batch}, {args.microbatches} microbatches; gloo, 2 processes, "
        f"{os.cpu_count()} cores), median of {args.steps} after {args.warmup}; the record's "
        f"cost = updates × {cost * 1e9:.0f} ns:\n"
    )
    print("| mesh | rank | step ms | updates / step | record µs / step | share of the step |")
    print("|---|---:|---:|---:|---:|---:|")
    result = {"args": vars(args), "per_update_ns": ns, "meshes": {}}
    for pp, dp in ((2, 1), (1, 2)):
        ranks = spawn(2, measure, args, pp, dp)
        result["meshes"][f"pp{pp}_dp{dp}"] = ranks
        for rank, r in enumerate(ranks):
            spent = r["updates"] * cost
            print(
                f"| pp={pp} dp={dp} | {rank} | {r['step_s'] * 1e3:.1f} | {r['updates']} | "
                f"{spent * 1e6:.1f} | {spent / r['step_s']:.2e} |"
            )
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
