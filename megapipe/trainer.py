"""One training step and one validation pass, for a model held whole by this process.

Loss is the mean over every target token of the global batch: each microbatch's summed cross
entropy is divided by the global token count before backward, so gradient accumulation over
microbatches equals one large batch (GPipe §2.2's micro-batching with exact normalisation).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from megapipe.config import Config
from megapipe.optim import clip_gradients, global_grad_norm, lr_at, set_lr


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


def autocast(cfg: Config, device: torch.device):
    """bfloat16 autocast when train.dtype says so; parameters and optimizer stay float32."""
    if cfg.train.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def split_inputs(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) token rows -> inputs (B, T) and next-token targets (B, T)."""
    return batch[:, :-1], batch[:, 1:]


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, step: int, cfg: Config
) -> StepResult:
    """Forward/backward every microbatch of this rank's `batch`, clip, and take one AdamW step.

    `step` is the number of optimizer steps already taken (it picks the learning rate).
    """
    device = next(model.parameters()).device
    global_tokens = cfg.train.global_batch * cfg.model.seq_len
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for micro in batch.to(device).chunk(cfg.parallel.microbatches):
        inputs, targets = split_inputs(micro)
        with autocast(cfg, device):
            loss = model(inputs, targets)
        (loss / global_tokens).backward()
        loss_sum += loss.detach()
    params = [p for p in model.parameters()]
    norm = global_grad_norm(params)
    clip_gradients(params, norm, cfg.train.grad_clip)
    lr = lr_at(step, cfg.train)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=(loss_sum / global_tokens).item(), grad_norm=norm.item(), lr=lr)


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: Config) -> float:
    """Mean validation loss over `train.eval_batches` fixed batches of `global_batch` rows."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    for i in range(cfg.train.eval_batches):
        batch = data.batch(i, cfg.train.global_batch, split="val").to(device)
        for micro in batch.chunk(cfg.parallel.microbatches):
            inputs, targets = split_inputs(micro)
            with autocast(cfg, device):
                total += model(inputs, targets).item()
            count += targets.numel()
    model.train()
    return total / count
