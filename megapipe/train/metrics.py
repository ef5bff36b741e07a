"""Throughput accounting (tokens/s, TFLOP/s, MFU) and the run's outputs: metrics.jsonl, a
progress bar and wandb."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tqdm import tqdm

from megapipe.config import Config

# Dense peak TFLOP/s per device, by autocast dtype (vendor data sheets; SXM parts where the
# name does not say). float32 means TF32 tensor cores, which torch uses for matmuls when allowed.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float32": 494.0},
    "H100": {"bfloat16": 989.0, "float32": 494.0},
    "A100": {"bfloat16": 312.0, "float32": 156.0},
    "L40S": {"bfloat16": 362.0, "float32": 183.0},
    "A10G": {"bfloat16": 70.0, "float32": 35.0},
    "L4": {"bfloat16": 121.0, "float32": 60.0},
    "RTX 4090": {"bfloat16": 165.0, "float32": 83.0},
}


def peak_tflops(cfg: Config, device: torch.device) -> float | None:
    """Peak from `log.peak_tflops`, else the table for a known GPU, else None (MFU is null)."""
    if cfg.log.peak_tflops > 0:
        return cfg.log.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, by_dtype in PEAK_TFLOPS.items():
        if key in name:
            return by_dtype[cfg.train.dtype]
    return None


class MetricsLog:
    """Writes one JSON object per logged step to run.dir/metrics.jsonl, drives the progress bar
    and mirrors to wandb. Only the rank that owns it writes (rank 0)."""

    def __init__(self, cfg: Config, start_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = os.path.join(cfg.run.dir, "metrics.jsonl")
        self.bar = self.wandb_run = None
        if not enabled:
            return
        _truncate_after(self.path, start_step)
        self.file = open(self.path, "a")
        if cfg.log.progress:
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step")
        if cfg.log.wandb != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.log.wandb_project, mode=cfg.log.wandb, dir=cfg.run.dir,
                config=cfg.to_dict(),
            )  # fmt: skip

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float, skipped: int = 0) -> None:
        if self.bar is not None:
            self.bar.n = step
            extra = {"skipped": skipped} if skipped else {}
            self.bar.set_postfix(
                loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", **extra, refresh=True
            )

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _truncate_after(path: str, step: int) -> None:
    """Drop records after `step`, so a resumed run continues the file without duplicates."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
