"""Export a megapipe checkpoint (any mesh) to a transformers directory with the run's tokenizer.

    python tools/export_hf.py --checkpoint runs/shakespeare_tiny --out out/hf
    python tools/export_hf.py --checkpoint runs/x/checkpoints/step_00000400 --out out/hf --force

`--checkpoint` is a step_* dir or a run dir (its newest complete checkpoint). The result loads
with `transformers.AutoModelForCausalLM.from_pretrained(out)` (GPT-2 or Llama class, by
model.arch) and `AutoTokenizer.from_pretrained(out)`; config.json's bos/eos ids are the run's
eos id. How the tokenizer is found and converted: megapipe/train/export.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megapipe.data.errors import DataError
from megapipe.train.checkpoint import CheckpointError
from megapipe.train.export import ExportError, export_hf


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="step_* dir, or a run dir (newest)"
    )
    parser.add_argument("--out", type=Path, required=True, help="the transformers dir to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer", type=Path, help="sentencepiece .model or HF dir (default: the run's)"
    )
    tok.add_argument("--no-tokenizer", action="store_true", help="export the weights only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        done = export_hf(
            args.checkpoint,
            args.out,
            force=args.force,
            tokenizer=args.tokenizer,
            with_tokenizer=not args.no_tokenizer,
        )
    except (ExportError, CheckpointError, DataError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    m = done.cfg.model
    print(
        f"exported step {done.step} of {done.checkpoint} ({m.arch}, {done.n_params:,} "
        f"parameters) to {done.out}"
    )
    if done.tokenizer is not None:
        how = "HF tokenizer dir" if done.tokenizer.is_dir() else "sentencepiece -> tokenizer.json"
        print(f"tokenizer: {done.tokenizer} ({how}); bos_token_id = eos_token_id = {done.eos_id}")
    for note in done.notes:
        print(note)
    return 0
