"""The local experts' matmuls (parallel/autograd/grouped_linear.py) as one grouped matmul
(torch._grouped_mm) against the loop of one matmul per expert, on this machine's CPU:

for each expert count E, the rows of `--rows` routed (token, choice) pairs spread over the E
experts at random (seeded; some experts get more rows than others), through one expert linear
(d_model -> ffn): the forward x·Wᵀ, the input grad g·W and the stacked weight grad gᵀ·x, the
three calls the layer's forward and backward make. The two variants alternate within each
round; reported: each one's median ms with the spread (min-max), the ratio of medians
(loop / grouped: above 1, the grouped matmul is faster) and the median of the rounds' own
ratios (each round's two variants ran back to back: the machine's drift cancels).

    python -m benchmarks.bench grouped [--rows 2048 --d-model 256 --ffn 512 \\
        --experts 2 4 8 16 32 --dtype float32 bfloat16 --rounds 15 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch

from benchmarks.harness import alternate, timed
from megapipe.parallel.autograd import grouped_linear as G


def operands(rows: int, d: int, ffn: int, experts: int, dtype: torch.dtype):
    """(x (rows, d), W (E, ffn, d), g (rows, ffn), counts) with routed-looking counts."""
    gen = torch.Generator().manual_seed(experts)
    expert_of = torch.randint(0, experts, (rows,), generator=gen)
    counts = tuple(torch.bincount(expert_of, minlength=experts).tolist())
    x = torch.randn(rows, d, generator=gen).to(dtype)
    w = torch.randn(experts, ffn, d, generator=gen).to(dtype)
    g = torch.randn(rows, ffn, generator=gen).to(dtype)
    return x, w, g, counts


def variants(x, w, g, counts) -> dict:
    """The layer's three matmuls each way (the module's own functions for each path)."""

    def loop() -> None:
        G._loop_forward(x, w, None, counts)
        G._loop_input_grad(g, w, counts)
        G._loop_weight_grad(x, g, counts)

    def grouped() -> None:
        offs = G._offsets(counts, x.device)
        G._forward(x, w, offs)
        G._input_grad(g, w, offs)
        G._weight_grad(x, g, offs)

    return {"loop": loop, "grouped": grouped}


def row(label: str, cases: dict, rounds: int) -> str:
    for run in cases.values():  # warm-up
        run(), run()
    t = alternate({name: partial(timed, run) for name, run in cases.items()}, rounds)
    paired = statistics.median(a / b for a, b in zip(t["loop"], t["grouped"], strict=True))
    t = {k: sorted(v) for k, v in t.items()}
    cells = [f"{1e3 * statistics.median(v):.2f} ({1e3 * v[0]:.2f}-{1e3 * v[-1]:.2f})"
             for v in t.values()]  # fmt: skip
    loop, grouped = (statistics.median(v) for v in t.values())
    return f"| {label} | {cells[0]} | {cells[1]} | {loop / grouped:.2f}x | {paired:.2f}x |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = f"{args.rows} rows, d_model {args.d_model} -> ffn {args.ffn}"
    print(f"{shape}, {args.threads} threads, {args.rounds} rounds: median ms (min-max) of "
          "forward + grad_x + grad_W")  # fmt: skip
    print("| dtype, experts | loop | grouped | loop / grouped | per round |\n|---|---|---|---|---|")
    for name in args.dtype:
        dtype = getattr(torch, name)
        for e in args.experts:
            x, w, g, counts = operands(args.rows, args.d_model, args.ffn, e, dtype)
            if not G.grouped_mm_ok(x, args.ffn, e):
                print(f"| {name}, {e} | the grouped matmul does not take these shapes |")
                continue
            print(row(f"{name}, {e}", variants(x, w, g, counts), args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
