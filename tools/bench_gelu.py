"""GPT-2's tanh GeLU as the model computes it on the CPU (models/activations.gelu_tanh: x·σ(2u))
against aten's `F.gelu(x, approximate="tanh")`: forward, and forward + backward, eager and
compiled (torch.compile, inductor), on the fc1 output of a preset's microbatch.

The two variants alternate within each round; reported: each one's median ms with the spread
(min-max) and the ratio of medians.

    python tools/bench.py gelu [--preset default|124m] [--rounds 15 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import bench_train
import torch
import torch.nn.functional as F

from models.activations import gelu_tanh


def aten(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _case(fn, x: torch.Tensor, g: torch.Tensor, backward: bool):
    def run() -> None:
        y = fn(x)
        if backward:
            y.backward(g)
            x.grad = None

    return run


def timed_pairs(cases: dict, rounds: int) -> dict[str, list[float]]:
    times = {name: [] for name in cases}
    for run in cases.values():  # warm-up (and compile)
        run(), run()
    for r in range(rounds):
        names = list(cases)[r % 2 :] + list(cases)[: r % 2]
        for name in names:
            began = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - began)
    return times


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
    print(f"tanh GeLU on ({batch * seq}, {4 * d}) float32, {args.threads} threads, "
          f"{args.rounds} rounds: median ms (min-max)")  # fmt: skip
    print("| pass | aten F.gelu | megapipe gelu_tanh | speed-up |\n|---|---|---|---|")
    for label, compiled, backward in [("eager forward", False, False),
                                      ("eager forward + backward", False, True),
                                      ("compiled forward + backward", True, True)]:  # fmt: skip
        fns = {"aten": aten, "megapipe": gelu_tanh}
        if compiled:
            fns = {k: torch.compile(f, backend="inductor") for k, f in fns.items()}
        cases = {k: _case(f, x, g, backward) for k, f in fns.items()}
        t = {k: sorted(v) for k, v in timed_pairs(cases, args.rounds).items()}
        cells = [f"{1e3 * statistics.median(v):.2f} ({1e3 * v[0]:.2f}-{1e3 * v[-1]:.2f})"
                 for v in t.values()]  # fmt: skip
        ratio = statistics.median(t["aten"]) / statistics.median(t["megapipe"])
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
