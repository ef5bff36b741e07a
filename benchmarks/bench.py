"""Benchmarks, one subcommand each; submodules are imported only when their subcommand runs.

python -m benchmarks.bench schedules [--proofs] [--plots docs] [--cost F=1,B=1,W=1,comm=0]
python -m benchmarks.bench train [--layers 4 --d-model 256 ...]
python -m benchmarks.bench pipeline [--steps 9 --warmup 2 --out bench_pipeline.json]
python -m benchmarks.bench zero [--layers 4 --d-model 256 --seq-len 128 --steps 60 --out F.json]
python -m benchmarks.bench grad_reduce [--dp 2 --microbatches 4 --steps 20]
python -m benchmarks.bench data [--mb 50 --workers 1,2]
python -m benchmarks.bench cp_balance [--rows 32 --seqs 1024,2048,4096 --cps 2,4,8]
python -m benchmarks.bench moe_balance [--steps 300 --seeds 1234,1235 --rate 0.001 --plot F.png]
python -m benchmarks.bench fp8_shakespeare [--steps 200 --eval-interval 25 --seeds 1234]
python -m benchmarks.bench fp8_weight_cache [--microbatches 8 --steps 12 --recipes tensorwise]
python -m benchmarks.bench fake_startup [--worlds 64,1024,16384 --json F]
python -m benchmarks.bench calibrate [--out megapipe/perf/clusters/cpu.yaml --threads 1 --rounds 5]
python -m benchmarks.bench local [--steps 10 --rounds 3 --stored-only --json]

Eleven living benchmarks, and the CPU profile's calibration with its local truth. The others
(matmuls, kernels, tp, tp_overlap, cp, data_index, precision, checkpoint, moe, grouped, progress)
were retired in issue 46: the dated files under docs/benchmarks/ record what each answered and
the command it ran. The published runs the performance model is checked on are
benchmarks/validation/ (`python tools/plan.py validate | table1`).

Run from the repo root with the project installed (benchmarks/ is not part of the package).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under benchmarks/, one-line help); each module exposes main(argv) -> int
SUBCOMMANDS = {
    "schedules": ("bench_schedules", "pipeline schedules vs torch.distributed.pipelining"),
    "fp8_shakespeare": (
        "bench_fp8_shakespeare",
        "FP8 recipes vs bf16 on the Shakespeare quick start: validation loss, divergence",
    ),
    "fp8_weight_cache": (
        "bench_fp8_weight_cache",
        "FP8 weight casts kept over a step vs cast at every use: step time, casts a step",
    ),
    "train": ("bench_train", "training-step tokens/s vs transformers' GPT2LMHeadModel"),
    "pipeline": (
        "bench_pipeline",
        "pipelined step time vs torch.distributed.pipelining, simulator fidelity, measured bubbles",
    ),
    "zero": (
        "bench_zero",
        "ZeRO levels 1-3 vs zero=0: dp=2 step time and gathers hidden, bytes per rank, comm volume",
    ),
    "grad_reduce": (
        "bench_grad_reduce",
        "ZeRO-2 grads reduced every microbatch vs once a step: step time, bytes, grads held",
    ),
    "data": ("bench_data", "corpus preparation MB/s, tokens/s, peak memory vs datasets .map"),
    "cp_balance": (
        "bench_cp_balance",
        "attention work per cp rank on packed documents: zigzag vs document-balanced split",
    ),
    "moe_balance": (
        "bench_moe_balance",
        "aux-loss-free balancing vs the aux loss on Shakespeare: max/mean expert load, val loss",
    ),
    "fake_startup": (
        "bench_fake_startup",
        "one rank's start-up phases at 64, 1,024 and 16,384 ranks under the fake backend",
    ),
    "calibrate": ("calibrate", "measure this machine's CPU into a profile (clusters/cpu*.yaml)"),
    "local": ("local_truth", "projected vs measured train.py steps on this machine"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="megapipe benchmarks")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(f"benchmarks.{SUBCOMMANDS[args.command][0]}")
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
