"""Downstream tasks scored beside the validation loss: `train.eval_tasks` in training
(`TaskEval`, built once by the loop) and tools/evaluate.py on a checkpoint (`score_task`).

A task is its items (train/hellaswag.py) scored by train/choices.py. The model is whole on the
process that scores (pp = cp = 1 in training, config/checks.py; a checkpoint of any mesh is
loaded whole by tools/evaluate.py); `ranks` split the items between processes that each hold
it, and the per-item scores are gathered so every rank returns the same figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.config.blend import parse_blend
from megapipe.data.layout import read_meta
from megapipe.data.tokenizers import load_tokenizer
from megapipe.train import choices
from megapipe.train.hellaswag import read_items

TASKS = {"hellaswag": read_items}  # name -> read(path or None for the Hub, limit) -> items


def task_names(text: str) -> list[str]:
    """`train.eval_tasks` ("hellaswag" or "a,b") as names; "" -> none."""
    return [name.strip() for name in text.split(",") if name.strip()]


def run_tokenizer_path(cfg: Config) -> Path | None:
    """The run's `data.tokenizer`, else the one its dataset's meta.json names (a blend's
    datasets share one: the first's); None for synthetic data."""
    if cfg.data.tokenizer:
        return Path(cfg.data.tokenizer)
    path = parse_blend(cfg.data.blend)[0][0] if cfg.data.blend else cfg.data.path
    if cfg.data.source != "memmap" or not path:
        return None
    return Path(path) / read_meta(Path(path))["tokenizer"]


def score_task(
    task: str,
    items: Sequence,
    tokenizer,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    seq_len: int,
    batch_size: int,
    device="cpu",
    progress: Callable | None = None,
    group=None,
) -> tuple[dict, list[dict]]:
    """({"task", "n", "acc", "acc_norm"}, per-item scores) of `items`. With a process `group`
    each of its ranks scores every world-th item and the scores are gathered in item order;
    None: this process scores them all."""
    rank, world = 0, 1
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = list(items[rank::world])
    requests = choices.requests_of(mine, tokenizer)
    lls = choices.loglikelihoods(logits_of, requests, seq_len, batch_size, device, progress)
    scores = choices.item_scores(mine, lls)
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, scores, group=group)
        scores = [gathered[i % world][i // world] for i in range(len(items))]
    return choices.summary(task, scores), scores


class TaskEval:
    """`train.eval_tasks` scored at each evaluation on the model being trained: the records'
    `<task>_acc` and `<task>_acc_norm`. Items and tokenizer are read once, when built."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.names = task_names(cfg.train.eval_tasks)
        path = cfg.train.eval_tasks_data or None
        self.items = {name: TASKS[name](path) for name in self.names}
        self.tokenizer = load_tokenizer(run_tokenizer_path(cfg)) if self.names else None

    def __bool__(self) -> bool:
        return bool(self.names)

    @torch.no_grad()
    def __call__(self, job) -> dict[str, float]:
        """The scores of `job.model` (pp = 1: the whole GPT on this rank, its tp shards
        joined by its forward); every rank runs the same forwards, as tp needs."""
        out: dict[str, float] = {}
        device = next(job.model.parameters()).device
        was_training = job.model.training
        job.model.eval()
        with job.full_weights():
            for name in self.names:
                result, _ = score_task(
                    name, self.items[name], self.tokenizer, job.model,
                    self.cfg.model.seq_len, self.cfg.train.global_batch, device,
                )  # fmt: skip
                out[f"{name}_acc"], out[f"{name}_acc_norm"] = result["acc"], result["acc_norm"]
        job.model.train(was_training)
        return out
