"""Downstream tasks scored beside the validation loss: `train.eval_tasks` in training
(`TaskEval`, built once by the loop) and tools/evaluate.py on a checkpoint (`score_task`).

A task is its items (train/hellaswag.py) scored by train/choices.py from per-token log-probs:
in training those of the job's engine on its mesh (train/evaluate.EngineLogprobs: any pp, cp,
tp, ZeRO level), the dp replicas splitting the items; in tools/evaluate.py those of a checkpoint
(of any mesh) loaded whole, the processes splitting the items. The per-item scores are gathered
so every rank returns the same figures.
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
from megapipe.train.evaluate import EngineLogprobs
from megapipe.train.hellaswag import read_items

TASKS = {"hellaswag": read_items}  # name -> read(path or None for the Hub, limit) -> items
PAD = choices.Request((0,), (0,))  # a request that fills a rank's share up (its score dropped)


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
    logprobs_of: Callable[[torch.Tensor], torch.Tensor],
    seq_len: int,
    batch_size: int,
    device="cpu",
    progress: Callable | None = None,
    group=None,
) -> tuple[dict, list[dict]]:
    """({"task", "n", "acc", "acc_norm"}, per-item scores) of `items`, by `logprobs_of`
    (choices.loglikelihoods). With a process `group` each of its ranks scores every world-th
    item, padded with one-token requests to the largest share so every rank makes the same
    number of `logprobs_of` calls (an engine's collectives then pair up), and the scores are
    gathered in item order; None: this process scores them all."""
    rank, world = 0, 1
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = list(items[rank::world])
    requests = choices.requests_of(mine, tokenizer)
    most = max(sum(len(item.choices) for item in items[r::world]) for r in range(world))
    padded = requests + [PAD] * (most - len(requests))
    lls = choices.loglikelihoods(logprobs_of, padded, seq_len, batch_size, device, progress)
    scores = choices.item_scores(mine, lls[: len(requests)])
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
        """The scores of the job's model through its engine, on any mesh (EngineLogprobs:
        the rows of a call go through the pipeline's stages, over cp and tp as in training);
        the dp replicas split the items, so every rank returns the same figures."""
        out: dict[str, float] = {}
        if not self.names:
            return out
        logprobs_of = EngineLogprobs(job.engine, job.slice, self.cfg)
        dp = job.mesh.group("dp") if job.mesh is not None and job.mesh.size("dp") > 1 else None
        for name in self.names:
            result, _ = score_task(
                name, self.items[name], self.tokenizer, logprobs_of, self.cfg.model.seq_len,
                logprobs_of.rows, job.engine.device, group=dp,
            )  # fmt: skip
            out[f"{name}_acc"], out[f"{name}_acc_norm"] = result["acc"], result["acc_norm"]
        return out
