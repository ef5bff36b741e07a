"""Throughput accounting (tokens/s, TFLOP/s, MFU) and the run's outputs: metrics.jsonl, a
progress bar, and the sinks each record also goes to (wandb, TensorBoard: train/sinks.py)."""

from __future__ import annotations

import json
import os
import resource
from typing import Any

import torch
from tqdm import tqdm

from megapipe.config import Config
from megapipe.train.sinks import sinks_of

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


def peak_memory(cuda: bool) -> tuple[int, str]:
    """This process's peak memory so far in bytes, and what was counted: CUDA's max allocated
    (tensors only, as torchtitan's memory monitor reports) or, on CPU, the process's max RSS
    (the interpreter, torch and the model; torch keeps no allocator count there). Nothing is
    reset, so the figure of a record and of the profile (train/profile.py) is the run's peak."""
    if cuda:
        return torch.cuda.max_memory_allocated(), "max allocated (CUDA)"
    # Linux reports kilobytes (getrusage(2))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"


class MetricsLog:
    """Writes one JSON object per logged step to run.dir/metrics.jsonl, drives the progress bar
    and hands each record to the sinks the config asks for (wandb, TensorBoard: train/sinks.py).
    Only the rank that owns it writes (rank 0).

    A resumed run (a rerun, or torchrun's restart after a worker died) first drops the records
    after the checkpoint's step, which the interrupted run logged and this one logs again; its
    first record says where it joined: `resumed_from` (the checkpoint's step) and, under
    torchrun, `attempt` (TORCHELASTIC_RESTART_COUNT: how often rank 0's agent restarted the
    workers). Readers still take the last record of each step (`read_metrics`), so a file
    appended to by other means reads the same."""

    def __init__(self, cfg: Config, start_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = os.path.join(cfg.run.dir, "metrics.jsonl")
        self.bar, self.sinks = None, []
        self.joined = _joined(start_step)  # added to this run's first record; {} when fresh
        if not enabled:
            return
        _truncate_after(self.path, start_step)
        self.file = open(self.path, "a")
        if cfg.log.progress:
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step")
        self.sinks = sinks_of(cfg, start_step)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.joined:
            record, self.joined = {**record, **self.joined}, {}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.write(record)

    def progress(
        self, step: int, loss: float, tokens_per_s: float, skipped: int = 0, max_load=None
    ) -> None:
        """The console line; `max_load`: the step's moe_max_load (train/moe_metrics.py)."""
        if self.bar is not None:
            self.bar.n = step
            extra = {"skipped": skipped} if skipped else {}
            if max_load is not None:
                extra["max_load"] = f"{max_load:.2f}"
            self.bar.set_postfix(
                loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", **extra, refresh=True
            )

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks:
            sink.close()


def _joined(start_step: int) -> dict[str, int]:
    """The marks of a resumed run's first record (MetricsLog's docstring)."""
    if start_step == 0:
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return {"resumed_from": start_step, **({"attempt": int(attempt)} if attempt else {})}


def _parsed(line: str) -> dict | None:
    """A record, or None for a blank line or one cut short (a process killed as it wrote)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl's records in step order, the last one written for each step (a step logged
    twice across a restart reads as its later record); [] without the file."""
    if not os.path.exists(path):
        return []
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            record = _parsed(line)
            if record is not None and "step" in record:
                by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def _truncate_after(path: str, step: int) -> None:
    """Drop records after `step` (and any line cut short), so a resumed run continues the file
    without duplicates."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if (r := _parsed(line)) is not None and r.get("step", 0) <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    os.replace(tmp, path)
