"""parallel.tp_overlap: sequence-parallel linears with and without their collectives overlapped.

    python -m benchmarks.bench tp_overlap [--tp 2 4 --batch 4 --seq-len 256 --d-model 256
        --rounds 15 --out F.json]

On `tp` spawned gloo ranks (one torch thread each), forward + backward of
1. the SP linear pair of an MLP (column d -> 4d/tp, gelu, row 4d/tp -> d), and
2. a whole transformer layer (models/gpt.TransformerLayer, GPT-2),
each with the SP collectives separate (mappings.py) and overlapped by chunked decomposition
(parallel/tensor/overlap.py, Wang et al. ASPLOS 2023), timed in alternating rounds (harness),
a barrier before each, the slowest rank's time. t_comm: the same collectives alone (for the
pair 2 all-gathers of (B, T/tp, d) and 2 reduce-scatters of (B, T, d), the layer twice that),
timed in the same rounds. Hidden fraction = (t_off − t_on) / t_comm: 1 when all of the
communication disappears behind the matmuls, 0 when none does, below 0 when the ring costs
more than it hides.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import (
    Parser,
    alternate,
    echo_command,
    run_cli,
    say,
    spawn,
    spread,
    write_json,
)


def _tp(overlap: bool):
    from megapipe.parallel.tensor.random import TPRNGTracker
    from megapipe.parallel.tensor.sharding import TPInfo

    size, rank = dist.get_world_size(), dist.get_rank()
    return TPInfo(size, rank, dist.group.WORLD, True, TPRNGTracker(0, rank), overlap)


def _copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(src.parameters(), dst.parameters(), strict=True):
            b.copy_(a)


def _pair(d: int, overlap: bool, seed: int):
    from megapipe.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    tp = _tp(overlap)
    pair = torch.nn.ModuleList(
        [ColumnParallelLinear(d, 4 * d, True, tp), RowParallelLinear(4 * d, d, True, tp)]
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in pair.parameters():
            p.normal_(0, 0.02)
    return pair, lambda x: pair[1](F.gelu(pair[0](x)))


def _layer(args, overlap: bool, seed: int):
    from megapipe.config import load_config
    from megapipe.models.gpt import TransformerLayer

    overrides = [f"model.d_model={args.d_model}", f"model.seq_len={args.seq_len}"]
    cfg = load_config(None, [*overrides, "model.n_heads=8", "model.dropout=0"])
    layer = TransformerLayer(cfg.model, cfg.derived, _tp(overlap), "none")
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    positions = torch.arange(args.seq_len)
    return layer, lambda x: layer(x, positions)


def _step(fn, x: torch.Tensor):
    """Forward + backward once, a barrier first; the slowest rank's seconds."""
    dist.barrier()
    began = time.perf_counter()
    fn(x).sum().backward()
    took = torch.tensor([time.perf_counter() - began])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _comm(args, rank: int, times: int):
    """The SP collectives alone, `times` all-gathers and reduce-scatters of the pair's shapes."""
    from megapipe.distributed import collectives as C

    tp = dist.get_world_size()
    local = torch.randn(args.batch, args.seq_len // tp, args.d_model)
    full = torch.randn(args.batch, args.seq_len, args.d_model)

    def run():
        for _ in range(times):
            C.all_gather(local, 1, dist.group.WORLD)
            C.reduce_scatter(full, 1, dist.group.WORLD)

    return lambda _x: _Scalar(run)


class _Scalar:
    """What _step calls .sum().backward() on for a function that has nothing to differentiate."""

    def __init__(self, run) -> None:
        self.run = run

    def sum(self):
        return self

    def backward(self):
        self.run()


def overlap_job(args) -> dict:
    """Per variant, the slowest rank's seconds per round."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    x = torch.randn(args.batch, args.seq_len // tp, args.d_model, requires_grad=True)
    fns = {}
    for what, make, n_comm in (("pair", _pair_of(args), 2), ("layer", _layer_of(args), 4)):
        off_mod, off = make(False)
        on_mod, on = make(True)
        _copy_weights(off_mod, on_mod)
        fns[f"{what} off"], fns[f"{what} on"] = off, on
        fns[f"{what} comm"] = _comm(args, rank, n_comm)
    variants = {name: (lambda fn=fn: _step(fn, x)) for name, fn in fns.items()}
    alternate(variants, 2)  # warm-up rounds, not kept
    return alternate(variants, args.rounds)


def _pair_of(args):
    return lambda overlap: _pair(args.d_model, overlap, 7)


def _layer_of(args):
    return lambda overlap: _layer(args, overlap, 7)


def table(results: dict[int, dict]) -> tuple[str, dict]:
    lines = [
        "| tp | what | off (median, min-max) | on (median, min-max) | comm alone (median) | "
        "off − on | hidden (off − on) / comm |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for tp, times in results.items():
        for what in ("pair", "layer"):
            off, on, comm = (spread(times[f"{what} {v}"]) for v in ("off", "on", "comm"))
            hidden = (off[0] - on[0]) / comm[0]
            summary[f"tp{tp} {what}"] = {"off": off, "on": on, "comm": comm, "hidden": hidden}
            cells = [
                str(tp), what, _ms(off), _ms(on), f"{comm[0] * 1e3:.2f} ms",
                f"{(off[0] - on[0]) * 1e3:+.2f} ms", f"{hidden:+.2f}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), summary


def _ms(s: tuple[float, float, float]) -> str:
    return f"{s[0] * 1e3:.2f} ms ({s[1] * 1e3:.2f}-{s[2] * 1e3:.2f})"


def parse_args(argv):
    p = Parser(prog="python -m benchmarks.bench tp_overlap", description=__doc__)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    for tp in args.tp:
        if tp < 2 or args.seq_len % tp or 8 % tp or args.d_model % 8:
            raise p.error(f"--tp {tp}: needs tp in 2, 4, 8 dividing --seq-len, 8 | --d-model")
    return args


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    echo_command("tp_overlap", argv)
    results = {}
    for tp in args.tp:
        say(f"tp={tp}: {args.rounds} rounds")
        results[tp] = spawn(tp, overlap_job, args)[0]
    text, summary = table(results)
    print(
        f"Forward + backward, B={args.batch}, T={args.seq_len}, d={args.d_model}, gloo, one "
        "thread per rank, the slowest rank per round:\n"
    )
    print(text)
    if args.out:
        write_json(args.out, {"args": vars(args), "rounds": results, "summary": summary})
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
