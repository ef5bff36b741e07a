"""FP8 against its high-precision baseline on the Shakespeare quick start (issue 49's targets).

configs/shakespeare_tiny.yaml for `--steps` steps in `--dtype` (bf16 autocast by default, as
the issue asks), once per `train.fp8` recipe (none is the baseline) and seed, each run a plain
`train.py` process (as a user runs it), its validation losses read from metrics.jsonl.
Reported per run: the validation loss at each eval step, the final loss's gap to the
baseline's of the same seed, the steps skipped (non-finite or loss spikes: train/spikes.py),
the largest step-to-step rise of the training loss, and the wall seconds. With several seeds,
the baseline's own spread between seeds is printed beside the gaps.

Targets (issue 49): tensorwise and rowwise within 2% of bf16's final validation loss,
blockwise within 3%, no step diverging.

    python -m benchmarks.bench fp8_shakespeare [--steps 200 --eval-interval 25]
        [--recipes none,tensorwise,rowwise,blockwise] [--seeds 1234] [--json FILE]
        [--dtype bfloat16|float32] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import write_json
from megapipe.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_tiny.yaml"
TARGETS = {"tensorwise": 0.02, "rowwise": 0.02, "blockwise": 0.03}  # issue 49's bounds


def run_one(recipe: str, seed: int, args, run_dir: str) -> dict:
    """One train.py run of the quick start under `recipe`; its curve and figures."""
    steps, eval_interval = args.steps, args.eval_interval
    overrides = [
        f"--train.dtype={args.dtype}",
        f"--train.fp8={recipe}",
        f"--train.steps={steps}",
        f"--train.seed={seed}",
        f"--train.eval_interval={eval_interval}",
        "--checkpoint.interval=0",
        "--log.interval=1",
        "--log.progress=false",
        f"--run.dir={run_dir}",
    ]
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env = {**os.environ, **offline, "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(CONFIG), *overrides]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"train.fp8={recipe} seed {seed} failed: {done.stderr.strip()[-2000:]}")
    wall = time.perf_counter() - start
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    losses = [r["loss"] for r in records]
    rises = [b - a for a, b in zip(losses, losses[1:])]
    return {
        "recipe": recipe,
        "seed": seed,
        "dtype": args.dtype,
        "val": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
        "skipped": sum(bool(r.get("skipped")) for r in records),
        "nonfinite": sum(not _finite(x) for x in losses),
        "max_rise": max(rises, default=0.0),
        "wall_s": wall,
    }


def _finite(x) -> bool:
    return x is not None and x == x and abs(x) != float("inf")


def gaps(runs: list[dict]) -> list[dict]:
    """Each run's final validation loss relative to the baseline's (recipe none, in the runs'
    train.dtype) of the same seed."""
    base = {r["seed"]: r["val"][max(r["val"])] for r in runs if r["recipe"] == "none"}
    out = []
    for r in runs:
        final = r["val"][max(r["val"])]
        rel = final / base[r["seed"]] - 1.0 if r["seed"] in base else None
        out.append({**r, "final": final, "rel_gap": rel, "target": TARGETS.get(r["recipe"])})
    return out


def report(rows: list[dict]) -> str:
    """The table the dated file holds: val loss per eval step, gaps, skips, wall time."""
    steps = sorted(rows[0]["val"])
    head = "| recipe | seed | " + " | ".join(str(s) for s in steps)
    head += " | gap to none | target | skipped | max loss rise | wall s |"
    lines = [head, "|" + "---|" * (len(steps) + 7)]
    for r in rows:
        vals = " | ".join(f"{r['val'][s]:.4f}" for s in steps)
        gap = "-" if r["rel_gap"] is None or r["recipe"] == "none" else f"{r['rel_gap']:+.2%}"
        target = f"≤ {r['target']:.0%}" if r["target"] else "-"
        lines.append(
            f"| {r['recipe']} | {r['seed']} | {vals} | {gap} | {target} | {r['skipped']} | "
            f"{r['max_rise']:+.3f} | {r['wall_s']:.0f} |"
        )
    base = [r["final"] for r in rows if r["recipe"] == "none"]
    if len(base) > 1:
        spread = (max(base) - min(base)) / min(base)
        lines.append(f"\nnone's final val loss over {len(base)} seeds: spread {spread:.2%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--recipes", default="none,tensorwise,rowwise,blockwise")
    p.add_argument("--seeds", default="1234")
    p.add_argument("--dtype", default="bfloat16", help="train.dtype of every run (the baseline's)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--out", default=None, help="keep each run's run.dir under this folder")
    p.add_argument("--json", default=None, help="write the runs here")
    args = p.parse_args(argv)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for recipe in args.recipes.split(","):
            if args.out:
                run_dir = os.path.join(args.out, f"{recipe}-{seed}")
                runs.append(run_one(recipe, seed, args, run_dir))
            else:
                with tempfile.TemporaryDirectory() as run_dir:
                    runs.append(run_one(recipe, seed, args, run_dir))
            print(json.dumps(runs[-1]), flush=True)
    rows = gaps(runs)
    print(report(rows))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
