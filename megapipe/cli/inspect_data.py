"""What each step trains on: `tools/inspect_data.py`'s command line.

    python tools/inspect_data.py --config FILE [--section.key=value ...] --steps A:B
        [--dp-rank R] [--split train|val] [--json] [--decode] [--verify]

For steps A..B-1 of the config's run (the same data, sampler, seed and global batch), the rows
each step trains on: all of them, or dp rank R's of the config's mesh (`--parallel.dp=D
--dp-rank R` shows rank R's rows of a mesh without launching it). With --json one line per step,
{"step": s, "dp_rank": r (null: the whole batch), "rows": [ROW, ...]}, each ROW the list of its
pieces [document index, begin, end] in order (begin/end: token offsets in the split's .bin; a
row's pieces add up to seq_len + 1 tokens; a blend adds the dataset's name as a fourth item);
with --decode also "text": each row decoded by the dataset's tokenizer. Without --json the same
as readable lines. --verify first rescans the split of every dataset: its largest id against
meta.json, its EOS positions against docs.npy, one line each on stderr (exit code 1 if they
differ); --steps may then be left out. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from megapipe.config import ConfigError, load_config
from megapipe.config.args import parse_train_args
from megapipe.data.blend import BlendData
from megapipe.data.errors import DataError
from megapipe.data.inspect import row_pieces, verify
from megapipe.data.loader import build_data, run_samples
from megapipe.data.tokenizers import load_tokenizer
from megapipe.train.batches import BatchSlice


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="inspect_data.py", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", help="A:B, the steps A..B-1 (or one step A)")
    parser.add_argument("--dp-rank", type=int, default=None, help="only this dp rank's rows")
    parser.add_argument("--split", default="train", choices=("train", "val"))
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument("--decode", action="store_true", help="each row's text")
    parser.add_argument("--verify", action="store_true", help="rescan the split first")
    args, rest = parser.parse_known_args(argv)
    config, overrides = parse_train_args(rest)  # --config and --section.key=value, as train.py
    if config.dry_run:
        raise ConfigError("--dry-run is train.py's; inspect_data.py only reads the data")
    args.config = config.config
    return args, overrides


def step_range(text: str) -> range:
    low, sep, high = text.partition(":")
    try:
        steps = range(int(low), int(high) if sep else int(low) + 1)
    except ValueError:
        raise ConfigError(f"--steps {text!r} is not A:B (two step numbers)") from None
    if steps.start < 0 or not len(steps):
        raise ConfigError(f"--steps {text!r} is empty or negative; give A:B with 0 <= A < B")
    return steps


def main(argv: list[str] | None = None) -> int:
    try:
        return inspect(*parse(sys.argv[1:] if argv is None else argv))
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    if args.steps is None and not args.verify:
        raise ConfigError("give --steps A:B (the steps to show) or --verify")
    steps = step_range(args.steps) if args.steps is not None else range(0)
    size = cfg.train.global_batch
    dp = cfg.parallel.dp
    if args.dp_rank is not None and not 0 <= args.dp_rank < dp:
        raise ConfigError(f"--dp-rank {args.dp_rank} is not in [0, parallel.dp={dp})")
    if cfg.data.source != "memmap":
        raise ConfigError("data.source=synthetic has no documents to show; use a memmap dataset")
    data = build_data(cfg.data, cfg.model, cfg.train.seed, run_samples(cfg.train))
    status = _verify(data, args.split) if args.verify else 0
    rank = args.dp_rank
    picked = range(size)[BatchSlice(dp, rank).rows(size) if rank is not None else slice(None)]
    tokenizer = load_tokenizer(data.tokenizer_path) if args.decode else None
    for step in steps:
        rows = row_pieces(data, step, size, args.split, picked)
        record = {"step": step, "dp_rank": rank, "rows": rows}
        if tokenizer is not None:
            tokens = data.batch(step, size, args.split, slice(picked.start, picked.stop))
            record["text"] = [tokenizer.decode(row.tolist()) for row in tokens]
        print(json.dumps(record) if args.json else _readable(record))
    return status


def _readable(record: dict) -> str:
    where = "all rows" if record["dp_rank"] is None else f"dp rank {record['dp_rank']}"
    lines = [f"step {record['step']} ({where})"]
    for i, row in enumerate(record["rows"]):
        pieces = ", ".join(
            (f"{p[3]}:" if len(p) > 3 else "") + f"doc {p[0]} [{p[1]}:{p[2]})" for p in row
        )
        lines.append(f"  row {i}: {pieces}")
        if "text" in record:
            lines.append("    " + repr(record["text"][i]))
    return "\n".join(lines)


def _verify(data, split: str) -> int:
    """Rescan `split` of every dataset; one line each; 1 if any disagrees with its records."""
    datasets = data.datasets if isinstance(data, BlendData) else {data.root.name: data}
    status = 0
    for name, one in datasets.items():
        scan = verify(one, split)
        recorded = "not recorded" if scan.recorded_largest is None else scan.recorded_largest
        docs = "no docs.npy" if scan.documents is None else f"{scan.documents} documents"
        print(
            f"verify {name} {split}: {scan.tokens} tokens, largest id {scan.largest} (meta: "
            f"{recorded}), {scan.eos} EOS, {docs}, {scan.eos_mismatches} EOS positions off "
            f"the document ends: {'ok' if scan.ok else 'MISMATCH'}",
            file=sys.stderr,  # stdout stays the steps' lines (--json)
        )
        status |= 0 if scan.ok else 1
    return status
