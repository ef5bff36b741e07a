"""Score a megapipe checkpoint (saved on any mesh) on a downstream task, as lm-evaluation-harness
scores it (megapipe/train/choices.py).

    python tools/evaluate.py --checkpoint runs/gpt2 --task hellaswag --json
    python tools/evaluate.py --checkpoint runs/gpt2 --task hellaswag --data hellaswag_val.jsonl
    torchrun --nproc_per_node=4 tools/evaluate.py --checkpoint runs/gpt2 --task hellaswag

The checkpoint is loaded whole (its tensors are stored under logical names, whatever mesh wrote
them); under torchrun each rank holds the model and scores every world-th item, and rank 0
prints. The last line is {"task", "n", "acc", "acc_norm"} (JSON with --json); --items FILE
writes each item's choice log-probs and scores as jsonl. Without --data the task's Hub dataset
is read (Rowan/hellaswag, validation split).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from megapipe.data.tokenizers import load_tokenizer
from megapipe.train import choices
from megapipe.train.checkpoint import CheckpointError, load_for_inference
from megapipe.train.tasks import TASKS, run_tokenizer_path, score_task


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="step_* dir, or a run dir (newest)"
    )
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--data", type=Path, help="local jsonl of the task's rows (default: Hub)")
    parser.add_argument("--tokenizer", type=Path, help="sentencepiece .model or HF dir")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per forward")
    parser.add_argument("--limit", type=int, default=0, help="score the first N items; 0: all")
    parser.add_argument("--items", type=Path, help="write per-item scores here (jsonl)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def init_group(device: str):
    """The world group under torchrun (WORLD_SIZE > 1), else None (one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.group.WORLD


def evaluate(args: argparse.Namespace, group=None) -> tuple[dict, list[dict]]:
    cfg, model = load_for_inference(str(args.checkpoint))
    path = args.tokenizer or run_tokenizer_path(cfg)
    if path is None:
        raise ValueError("no tokenizer recorded for this run (synthetic data?); pass --tokenizer")
    tokenizer = load_tokenizer(path)
    items = TASKS[args.task](args.data, args.limit)
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else args.device
    model.to(device)
    rank0 = group is None or dist.get_rank(group) == 0
    world = 1 if group is None else dist.get_world_size(group)
    # every rank's share is padded to the largest (score_task)
    requests = max(sum(len(item.choices) for item in items[r::world]) for r in range(world))
    with tqdm(total=requests, desc=args.task, unit="req", disable=not rank0) as bar:
        return score_task(
            args.task, items, tokenizer, choices.from_logits(model), cfg.model.seq_len,
            args.batch_size, device, bar.update, group,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1 or args.limit < 0:
        print("error: --batch-size must be >= 1 and --limit >= 0", file=sys.stderr)
        return 2
    try:
        group = init_group(args.device)
        result, scores = evaluate(args, group)
    except (ValueError, OSError, CheckpointError) as err:  # DataError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    if group is not None and dist.get_rank(group) != 0:
        return 0
    if args.items is not None:
        with open(args.items, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"item": i, **s}) + "\n" for i, s in enumerate(scores))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['task']}: n {result['n']}, acc {result['acc']:.4f}, "
            f"acc_norm {result['acc_norm']:.4f}"
        )
    return 0
