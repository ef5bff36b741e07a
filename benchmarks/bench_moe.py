"""Expert parallelism on gloo: the all-to-all volume against its formula, and the dispatch /
combine overhead against the dense step at equal active parameters.

    python -m benchmarks.bench moe [--layers 2 --d-model 128 --seq-len 64 --batch 8 --steps 6]

1. Bytes: one training step of the MoE model under dp = ep (ep = 2, 4), every layer MoE, the
   all-to-all inputs counted by megapipe.distributed.collectives.COUNTER. Formula per rank and
   step (parallel/expert/all_to_all.py, perf/comm.py): per MoE layer, dispatch and combine each
   send the rank's N·k rows of d floats (N its tokens, k = top_k) in forward, and their
   transposes the same in backward: 4·N·k·d·4 bytes, plus the count exchange (E int64 per
   dispatch); of the rows, (ep−1)/ep leave the rank under balanced routing.
2. Time: the median step of dp=2 for the dense model (d_ff = k·moe_ffn: the same active
   parameters and FLOPs per token), the MoE model at ep=1 (routing, sort and grouped experts,
   no exchange) and at ep=2 (the all-to-alls added). One torch thread per process.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

from benchmarks.harness import ROOT, echo_command, say, spawn
from megapipe.config import load_config


def make_config(args, overrides=()):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", "model.n_heads=8",
        f"model.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
        "model.vocab_size=256", f"run.dir={tempfile.mkdtemp()}", "log.progress=false", *overrides,
    ])  # fmt: skip


def moe(args, ep: int) -> list[str]:
    return [f"model.n_experts={args.experts}", f"model.top_k={args.top_k}",
            f"model.moe_ffn={args.ffn}", f"parallel.ep={ep}"]  # fmt: skip


def dense(args) -> list[str]:
    return [f"model.d_ff={args.top_k * args.ffn}"]


def _job(args, overrides, count: bool) -> dict:
    """Steps of `overrides` on this rank: the median step seconds, or one step's byte counts."""
    from megapipe.data.loader import build_data
    from megapipe.distributed import collectives
    from megapipe.distributed.mesh import MeshSizes, ParallelMesh
    from megapipe.train.build import build

    cfg = make_config(args, overrides)
    job = build(cfg, ParallelMesh(MeshSizes.of(cfg)))
    optimizer, data = job.optimizer(), build_data(cfg.data, cfg.model, 0)
    rows = job.slice.rows(args.batch)
    if count:
        collectives.COUNTER = []
        job.train_step(optimizer, data.batch(0, args.batch, rows=rows), 0)
        counts = Counter()
        for op, nbytes in collectives.COUNTER:
            counts[op] += nbytes
        collectives.COUNTER = None
        return dict(counts)
    times = []
    for step in range(args.steps + 1):  # the first step warms up
        began = time.perf_counter()
        job.train_step(optimizer, data.batch(step, args.batch, rows=rows), step)
        times.append(time.perf_counter() - began)
    return {"median_s": sorted(times[1:])[len(times[1:]) // 2]}


def _on_rank(args, overrides, count):
    return _job(args, overrides, count)


def bytes_table(args) -> str:
    lines = ["| ep = dp | measured all-to-all B / rank / step (mean) | formula | ratio | "
             "of which off-rank (formula) |", "|---|---|---|---|---|"]  # fmt: skip
    for ep in args.ep:
        say(f"counting bytes at ep={ep}")
        mesh = [f"parallel.dp={ep}"]
        ranks = spawn(ep, _on_rank, args, [*moe(args, ep), *mesh], True)
        # a rank's combine sends back the rows its experts took: the mean over ranks is N·k
        got = sum(r.get("all_to_all", 0) for r in ranks) / ep
        tokens = args.batch // ep * args.seq_len  # N: this rank's tokens
        rows = 4 * tokens * args.top_k * args.d_model * 4 * args.layers
        formula = rows + 8 * args.experts * args.layers  # + the count exchange per dispatch
        off = rows * (ep - 1) / ep
        lines.append(f"| {ep} | {got:,.0f} | {formula:,} | {got / formula:.4f} | {off:,.0f} |")
    return "\n".join(lines)


def time_table(args) -> str:
    variants = {
        "dense (d_ff = k·moe_ffn)": dense(args),
        "MoE ep=1": moe(args, 1),
        "MoE ep=2": moe(args, 2),
    }
    lines = ["| dp=2, 2 processes | median step | vs dense |", "|---|---|---|"]
    base = None
    for name, over in variants.items():
        say(f"timing {name}")
        t = spawn(2, _on_rank, args, [*over, "parallel.dp=2"], False)[0]["median_s"]
        base = base or t
        lines.append(f"| {name} | {t * 1e3:.1f} ms | {t / base:.2f}× |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ffn", type=int, default=256, help="model.moe_ffn")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    echo_command("moe", argv)
    shape = f"E={args.experts}, k={args.top_k}, d={args.d_model}"
    print(f"All-to-all bytes per rank per step ({args.layers} MoE layers, {shape}, "
          f"{args.batch}×{args.seq_len} tokens, float32):\n")  # fmt: skip
    print(bytes_table(args))
    print(f"\nStep time at equal active parameters ({os.cpu_count()} cores, 1 thread each):\n")
    print(time_table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
