"""Train a GPT from a YAML config: `python train.py --config FILE [--section.key=value ...]`,
on one process or under `torchrun --nproc_per_node=N` with dp·pp·cp·tp = N.

The steps of run() follow design.md's "One training step": config -> mesh -> model ->
optimizer -> resume -> loop (batch, step, log, validate, checkpoint).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from megapipe.train import checkpoint
from megapipe.config import Config, ConfigError, load_config, write_config
from megapipe.data.loader import DataError, build_data
from megapipe.train.dry_run import describe
from megapipe.distributed.mesh import init_distributed
from megapipe.config.flops import flops_per_token
from megapipe.train.metrics import MetricsLog, peak_tflops
from megapipe.train.optim import build_optimizer
from megapipe.pipeline.engine import Pipeline
from megapipe.train.step import Parallel, build_model, evaluate, train_step


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if not (item.startswith("--") and "." in item.split("=")[0] and "=" in item):
            raise ConfigError(f"argument '{item}' is not --section.key=value")
    return args, rest


def run(cfg: Config) -> list[dict]:
    """Train (or resume) per `cfg`; returns the logged records of this invocation."""
    mesh = init_distributed(cfg)  # checks the world size before any collective
    device = torch.device(
        f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    )
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)  # dropout stream; saved and restored by checkpoints
    model, step_fn, eval_fn = _build(cfg, mesh, device)
    optimizer = build_optimizer(model, cfg.train)
    start = 0
    resume = checkpoint.resume_path(cfg)
    if resume is not None:
        start = checkpoint.load(resume, cfg, model, optimizer)["step"]
    if checkpoint.is_rank0():
        write_config(cfg, os.path.join(cfg.run.dir, "config.yaml"))
    return _loop(cfg, model, optimizer, data, start, device, step_fn, eval_fn)


def _build(cfg: Config, mesh, device):
    """(model, step function(optimizer, batch, step), eval function(data)): this rank's chunks
    and the pipeline runtime when parallel.pp > 1, else the whole (tp-sharded) model."""
    if cfg.parallel.pp > 1:
        pipe = Pipeline.build(cfg, mesh, device)
        return pipe.model, pipe.train_step, pipe.evaluate
    model = build_model(cfg, mesh, device)
    par = Parallel.build(mesh, model)

    def step_fn(optimizer, batch, step):
        return train_step(model, optimizer, batch, step, cfg, par)

    return model, step_fn, lambda data: evaluate(model, data, cfg, par)


def _loop(cfg, model, optimizer, data, start: int, device, step_fn, eval_fn) -> list[dict]:
    t, derived = cfg.train, cfg.derived
    last = t.stop_at_step or t.steps
    flops_tok, peak = flops_per_token(cfg), peak_tflops(cfg, device)
    log = MetricsLog(cfg, start, enabled=checkpoint.is_rank0())  # only rank 0 writes
    records = []
    for step in range(start, last):
        began = time.perf_counter()
        result = step_fn(optimizer, data.batch(step, t.global_batch), step)
        seconds = time.perf_counter() - began
        done = step + 1
        tokens_per_s = derived.tokens_per_step / seconds
        tflops = flops_tok * tokens_per_s / 1e12 / derived.world_size  # per device, as MFU
        record = {
            "step": done, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "consumed_tokens": done * derived.tokens_per_step,
        }  # fmt: skip
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
            record["val_loss"] = eval_fn(data)
        if done % cfg.log.interval == 0 or done == last or "val_loss" in record:
            log.log(record)
        log.progress(done, result.loss, tokens_per_s)
        records.append(record)
        interval = cfg.checkpoint.interval
        if (interval and done % interval == 0) or done == t.stop_at_step:
            extra = {
                "consumed_tokens": record["consumed_tokens"], "sampler_next_step": done,
                "lr_schedule": {"lr": t.lr, "min_lr": t.min_lr, "warmup": t.warmup,
                                "steps": t.steps, "next_lr_step": done},
            }  # fmt: skip
            checkpoint.save(cfg, done, model, optimizer, extra)
    log.close()
    return records


def main(argv: list[str] | None = None) -> int:
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            print(describe(cfg))
            return 0
        run(cfg)
    except (ConfigError, DataError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        cause = _peer_lost(e)
        if cause is None:
            raise
        print(f"error: a peer rank died or stopped responding ({cause}); see the other ranks' "
              "logs (parallel.timeout_s bounds how long a rank waits)", file=sys.stderr)
        return 3
    return 0


PEER_LOST = ("Timed out", "Connection reset", "Connection closed")  # gloo; NCCL: DistError


def _peer_lost(e: RuntimeError) -> str | None:
    """The cause, in one line, when a collective or p2p wait failed on a dead or stuck peer."""
    line = (str(e).strip() or type(e).__name__).splitlines()[0]
    if not (isinstance(e, dist.DistError) or any(w in line for w in PEER_LOST)):
        return None
    return re.sub(r"^\[[^\]]*\] ", "", line).split(". ")[0]  # gloo prefixes its source path


if __name__ == "__main__":
    sys.exit(main())
