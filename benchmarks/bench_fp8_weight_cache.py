"""FP8 weight casts kept over a step (parallel/fp8_weight_cache.py) against a cast at every use:
one process, a small GPT with `--microbatches` microbatches a step, each `train.fp8` recipe.

Two jobs per recipe, built alike from the same seed, one with the policy's casts kept over the
step and one casting each weight at each use (`Fp8.of`'s `cache_weights`, an internal switch:
the benchmark builds its chunks from Components it resolves itself); they take turns step by
step (benchmarks/harness.alternate) so the machine's drift hits both alike. Reported per
recipe: the median step seconds and their spread (min, max) after `--warmup` steps, the speed-up,
the casts made per step, and whether both trained the same losses (they must, bit for bit).
On a CPU the FP8 matmuls are torch's upcasting kernels: what the casts cost here is a CPU's
memory passes, not a GPU's (perf/fp8_costs.py prices those).

    python -m benchmarks.bench fp8_weight_cache [--recipes tensorwise,rowwise,blockwise]
        [--microbatches 8 --steps 12 --warmup 2 --layers 4 --d-model 256 ...] [--json FILE]
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from benchmarks.harness import (
    Parser,
    add_model_args,
    alternate,
    echo_command,
    run_cli,
    say,
    spread,
    timed,
    write_json,
)
from megapipe.config import load_config
from megapipe.data.loader import build_data
from megapipe.parallel.fp8 import Fp8
from megapipe.pipeline.stages import Components, build_model
from megapipe.train.batches import BatchSlice, document_eos
from megapipe.train.optim import build_optimizer
from megapipe.train.parallelize import replica
from megapipe.train.step import train_step

CONFIG = "configs/tiny.yaml"


def make_config(args, recipe: str):
    over = [
        f"--model.n_layers={args.layers}", f"--model.d_model={args.d_model}",
        f"--model.n_heads={args.heads}", f"--model.seq_len={args.seq_len}",
        f"--model.vocab_size={args.vocab}", f"--train.global_batch={args.batch}",
        f"--parallel.microbatches={args.microbatches}", f"--train.fp8={recipe}",
        f"--train.steps={args.steps + args.warmup}", f"--run.dir={tempfile.mkdtemp()}",
    ]  # fmt: skip
    return load_config(CONFIG, over)


class Run:
    """One job of a recipe, kept (`cache`) or casting at every use, stepped one step a call."""

    def __init__(self, cfg, cache: bool) -> None:
        torch.manual_seed(cfg.train.seed)
        base = Components.of(cfg, None)
        self.parts = dataclasses.replace(base, fp8=Fp8.of(cfg.train, base.cp, cache))
        model = build_model(cfg, None, "cpu", parts=self.parts)
        self.engine = replica(cfg, model, None, parts=self.parts)
        self.optimizer = build_optimizer(model, cfg.train)
        self.data = build_data(cfg.data, cfg.model, cfg.train.seed)
        self.cfg, self.step, self.losses, self.casts = cfg, 0, [], []
        self.slice = BatchSlice.of(None, cfg.train.global_batch, document_eos(cfg))

    def __call__(self) -> float:
        made = self.parts.fp8.casts.made
        batch = self.data.batch(self.step, self.cfg.train.global_batch)

        def one():
            result = train_step(self.engine, self.slice, self.optimizer, batch, self.step, self.cfg)
            self.losses.append(result.loss)

        seconds = timed(one)
        self.casts.append(self.parts.fp8.casts.made - made)
        self.step += 1
        return seconds


def measure(args, recipe: str) -> dict:
    """Both variants of `recipe`, alternating; their figures past the warm-up."""
    cfg = make_config(args, recipe)
    runs = {"kept": Run(cfg, True), "every use": Run(cfg, False)}
    times = alternate(runs, args.steps + args.warmup)
    row = {"recipe": recipe, "same_losses": runs["kept"].losses == runs["every use"].losses}
    for name, seconds in times.items():
        med, lo, hi = spread(seconds[args.warmup :])
        row[name] = {"median_s": med, "min_s": lo, "max_s": hi, "casts": runs[name].casts[-1]}
    row["speedup"] = row["every use"]["median_s"] / row["kept"]["median_s"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| recipe | kept: median s (min-max) | every use: median s (min-max) | speed-up | "
        "casts a step (kept / every use) | same losses |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, e = r["kept"], r["every use"]
        lines.append(
            f"| {r['recipe']} | {k['median_s']:.4f} ({k['min_s']:.4f}-{k['max_s']:.4f}) | "
            f"{e['median_s']:.4f} ({e['min_s']:.4f}-{e['max_s']:.4f}) | {r['speedup']:.3f}x | "
            f"{k['casts']} / {e['casts']} | {r['same_losses']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def run(argv: list[str]) -> int:
        p = Parser(prog="python -m benchmarks.bench fp8_weight_cache")
        add_model_args(p, vocab=512)
        p.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
        p.add_argument("--microbatches", type=int, default=8)
        p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--json", default=None)
        args = p.parse_args(argv)
        torch.set_num_threads(args.threads)
        echo_command("fp8_weight_cache", argv)
        rows = []
        for recipe in args.recipes.split(","):
            say(f"train.fp8={recipe}")
            rows.append(measure(args, recipe))
        print(table(rows))
        if args.json:
            write_json(args.json, {"args": vars(args), "rows": rows})
        return 0

    return run_cli(run, argv)
