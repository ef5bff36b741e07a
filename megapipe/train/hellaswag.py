"""HellaSwag (Zellers et al. 2019) as multiple choice: its rows turned into (query, choices,
gold) items exactly as lm-evaluation-harness's task does, read from a local jsonl or the Hub.

The preprocessing is lm-eval 0.4.13's tasks/hellaswag/utils.py (`preprocess`, `process_docs`):
the query is `activity_label + ": " + ctx_a + " " + ctx_b.capitalize()`, and query and endings
lose WikiHow's " [title]" marks (-> ". "), other bracketed text and doubled spaces. The scoring
of the items is train/choices.py's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megapipe.data.errors import DataError

HUB_DATASET = "Rowan/hellaswag"  # lm-eval's hellaswag.yaml dataset_path; its validation split
# The Hub's auto-converted parquet of the repository: `datasets` >= 4 refuses the script
# (hellaswag.py) its main revision may hold, and reads this revision alike online or cached.
HUB_REVISION = "refs/convert/parquet"
FIELDS = "ctx (or ctx_a and ctx_b), endings, label"


@dataclass(frozen=True)
class Item:
    """One multiple-choice question: the context, its candidate endings, the right one."""

    query: str
    choices: tuple[str, ...]
    gold: int


def preprocess(text: str) -> str:
    """lm-eval's hellaswag `preprocess`, step for step (its order matters: " [title]" first)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")  # a WikiHow artifact
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def item_of(row: dict, where: str = "row") -> Item:
    """An Item from a Hub row (ctx_a, ctx_b, activity_label, endings, label); a row with only
    `ctx` (and no activity_label) is taken as that context as it stands."""
    try:
        if "ctx_a" in row and "ctx_b" in row:
            ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        else:
            ctx = row["ctx"]
        label = row.get("activity_label")
        query = preprocess(f"{label}: {ctx}" if label is not None else ctx)
        choices = tuple(preprocess(e) for e in row["endings"])
        gold = int(row["label"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"HellaSwag {where}: needs {FIELDS} ({type(e).__name__}: {e})") from None
    if not 0 <= gold < len(choices):
        raise DataError(f"HellaSwag {where}: label {gold} is not one of its {len(choices)} endings")
    return Item(query, choices, gold)


def read_jsonl(path: Path) -> list[Item]:
    """Items from a jsonl file of HellaSwag rows."""
    if not path.is_file():
        raise DataError(f"HellaSwag data '{path}' not found; give a jsonl of {FIELDS}")
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n}: not JSON ({e})") from None
            items.append(item_of(row, f"{path} line {n}"))
    if not items:
        raise DataError(f"HellaSwag data '{path}' holds no rows; give a jsonl of {FIELDS}")
    return items


def read_hub() -> list[Item]:
    """The validation split of Rowan/hellaswag through `datasets` (downloaded, or from the HF
    cache when offline)."""
    import datasets

    try:
        rows = datasets.load_dataset(HUB_DATASET, split="validation", revision=HUB_REVISION)
    except Exception as e:  # offline, no cache, the Hub down: the fix is the same
        raise DataError(
            f"HellaSwag: cannot load {HUB_DATASET} from the Hub ({type(e).__name__}); "
            f"pass --data FILE (a jsonl of {FIELDS})"
        ) from None
    return [item_of(row, f"{HUB_DATASET} row {i}") for i, row in enumerate(rows)]


def read_items(path: str | Path | None, limit: int = 0) -> list[Item]:
    """HellaSwag items from `path` (jsonl), or the Hub when None; the first `limit` (0: all)."""
    items = read_jsonl(Path(path)) if path else read_hub()
    return items[:limit] if limit else items
