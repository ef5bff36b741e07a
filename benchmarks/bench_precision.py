"""bf16 weights (train.params_dtype=bfloat16) against float32: bytes per parameter, and the loss.

    python -m benchmarks.bench precision [--dp 4 --steps 60 --skip-loss --out F.json]

1. Bytes per parameter held at dp=`--dp` (gloo workers, one thread each, the tiny config made
   larger: `add_model_args`), for float32 and bf16 weights at zero 0-3, each job built by
   train/build.py's `build()` and trained two steps: weights (the parameters' resident storage
   and zero=3's master shards, after the step), grads (the distinct storages of the grads the
   optimizer reads, right before the step: float32 .grad or bucket views; bf16: the float32
   main-grad buffer; zero>=2: the reduce-scattered shards, the main grads being freed),
   optimizer (AdamW's moment tensors plus float32 main params: a copy per parameter at zero=0,
   the owned shard at zero>=1). The largest rank, against the issue's targets (Megatron's
   4 + 4 + 8/d and 2 + 4 + 12/d; bf16 zero=2 2 + 16/d, zero=3 18/d).
2. The loss of the quick-start config (configs/shakespeare_tiny.yaml, data/shakespeare) over
   `--steps` steps, run as a user runs it (`train.py`, one process): float32 weights without
   autocast, float32 weights with bf16 autocast, bf16 weights; the largest relative gap of each
   run's loss to the float32 run's over every step and over the last ten.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.harness import (
    ROOT,
    Parser,
    add_model_args,
    echo_command,
    run_cli,
    say,
    spawn,
    storage_bytes,
    write_json,
)
from megapipe.config import load_config
from megapipe.parallel.precision import grad_of
from megapipe.train.hooks import TrainHooks

LAYOUTS = [(dtype, zero) for dtype in ("float32", "bfloat16") for zero in range(4)]
TARGETS = {  # issue 33's, at dp=4
    ("float32", 1): 10.0,
    ("bfloat16", 1): 9.0,
    ("bfloat16", 2): 6.0,
    ("bfloat16", 3): 4.5,
}


def _config(args, params_dtype: str, zero: int):
    dtype = "bfloat16" if params_dtype == "bfloat16" else "float32"
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}", f"train.global_batch={args.batch}",
        f"parallel.dp={args.dp}", f"parallel.zero={zero}", f"train.dtype={dtype}",
        f"train.params_dtype={params_dtype}", f"run.dir={tempfile.mkdtemp()}",
        "log.progress=false",
    ])  # fmt: skip


class _GradBytes(TrainHooks):
    """The grad storage the optimizer reads, seen right before each step (the core's hook)."""

    def __init__(self, model, reducer) -> None:
        self.model, self.reducer, self.most = model, reducer, 0

    def optimizer_begin(self) -> None:
        grads = [g for g in map(grad_of, self.model.parameters()) if g is not None]
        grads += getattr(self.reducer, "shards", list)()  # zero>=2
        self.most = max(self.most, storage_bytes(grads))


def _optimizer_bytes(optimizer) -> int:
    """AdamW's moments (the scalar step counts left out) and any float32 main params."""
    inner = getattr(optimizer, "inner", optimizer)
    mains = getattr(optimizer, "main_of", None)
    tensors = [t for st in inner.state.values() for t in st.values()]
    tensors = [t for t in tensors if torch.is_tensor(t) and t.dim() > 0]
    extra = [m for _, m in mains.values()] if mains else []
    extra += list(getattr(optimizer, "main", {}).values())
    return sum(t.numel() * t.element_size() for t in [*tensors, *extra])


def _measure(args) -> list[dict]:
    from megapipe.data.loader import build_data
    from megapipe.distributed.mesh import MeshSizes, ParallelMesh
    from megapipe.train.build import build

    out = []
    for params_dtype, zero in LAYOUTS:
        cfg = _config(args, params_dtype, zero)
        job = build(cfg, ParallelMesh(MeshSizes.of(cfg)), "cpu")
        reducer = job.engine.reducer
        optimizer, hooks = job.optimizer(), _GradBytes(job.model, reducer)
        data = build_data(cfg.data, cfg.model, cfg.train.seed)
        for step in range(2):
            job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step, hooks)
        params = list(job.model.parameters())
        out.append({
            "params_dtype": params_dtype, "zero": zero,
            "params": sum(p.numel() for p in params),
            "weights": storage_bytes([*params, *getattr(reducer, "master", [])]),
            "grads": hooks.most, "optimizer": _optimizer_bytes(optimizer),
        })  # fmt: skip
    return out


