"""Corpus preparation throughput and peak memory: tools/prepare_data.py (streaming, 1 and 2
workers) against `datasets` load_dataset("json") + map(tokenize, batched=True, num_proc=N)
over the same generated .jsonl corpus, with the sentencepiece model the preparation trained.

python tools/bench.py data [--mb 50] [--workers 1,2] [--vocab-size 2048] [--sample-mb 4]

Every run is a child process started by a small wrapper that reports the child's wall time and
its peak RSS (RUSAGE_CHILDREN: the largest single process, workers included), so runs do not
see each other's memory. Preparation time includes training the tokenizer on the sample; the
sentencepiece training alone is timed on its own row.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from megapipe.data.prepare import train_sentencepiece  # noqa: E402

# Runs argv[1:], then prints its wall seconds and peak RSS (KiB on Linux) as JSON.
WRAPPER = (
    "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(json.dumps({'seconds': time.perf_counter() - t, "
    "'peak_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"
)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50, help="generated corpus size (MB of text)")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--sample-mb", type=float, default=4, help="tokenizer training sample")
    parser.add_argument("--chunk-mb", type=float, default=16)
    parser.add_argument("--baseline", nargs=3, help=argparse.SUPPRESS)  # child: FILE MODEL N
    return parser.parse_args(argv)


def generate(path: Path, mb: float, seed: int = 0) -> int:
    """Zipf-distributed pseudo-words in lines and documents; returns the characters written."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "der", "ion", "ath", "el"]
    words = sorted({"".join(rng.choice(syllables, rng.integers(1, 5))) for _ in range(8000)})
    probs = 1.0 / np.arange(1, len(words) + 1)
    probs /= probs.sum()
    chars = 0
    with path.open("w", encoding="utf-8") as f:
        while chars < mb * 1e6:
            ids = rng.choice(len(words), size=(rng.integers(10, 60), 12), p=probs)
            doc = "\n".join(" ".join(words[i] for i in line) for line in ids) + "\n"
            f.write(json.dumps({"text": doc}) + "\n")
            chars += len(doc)
    return chars


def measure(cmd: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench run failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline(file: str, model: str, num_proc: int) -> None:
    """The plain `datasets` tokenisation (child process): documents to an Arrow ids column."""
    import datasets
    import sentencepiece as spm
    from datasets import load_dataset

    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(prefix="bench_data_hf_")
    try:
        ds = load_dataset("json", data_files=file, split="train", cache_dir=cache)
        processor = {}

        def tokenize(batch):
            sp = processor.setdefault("sp", spm.SentencePieceProcessor(model_file=model))
            return {"ids": [row + [sp.eos_id()] for row in sp.encode(batch["text"])]}

        ds = ds.map(tokenize, batched=True, num_proc=num_proc if num_proc > 1 else None,
                    remove_columns=["text"])  # fmt: skip
        assert len(ds) > 0
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def sample_training_seconds(corpus: Path, args, work: Path) -> float:
    """sentencepiece training alone, on the same first sample-mb of documents."""
    docs, chars = [], 0
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            if chars >= args.sample_mb * 1e6:
                break
            docs.append(json.loads(line)["text"])
            chars += len(docs[-1])
    start = time.perf_counter()
    train_sentencepiece(docs, work / "sample.model", args.vocab_size, seed=0)
    return time.perf_counter() - start


def row(name: str, workers: int, result: dict, mb: float, tokens: int) -> str:
    s = result["seconds"]
    return (f"| {name} | {workers} | {s:.1f} | {mb / s:.2f} | {tokens / s / 1e6:.2f} M "
            f"| {result['peak_kb'] / 1024:.0f} |")  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline:
        baseline(args.baseline[0], args.baseline[1], int(args.baseline[2]))
        return 0
    workers = [int(w) for w in args.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        corpus = work / "corpus.jsonl"
        mb = generate(corpus, args.mb) / 1e6
        rows, model = [], None
        for n in workers:
            out = work / f"prepared_{n}"
            cmd = [sys.executable, str(ROOT / "tools/prepare_data.py"), "--input", str(corpus),
                   "--out", str(out), "--vocab-size", str(args.vocab_size),
                   "--tokenizer-sample-mb", str(args.sample_mb), "--chunk-mb", str(args.chunk_mb),
                   "--workers", str(n)]  # fmt: skip
            result = measure(cmd)
            meta = json.loads((out / "meta.json").read_text())
            tokens = meta["n_train_tokens"] + meta["n_val_tokens"]
            rows.append(row("megapipe prepare_data (streaming)", n, result, mb, tokens))
            model = out / "tokenizer.model"
        for n in workers:
            cmd = [sys.executable, __file__, "--baseline", str(corpus), str(model), str(n)]
            result = measure(cmd)
            rows.append(row("datasets load_dataset + map", n, result, mb, tokens))
        train_s = sample_training_seconds(corpus, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus: {mb:.1f} MB of text (.jsonl), {tokens / 1e6:.1f} M tokens, vocab "
          f"{args.vocab_size}, chunk {args.chunk_mb} MB, sample {args.sample_mb} MB\n")  # fmt: skip
    print("| method | workers | wall s | text MB/s | tokens/s | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nsentencepiece training on the {args.sample_mb} MB sample alone: {train_s:.1f} s "
          "(included in the prepare_data rows, not in the datasets rows)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
