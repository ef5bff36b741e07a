"""Benchmarks, one subcommand each; submodules are imported only when their subcommand runs.

python -m benchmarks.bench schedules [--proofs] [--plots docs] [--cost F=1,B=1,W=1,comm=0]
python -m benchmarks.bench train [--layers 4 --d-model 256 ...]
python -m benchmarks.bench matmuls [--preset 124m --variant eager|transformers]
python -m benchmarks.bench kernels [--preset default|124m --rounds 15]
python -m benchmarks.bench tp
python -m benchmarks.bench tp_overlap [--tp 2 4 --seq-len 256 --d-model 256 --rounds 15]
python -m benchmarks.bench cp
python -m benchmarks.bench pipeline [--steps 9 --warmup 2 --out bench_pipeline.json]
python -m benchmarks.bench data [--mb 50 --workers 1,2]
python -m benchmarks.bench data_index [--docs 1e8 --big-gb 1000 --batch 512 --blend 1e7]
python -m benchmarks.bench zero [--layers 4 --d-model 256 --seq-len 128 --steps 60 --out F.json]
python -m benchmarks.bench precision [--dp 4 --steps 60 --skip-loss --out F.json]
python -m benchmarks.bench checkpoint [--d-model 256 --vocab 4096 --repeats 5 --out F.json]
python -m benchmarks.bench moe [--layers 2 --d-model 128 --seq-len 64 --batch 8 --ep 2 4]
python -m benchmarks.bench grouped [--rows 2048 --experts 2 4 8 16 32 --dtype float32 bfloat16]
python -m benchmarks.bench progress [--layers 4 --d-model 256 --seq-len 128 --steps 8]
python -m benchmarks.bench calibrate [--out megapipe/perf/clusters/cpu.yaml --threads 1 --rounds 5]
python -m benchmarks.bench local [--steps 10 --rounds 3 --stored-only --json]

Run from the repo root with the project installed (benchmarks/ is not part of the package).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under benchmarks/, one-line help); each module exposes main(argv) -> int
SUBCOMMANDS = {
    "schedules": ("bench_schedules", "pipeline schedules vs torch.distributed.pipelining"),
    "train": ("bench_train", "training-step tokens/s vs transformers' GPT2LMHeadModel"),
    "matmuls": ("bench_matmuls", "a training step's matmuls by shape: ms, GFLOP/s, page faults"),
    "kernels": ("bench_kernels", "CPU elementwise kernels megapipe computes its own way vs aten"),
    "tp": ("bench_tp", "tensor-parallel bytes per layer and dp=2 step-time overhead"),
    "tp_overlap": (
        "bench_tp_overlap",
        "SP linears and a layer with the tp collectives overlapped or not: share of comm hidden",
    ),
    "cp": ("bench_cp", "ring attention per-rank time vs one process, and overlap"),
    "pipeline": (
        "bench_pipeline",
        "pipelined step time vs torch.distributed.pipelining, simulator fidelity, measured bubbles",
    ),
    "data": ("bench_data", "corpus preparation MB/s, tokens/s, peak memory vs datasets .map"),
    "data_index": (
        "bench_data_index",
        "epochs sample index: build time, start-up vs corpus size, bytes read per rank vs dp",
    ),
    "zero": (
        "bench_zero",
        "ZeRO levels 1-3 vs zero=0: dp=2 step time and gathers hidden, bytes per rank, comm volume",
    ),
    "precision": (
        "bench_precision",
        "bf16 weights vs float32: bytes per parameter at dp=4 and zero 0/1, quick-start loss",
    ),
    "checkpoint": (
        "bench_checkpoint",
        "checkpoint save/resume time and bytes read per rank across meshes, save step overhead",
    ),
    "grouped": (
        "bench_grouped",
        "local experts' matmuls: torch's grouped matmul vs a loop of per-expert matmuls (CPU)",
    ),
    "progress": (
        "bench_progress",
        "each rank's progress record: ns per update, its share of a pp=2 and a dp=2 step",
    ),
    "moe": (
        "bench_moe",
        "expert parallelism: all-to-all bytes vs the formula, dispatch/combine vs the dense step",
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