def bytes_table(ranks: list[list[dict]]) -> tuple[str, list[dict]]:
    lines = [
        "| params dtype | zero | weights B/param | grads B/param | optimizer B/param | "
        "total B/param | target |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = []
    for i, (params_dtype, zero) in enumerate(LAYOUTS):
        worst = max((r[i] for r in ranks), key=lambda r: r["weights"] + r["grads"] + r["optimizer"])
        per = {k: worst[k] / worst["params"] for k in ("weights", "grads", "optimizer")}
        total = sum(per.values())
        target = TARGETS.get((params_dtype, zero))
        rows.append({**worst, **{f"{k}_per_param": v for k, v in per.items()}, "total": total})
        lines.append(
            f"| {params_dtype} | {zero} | {per['weights']:.2f} | {per['grads']:.2f} | "
            f"{per['optimizer']:.2f} | {total:.2f} | {target if target else '-'} |"
        )
    return "\n".join(lines), rows


RUNS = {  # name -> overrides of the quick-start config
    "float32": ["--train.dtype=float32", "--train.params_dtype=float32"],
    "float32 + bf16 autocast": ["--train.dtype=bfloat16", "--train.params_dtype=float32"],
    "bf16 weights": ["--train.dtype=bfloat16", "--train.params_dtype=bfloat16"],
}


def _losses(steps: int, overrides: list[str]) -> dict[int, float]:
    run_dir = tempfile.mkdtemp()
    cmd = [sys.executable, str(ROOT / "train.py"), "--config",
           str(ROOT / "configs" / "shakespeare_tiny.yaml"), f"--train.steps={steps}",
           "--train.eval_interval=0", "--checkpoint.interval=0", "--log.interval=1",
           "--log.progress=false", f"--run.dir={run_dir}", *overrides]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def loss_table(steps: int) -> tuple[str, dict]:
    runs = {}
    for name, overrides in RUNS.items():
        say(f"quick-start config, {steps} steps: {name}")
        runs[name] = _losses(steps, overrides)
    base = runs["float32"]
    last = sorted(base)[-10:]
    lines = ["| run | loss at step 1 | loss at the end | largest gap to float32, any step | "
             "last 10 steps |", "|---|---|---|---|---|"]  # fmt: skip
    gaps = {}
    for name, losses in runs.items():
        gap = {s: abs(losses[s] - base[s]) / base[s] for s in base}
        gaps[name] = max(gap.values())
        first, end = min(losses), max(losses)
        lines.append(
            f"| {name} | {losses[first]:.4f} | {losses[end]:.4f} | {100 * gaps[name]:.2f}% | "
            f"{100 * max(gap[s] for s in last):.2f}% |"
        )
    return "\n".join(lines), {"losses": runs, "gaps": gaps}


def main(argv: list[str]) -> int:
    p = Parser(prog="python -m benchmarks.bench precision")
    add_model_args(p, vocab=512)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip-loss", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    echo_command("precision", argv)
    say(f"bytes per parameter at dp={args.dp}")
    table, rows = bytes_table(spawn(args.dp, _measure, args))
    print(f"Bytes per parameter held at dp={args.dp} (the largest rank):\n\n{table}\n")
    result = {"bytes": rows}
    if not args.skip_loss:
        table, result["loss"] = loss_table(args.steps)
        print(f"The quick-start config, {args.steps} steps, one process:\n\n{table}\n")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
