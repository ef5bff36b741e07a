"""Aux-loss-free balancing against the auxiliary loss on Shakespeare: the max/mean expert load
and the validation loss of two otherwise equal runs (issue 50's target).

python -m benchmarks.bench moe_balance [--steps 300] [--seeds 1234,1235] [--rates 0.001,0.01]
                                       [--aux 0.01] [--variants aux,aux_free]
                                       [--out runs/moe_balance] [--plot F.png]

Both variants train the same small DeepSeek-V3 (configs/shakespeare_tiny.yaml's shape and data,
latent attention, 8 routed experts top-2 and one shared expert, the first layer dense) from the
same seed on the same batches:
- `aux`: the sequence-wise balance loss (docs/moe.md; DeepSeek-V3 eq. 17-20) with
  model.moe_aux_coef = --aux, the bias fixed at 0;
- `aux_free_u{rate}`: model.moe_bias_update_rate = each of --rates (DeepSeek-V3 §2.1.2 and
  Wang et al. 2024, arXiv 2408.15664, both u = 0.001), no auxiliary loss.
deepseek_v3's router is the sigmoid one (models/routing.py: make_routing picks the softmax
top-k only for the other archs), so both variants route by it and differ only in how they
balance. Each step's `moe_max_load` (train/moe_metrics.py: max over layers and experts of
rows / mean rows over the global batch) and every eval interval's `val_loss` are read from the
run's own records (every run under --out, also earlier invocations': --variants picks which
to train now); the figures printed are, per run, the mean moe_max_load over the last quarter of
steps and over all, and the final validation loss. --plot writes the curves of every run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from megapipe.config import load_config
from megapipe.train.loop import run
from megapipe.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
MODEL = [
    "model.arch=deepseek_v3", "model.tie_embeddings=false", "model.d_ff=256",
    "model.n_experts=8", "model.top_k=2", "model.moe_ffn=64", "model.moe_shared_experts=1",
    "model.first_k_dense_replace=1", "model.kv_lora_rank=32", "model.qk_nope_head_dim=32",
    "model.qk_rope_head_dim=16", "model.v_head_dim=32", "model.moe_z_coef=0",
]  # fmt: skip


def variants(aux: float, rates: list[float], names: list[str]) -> dict[str, list[str]]:
    """The runs' balancing keys, of the variants `names`: the auxiliary loss, or the bias."""
    out = {}
    if "aux" in names:
        out["aux"] = [f"model.moe_aux_coef={aux}", "model.moe_bias_update_rate=0"]
    if "aux_free" in names:
        for rate in rates:
            bias = f"model.moe_bias_update_rate={rate}"
            out[f"aux_free_u{rate}"] = ["model.moe_aux_coef=0", bias]
    return out


def train(name: str, keys: list[str], seed: int, steps: int, out: Path) -> None:
    """One run, every step logged to its metrics.jsonl, no checkpoints."""
    run_dir = out / f"{name}_seed{seed}"
    overrides = [*MODEL, *keys, f"train.seed={seed}", f"train.steps={steps}",
                 f"train.warmup={max(1, steps // 10)}", "train.eval_interval=25",
                 "checkpoint.interval=0", "log.interval=1", "log.progress=false",
                 f"data.path={ROOT / 'data' / 'shakespeare'}", f"run.dir={run_dir}"]  # fmt: skip
    cfg = load_config(str(ROOT / "configs" / "shakespeare_tiny.yaml"), overrides)
    if (run_dir / "metrics.jsonl").exists():
        os.remove(run_dir / "metrics.jsonl")  # a fresh run, not a resume
    run(cfg)


def summary(records: list[dict]) -> dict:
    """Mean moe_max_load over the last quarter of steps, and the final validation loss."""
    tail = records[len(records) * 3 // 4 :]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "max_load_last_quarter": sum(r["moe_max_load"] for r in tail) / len(tail),
        "max_load_all": sum(r["moe_max_load"] for r in records) / len(records),
        "val_loss": vals[-1],
    }


def plot(curves: dict, path: str) -> None:
    """Per-step moe_max_load and per-eval val_loss of every run, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    names = sorted({name for name, _ in curves})
    colours = dict(zip(names, ["tab:red", "tab:blue", "tab:green", "tab:purple"], strict=False))
    for (name, seed), records in sorted(curves.items()):
        steps = [r["step"] for r in records]
        label = f"{name} seed {seed}"
        top.plot(steps, [r["moe_max_load"] for r in records], colours[name], alpha=0.6, lw=0.8,
                 label=label)  # fmt: skip
        evals = [r for r in records if "val_loss" in r]
        bottom.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], colours[name],
                    marker=".", lw=0.8, label=label)  # fmt: skip
    top.set_ylabel("moe_max_load (max / mean expert rows)")
    bottom.set_ylabel("val_loss")
    bottom.set_xlabel("step")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="1234")
    parser.add_argument("--rates", default="0.001")
    parser.add_argument("--variants", default="aux,aux_free")
    parser.add_argument("--aux", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/moe_balance")
    parser.add_argument("--plot", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rates = [float(r) for r in args.rates.split(",")]
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, keys in variants(args.aux, rates, args.variants.split(",")).items():
            train(name, keys, seed, args.steps, out)
    curves = {}
    for path in sorted(out.glob("*_seed*/metrics.jsonl")):
        name, seed = path.parent.name.rsplit("_seed", 1)
        curves[name, int(seed)] = read_metrics(str(path))
        print(json.dumps({"run": path.parent.name, **summary(curves[name, int(seed)])}))
    if args.plot:
        plot(curves, args.plot)
    return 0
