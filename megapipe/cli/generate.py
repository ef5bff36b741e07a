"""Sample text from a megapipe checkpoint (or an HF directory written by `GPT.to_hf`).

    python tools/generate.py --checkpoint runs/tiny --prompt "To be" --max-new-tokens 50
    python tools/generate.py --hf out/hf --tokenizer data/shakespeare/tokenizer.model

The tokenizer is `--tokenizer`, else the run's `data.tokenizer`, else the one recorded in the
dataset's meta.json (`data.path`); an HF directory may hold its own tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megapipe.config.blend import parse_blend
from megapipe.data.layout import read_meta
from megapipe.data.tokenizers import load_tokenizer
from megapipe.models.hf import from_hf
from megapipe.models.sample import sample
from megapipe.train.checkpoint import CheckpointError, load_for_inference

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="checkpoint dir, or a run dir (latest)")
    source.add_argument("--hf", type=Path, help="HF model dir (from GPT.to_hf)")
    parser.add_argument("--tokenizer", type=Path, help="sentencepiece .model or HF tokenizer dir")
    parser.add_argument("--prompt", default="", help="text to continue; empty: start from EOS")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: whole vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def load_model(args: argparse.Namespace):
    """(model, tokenizer path or None) from --checkpoint or --hf."""
    if args.hf is not None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        # weights from safetensors only and no code from the directory: a model dir is data
        hf = AutoModelForCausalLM.from_pretrained(
            str(args.hf), local_files_only=True, use_safetensors=True, trust_remote_code=False
        )
        has_tokenizer = any((args.hf / name).is_file() for name in HF_TOKENIZER_FILES)
        return from_hf(hf), args.tokenizer or (args.hf if has_tokenizer else None)
    cfg, model = load_for_inference(str(args.checkpoint))
    return model, args.tokenizer or run_tokenizer_path(cfg)


def run_tokenizer_path(cfg) -> Path | None:
    """The run's `data.tokenizer`, else the tokenizer in its dataset's meta.json (a blend's
    datasets share one: the first's), else None."""
    if cfg.data.tokenizer:
        return Path(cfg.data.tokenizer)
    path = parse_blend(cfg.data.blend)[0][0] if cfg.data.blend else cfg.data.path
    if path:
        root = Path(path)
        return root / read_meta(root)["tokenizer"]
    return None


def generate(args: argparse.Namespace) -> str:
    model, tokenizer_path = load_model(args)
    if tokenizer_path is None:
        raise ValueError("no tokenizer recorded for this model (synthetic data?); pass --tokenizer")
    tokenizer = load_tokenizer(tokenizer_path)
    prompt = tokenizer.encode(args.prompt) or [tokenizer.eos_id]
    model.to(args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    ids = torch.tensor([prompt], device=args.device)
    vocab = getattr(tokenizer, "vocab_size", None)  # the model's table may be padded beyond it
    out = sample(
        model,
        ids,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        generator,
        eos_id=tokenizer.eos_id,
        vocab_size=vocab,
    )
    new = out[0, len(prompt) :].tolist()
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    # Decode prompt and continuation together: sentencepiece drops a leading space otherwise.
    return tokenizer.decode((prompt if args.prompt else []) + new)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        text = generate(args)
    except (ValueError, OSError, CheckpointError) as err:  # DataError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0
