"""The training run: config -> mesh -> job -> optimizer -> resume -> loop (batch, step, log,
validate, checkpoint), as docs/architecture.md lists it. train.py calls `run`."""

from __future__ import annotations

import os
import time

import torch

from megapipe.config import Config, write_config
from megapipe.config.flops import flops_per_token
from megapipe.data.loader import build_data
from megapipe.distributed.launch import init_distributed, is_rank0
from megapipe.train import checkpoint
from megapipe.train.build import Job, build
from megapipe.train.metrics import MetricsLog, peak_tflops
from megapipe.train.optim import build_optimizer


def run(cfg: Config) -> list[dict]:
    """Train (or resume) per `cfg`; returns the logged records of this invocation."""
    mesh = init_distributed(cfg)  # checks the world size before any collective
    device = torch.device(
        f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    )
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)  # dropout stream; saved and restored by checkpoints
    job = build(cfg, mesh, device)
    optimizer = build_optimizer(job.model, cfg.train)
    start = 0
    resume = checkpoint.resume_path(cfg)
    if resume is not None:
        start = checkpoint.load(resume, cfg, job.model, optimizer)["step"]
    if is_rank0():
        write_config(cfg, os.path.join(cfg.run.dir, "config.yaml"))
    return train_loop(cfg, job, optimizer, data, start, device)


def train_loop(cfg: Config, job: Job, optimizer, data, start: int, device) -> list[dict]:
    """Steps start..stop_at_step (or steps): log, validate and checkpoint as configured."""
    t = cfg.train
    last = t.stop_at_step or t.steps
    log = MetricsLog(cfg, start, enabled=is_rank0())  # only rank 0 writes
    throughput = Throughput(cfg, device)
    records = []
    for step in range(start, last):
        began = time.perf_counter()
        result = job.train_step(optimizer, data.batch(step, t.global_batch), step)
        done = step + 1
        record = {
            "step": done,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            **throughput.of(done, time.perf_counter() - began),
        }
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
            record["val_loss"] = job.evaluate(data)
        if done % cfg.log.interval == 0 or done == last or "val_loss" in record:
            log.log(record)
        log.progress(done, result.loss, record["tokens_per_s"])
        records.append(record)
        interval = cfg.checkpoint.interval
        if (interval and done % interval == 0) or done == t.stop_at_step:
            checkpoint.save(cfg, done, job.model, optimizer)
    log.close()
    return records


class Throughput:
    """tokens/s, model TFLOP/s per device and MFU of one step (PaLM's MFU: model FLOPs only)."""

    def __init__(self, cfg: Config, device) -> None:
        self.tokens = cfg.derived.tokens_per_step
        self.world = cfg.derived.world_size
        self.flops_per_token, self.peak = flops_per_token(cfg), peak_tflops(cfg, device)

    def of(self, done: int, seconds: float) -> dict:
        tokens_per_s = self.tokens / seconds
        tflops = self.flops_per_token * tokens_per_s / 1e12 / self.world  # per device, as MFU
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "consumed_tokens": done * self.tokens,
        }
