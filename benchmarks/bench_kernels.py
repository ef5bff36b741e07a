"""The CPU elementwise kernels megapipe computes differently from the plain aten op, each
against that op on a preset's shapes:

- GPT-2's tanh GeLU (models/activations.gelu_tanh: x·σ(2u)) against `F.gelu(x,
  approximate="tanh")` on the fc1 output of a microbatch: forward, and forward + backward,
  eager and compiled (torch.compile, inductor);
- the fused head's exp(logits − max) (parallel/tensor/cross_entropy.exp_shifted_: exp2 of
  the scaled difference) against `sub_` + `exp_` on one chunk's (V, rows) logits.

The two variants alternate within each round; reported: each one's median ms with the spread
(min-max) and the ratio of medians.

    python -m benchmarks.bench kernels [--preset default|124m] [--rounds 15 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks import bench_train
from benchmarks.harness import alternate, timed
from megapipe.config.memory_terms import CHUNK_ROWS
from megapipe.models.activations import gelu_tanh
from megapipe.parallel.tensor.cross_entropy import exp_shifted_


def aten_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_case(fn, x: torch.Tensor, g: torch.Tensor, backward: bool):
    def run() -> None:
        y = fn(x)
        if backward:
            y.backward(g)
            x.grad = None

    return run


def _exp_case(shifted_exp, logits: torch.Tensor, top: torch.Tensor):
    work = torch.empty_like(logits)

    def run() -> None:
        shifted_exp(work.copy_(logits), top)

    return run


def aten_exp_shifted_(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    return logits.sub_(top[None]).exp_()


def timed_pairs(cases: dict, rounds: int) -> dict[str, list[float]]:
    for run in cases.values():  # warm-up (and compile)
        run(), run()
    return alternate({name: partial(timed, run) for name, run in cases.items()}, rounds)


def row(label: str, cases: dict, rounds: int) -> str:
    t = {k: sorted(v) for k, v in timed_pairs(cases, rounds).items()}
    cells = [f"{1e3 * statistics.median(v):.2f} ({1e3 * v[0]:.2f}-{1e3 * v[-1]:.2f})"
             for v in t.values()]  # fmt: skip
    base, ours = (statistics.median(v) for v in t.values())
    return f"| {label} | {cells[0]} | {cells[1]} | {base / ours:.2f}x |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default", choices=list(bench_train.PRESETS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers, d, heads, vocab, (batch, seq), _ = bench_train.PRESETS[args.preset]
    x = torch.randn(batch * seq, 4 * d, requires_grad=True)
    g = torch.randn(batch * seq, 4 * d)
    print(f"preset {args.preset}, float32, {args.threads} threads, {args.rounds} rounds: "
          "median ms (min-max)")  # fmt: skip
    print("| kernel | aten | megapipe | speed-up |\n|---|---|---|---|")
    gelu_passes = [("GeLU eager forward", False, False),
                   ("GeLU eager forward + backward", False, True),
                   ("GeLU compiled forward + backward", True, True)]  # fmt: skip
    for label, compiled, backward in gelu_passes:
        fns = {"aten": aten_gelu, "megapipe": gelu_tanh}
        if compiled:
            fns = {k: torch.compile(f, backend="inductor") for k, f in fns.items()}
        cases = {k: _gelu_case(f, x, g, backward) for k, f in fns.items()}
        print(row(f"{label} ({batch * seq}, {4 * d})", cases, args.rounds))
    rows = min(CHUNK_ROWS, batch * seq)
    logits = torch.randn(vocab, rows) * 3
    top = logits.amax(dim=0)
    cases = {"aten": _exp_case(aten_exp_shifted_, logits, top),
             "megapipe": _exp_case(exp_shifted_, logits, top)}  # fmt: skip
    print(row(f"head exp(logits − max) ({vocab}, {rows}), with a copy in", cases, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
