"""One training step and one validation pass, on one process or on a dp × tp mesh.

Loss is the mean over every target token of the global batch: each microbatch's summed cross
entropy is divided by the global token count before backward, so gradient accumulation over
microbatches (GPipe §2.2) and the dp sum of gradients both equal one large batch. DP rank r
takes rows [r·B/dp, (r+1)·B/dp) of the global batch; tp ranks see the same rows (design.md).
CP rank c takes its zigzag slice of every row's inputs and targets, so the summed loss and the
token count over dp × cp are those of the whole batch, and gradients are summed over dp × cp.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megapipe.config import Config
from megapipe.parallel.context.ring import NO_CP, CPInfo
from megapipe.parallel.data.reducer import GradReducer, finish_gradients
from megapipe.train.optim import clip_gradients, global_grad_norm, lr_at, set_lr
from megapipe.parallel.tensor.grad_sync import grads_counted_once


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


@dataclass
class Parallel:
    """What a step needs from the mesh: the dp rows, the cp slice, the reducer over dp × cp and
    the norm group."""

    dp_size: int = 1
    dp_rank: int = 0
    sum_group: object = None  # dp × cp: the ranks that hold the same weights, different tokens
    norm_group: object = None
    reducer: GradReducer | None = None
    cp: CPInfo = NO_CP

    @staticmethod
    def build(mesh, model: nn.Module, bucket_mb: float = 25.0) -> Parallel:
        if mesh is None:
            return Parallel()
        dp, cp = mesh.size("dp"), mesh.size("cp")
        group = mesh.dp_cp_group if cp > 1 else mesh.group("dp")
        reducer = GradReducer(model, group, bucket_mb) if dp * cp > 1 else None
        return Parallel(dp, mesh.coord("dp"), group, mesh.norm_group, reducer, mesh.cp_info())

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This dp rank's slice of the global batch."""
        return batch.chunk(self.dp_size)[self.dp_rank] if self.dp_size > 1 else batch

    def local_inputs(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, T+1) token rows -> this cp rank's zigzag slice of inputs and targets (b, T/cp)."""
        inputs, targets = split_inputs(rows)
        return self.cp.shard(inputs), self.cp.shard(targets)

    def dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over dp × cp: every rank's share of the loss and the token count."""
        if self.dp_size * self.cp.size > 1:
            dist.all_reduce(x, group=self.sum_group)
        return x


SINGLE = Parallel()


def autocast(cfg: Config, device: torch.device):
    """bfloat16 autocast when train.dtype says so; parameters and optimizer stay float32."""
    if cfg.train.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def split_inputs(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) token rows -> inputs (B, T) and next-token targets (B, T)."""
    return batch[:, :-1], batch[:, 1:]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    step: int,
    cfg: Config,
    par: Parallel = SINGLE,
) -> StepResult:
    """Forward/backward every microbatch of this rank's slice of the global `batch`, reduce
    gradients over the mesh, clip, and take one AdamW step.

    `step` is the number of optimizer steps already taken (it picks the learning rate).
    """
    device = next(model.parameters()).device
    global_tokens = cfg.train.global_batch * cfg.model.seq_len
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    micros = par.local_rows(batch.to(device)).chunk(cfg.parallel.microbatches)
    for i, micro in enumerate(micros):
        last = i == len(micros) - 1
        sync = par.reducer.no_sync() if par.reducer and not last else contextlib.nullcontext()
        inputs, targets = par.local_inputs(micro)
        with sync:
            with autocast(cfg, device):
                loss = model(inputs, targets)
            (loss / global_tokens).backward()
        loss_sum += loss.detach()
    finish_gradients(model, par.reducer)
    norm = global_grad_norm(grads_counted_once(model), par.norm_group)
    lr = clip_and_step(optimizer, list(model.parameters()), norm, step, cfg)
    loss = par.dp_sum(loss_sum) / global_tokens
    return StepResult(loss=loss.item(), grad_norm=norm.item(), lr=lr)


def clip_and_step(optimizer, params: list, norm: torch.Tensor, step: int, cfg: Config) -> float:
    """Clip to `train.grad_clip` by the global `norm`, set this step's LR, take the AdamW step
    and clear the grads; returns the LR used. Shared by the plain and the pipelined step."""
    clip_gradients(params, norm, cfg.train.grad_clip)
    lr = lr_at(step, cfg.train)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: Config, par: Parallel = SINGLE) -> float:
    """Mean validation loss over `train.eval_batches` fixed batches of `global_batch` rows."""
    device = next(model.parameters()).device
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, token count
    for i in range(cfg.train.eval_batches):
        batch = par.local_rows(data.batch(i, cfg.train.global_batch, split="val").to(device))
        for micro in batch.chunk(cfg.parallel.microbatches):
            inputs, targets = par.local_inputs(micro)
            with autocast(cfg, device):
                total[0] += model(inputs, targets).item()
            total[1] += targets.numel()
    model.train()
    total = par.dp_sum(total)
    return (total[0] / total[1]).item()


def build_model(
    cfg: Config, mesh=None, device: torch.device | str = "cpu", blocks: range | None = None
) -> nn.Module:
    """The GPT of `cfg` (or its `blocks`: a pipeline chunk), sharded over the mesh's tp axis
    and running ring attention over its cp axis."""
    from megapipe.parallel.tensor.sharding import NO_TP
    from models.gpt import GPT

    tp = NO_TP if mesh is None else mesh.tp_info(cfg.parallel.sequence_parallel, cfg.train.seed)
    cp = NO_CP if mesh is None else mesh.cp_info()
    model = GPT(cfg.model, blocks, seed=cfg.train.seed, tp=tp, recompute=cfg.recompute, cp=cp)
    return model.to(device)
