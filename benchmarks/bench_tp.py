"""Tensor-parallel communication per layer and data-parallel step-time overhead.

    python -m benchmarks.bench tp [--batch 4 --seq-len 64 --d-model 128 --steps 5]

1. Bytes each transformer layer communicates per training step under tp (gloo workers, one
   thread each), counted by megapipe.distributed.collectives.COUNTER, against Megatron's
   count (Shoeybi et al. 2019, §3): 4 all-reduces of B·s·h per layer per step (2 fwd, 2 bwd);
   with sequence parallelism (Korthikanti et al. 2022, §4.2.2) 4 all-gathers + 4
   reduce-scatters of B·s·h, the same volume. Per layer = (count at 4 layers − at 2) / 2.
2. Step time of dp=2 (2 processes) against one process on the same global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist

from benchmarks.harness import ROOT, spawn
from megapipe.config import load_config


def make_config(args, n_layers: int, overrides=()):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={n_layers}", f"model.d_model={args.d_model}", "model.n_heads=8",
        f"model.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
        "model.vocab_size=256", f"run.dir={tempfile.mkdtemp()}", "log.progress=false", *overrides,
    ])  # fmt: skip


def _count_step(args, n_layers: int, tp_overrides) -> dict:
    """{(phase, op): bytes} of one training step on this rank."""
    from megapipe.data.loader import build_data
    from megapipe.distributed import collectives
    from megapipe.distributed.launch import init_distributed
    from megapipe.parallel.tensor.grad_sync import sync_tp_partial_grads
    from megapipe.pipeline.stages import build_model
    from megapipe.train.batches import split_inputs
    from megapipe.train.optim import build_optimizer

    cfg = make_config(args, n_layers, tp_overrides)
    model = build_model(cfg, init_distributed(cfg))
    build_optimizer(model, cfg.train)
    inputs, targets = split_inputs(build_data(cfg.data, cfg.model, 0).batch(0, args.batch))
    counts = Counter()
    for phase in ("fwd", "bwd"):
        collectives.COUNTER = []
        if phase == "fwd":
            loss = model(inputs, targets)
        else:
            loss.backward()
            sync_tp_partial_grads(model)  # the tp part of finishing the gradients
        for op, nbytes in collectives.COUNTER:
            counts[f"{phase} {op}"] += nbytes
    collectives.COUNTER = None
    return dict(counts)


def _on_rank(job, args):
    return job(args, dist.get_rank())


def run_spawned(job, args, world: int):
    """job(args, rank) on `world` gloo ranks: rank 0's result, as JSON reads it back."""
    return json.loads(json.dumps(spawn(world, _on_rank, job, args)[0]))


def comm_job(args, rank):
    tp = int(os.environ["WORLD_SIZE"])
    rows = {}
    for sp in (False, True):
        over = [f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}"]
        small, big = _count_step(args, 2, over), _count_step(args, 4, over)
        rows[str(sp)] = {k: (big.get(k, 0) - small.get(k, 0)) / 2 for k in set(small) | set(big)}
    return rows


def comm_table(args) -> str:
    bsh = args.batch * args.seq_len * args.d_model * 4  # float32 bytes of one B·s·h tensor
    lines = [
        "| tp | SP | fwd all-reduce | fwd all-gather | fwd reduce-scatter | bwd all-reduce | "
        "bwd all-gather | bwd reduce-scatter | total / layer | Megatron | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp in args.tp:
        rows = run_spawned(comm_job, args, tp)
        for sp, counts in rows.items():
            cells = [counts.get(f"{ph} {op}", 0) / bsh for ph in ("fwd", "bwd")
                     for op in ("all_reduce", "all_gather", "reduce_scatter")]  # fmt: skip
            total, on = sum(cells), sp == "True"
            expected = 8.0 if on else 4.0  # 4 AG + 4 RS, or 4 AR (one AR = one RS + one AG)
            row = [str(tp), "on" if on else "off", *(f"{c:.2f}" for c in cells)]
            row += [f"{total:.2f}", f"{expected:.2f}", f"{total / expected:.2f}"]
            lines.append("| " + " | ".join(row) + " |")
    lines.append(
        "\nUnits: all-reduce and reduce-scatter counted by input size, all-gather by "
        "output size. Megatron: 4 all-reduces without SP; 4 all-gathers + 4 "
        "reduce-scatters with SP, the same ring traffic. The SP bwd all-reduce is the "
        "per-step tp sum of replicated-parameter grads (norms, row biases)."
    )
    return "\n".join(lines)


def _time_steps(args, par_mesh) -> float:
    from megapipe.data.loader import build_data
    from megapipe.train.build import build
    from megapipe.train.optim import build_optimizer

    cfg = make_config(args, args.layers, [f"parallel.dp={2 if par_mesh else 1}"])
    job = build(cfg, par_mesh)
    optimizer = build_optimizer(job.model, cfg.train)
    data = build_data(cfg.data, cfg.model, 0)
    times = []
    for step in range(args.steps + 1):  # the first step warms up
        began = time.perf_counter()
        job.train_step(optimizer, data.batch(step, args.batch), step)
        times.append(time.perf_counter() - began)
    return sorted(times[1:])[len(times[1:]) // 2]


def dp_job(args, rank):
    from megapipe.distributed.mesh import MeshSizes, ParallelMesh

    return {"dp2": _time_steps(args, ParallelMesh(MeshSizes(dp=2)))}


def dp_table(args) -> str:
    torch.set_num_threads(1)
    single = _time_steps(args, None)
    dp2 = run_spawned(dp_job, args, 2)["dp2"]
    ideal = single / 2
    return "\n".join([
        "| processes | step time (median) | speed-up | overhead vs ideal t1/2 |",
        "|---|---|---|---|",
        f"| 1 (dp=1) | {single * 1e3:.1f} ms | 1.00 | — |",
        f"| 2 (dp=2) | {dp2 * 1e3:.1f} ms | {single / dp2:.2f} | "
        f"{(dp2 - ideal) * 1e3:+.1f} ms ({(dp2 / ideal - 1) * 100:+.0f}%) |",
    ])  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="layers of the dp timing model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = "python -m benchmarks.bench tp " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command.strip()}\n")
    print(
        f"Bytes communicated per transformer layer per training step, in units of B·s·h "
        f"float32 = {args.batch}·{args.seq_len}·{args.d_model}·4 B (gloo, CPU):\n"
    )
    print(comm_table(args))
    print(
        f"\nStep time, dp=2 vs one process, same global batch ({args.batch} × {args.seq_len} "
        f"tokens, {args.layers} layers, d={args.d_model}; 1 thread per process, "
        f"{os.cpu_count()} cores):\n"
    )
    print(dp_table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
