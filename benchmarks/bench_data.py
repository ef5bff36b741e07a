"""Corpus preparation throughput and peak memory: tools/prepare_data.py (streaming, 1 and 2
workers) against `datasets` load_dataset("json") + map(tokenize, batched=True, num_proc=N)
over the same generated .jsonl corpus, with the same sentencepiece model.

python -m benchmarks.bench data [--mb 50] [--workers 1,2] [--repeat 1] [--vocab-size 2048]

The tokenizer is trained once, on the first --sample-mb of the corpus (its time is printed on
its own line), and both sides are given it: prepare_data with --tokenizer FILE.model, the
baseline as the SentencePieceProcessor its map function calls on each batch, as a user would
write it (`sp.encode(batch["text"])`, sentencepiece's default threads). Both sides start from
the .jsonl file and end with every token on disk (train.bin/val.bin; the baseline's Arrow
cache), and the baseline's token count is checked against prepare_data's.

Every run is a child process started by a small wrapper that reports the child's wall time,
its CPU time (user + system, workers included) and its peak RSS (RUSAGE_CHILDREN: the largest
single process, workers included), so runs do not see each other's memory. With --repeat R
the runs alternate between the two sides R times and the fastest wall time of each row is
kept (with its CPU time), which damps the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import ROOT
from megapipe.data.prepare import train_sentencepiece

# Runs argv[1:], then prints its wall seconds, CPU seconds and peak RSS (KiB on Linux) as JSON.
WRAPPER = (
    "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print(json.dumps({'seconds': time.perf_counter() - t, 'cpu': u.ru_utime + u.ru_stime, "
    "'peak_kb': u.ru_maxrss}))"
)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50, help="generated corpus size (MB of text)")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; the fastest kept")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--sample-mb", type=float, default=4, help="tokenizer training sample")
    parser.add_argument("--chunk-mb", type=float, default=4)
    parser.add_argument("--baseline", nargs=4, help=argparse.SUPPRESS)  # child: FILE MODEL N OUT
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


def baseline(file: str, model: str, num_proc: int, out: str) -> None:
    """The plain `datasets` tokenisation (child process): documents to an Arrow ids column;
    writes its token count (EOS included) to `out`."""
    import datasets
    import pyarrow.compute as pc
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
        tokens = pc.sum(pc.list_value_length(ds.data.column("ids"))).as_py()  # no Python ints
        Path(out).write_text(json.dumps({"tokens": tokens}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def train_tokenizer(corpus: Path, args, model: Path) -> float:
    """sentencepiece trained on the first sample-mb of documents, as prepare_data would; its
    seconds."""
    docs, chars = [], 0
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            if chars >= args.sample_mb * 1e6:
                break
            docs.append(json.loads(line)["text"])
            chars += len(docs[-1])
    start = time.perf_counter()
    train_sentencepiece(docs, model, args.vocab_size, seed=0)
    return time.perf_counter() - start


def row(name: str, workers: int, result: dict, mb: float, tokens: int) -> str:
    s = result["seconds"]
    return (f"| {name} | {workers} | {s:.1f} | {result['cpu']:.1f} | {mb / s:.2f} "
            f"| {tokens / s / 1e6:.2f} M | {result['peak_kb'] / 1024:.0f} |")  # fmt: skip


def fastest(results: list[dict]) -> dict:
    return min(results, key=lambda r: r["seconds"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline:
        baseline(args.baseline[0], args.baseline[1], int(args.baseline[2]), args.baseline[3])
        return 0
    workers = [int(w) for w in args.workers.split(",")]
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        corpus, model = work / "corpus.jsonl", work / "tokenizer.model"
        mb = generate(corpus, args.mb) / 1e6
        train_s = train_tokenizer(corpus, args, model)
        runs: dict[tuple[str, int], list[dict]] = {}
        tokens = 0
        for _ in range(args.repeat):
            for n in workers:
                out = work / f"prepared_{n}"
                cmd = [sys.executable, str(ROOT / "tools/prepare_data.py"), "--input", str(corpus),
                       "--out", str(out), "--tokenizer", str(model), "--chunk-mb",
                       str(args.chunk_mb), "--workers", str(n)]  # fmt: skip
                runs.setdefault(("ours", n), []).append(measure(cmd))
                meta = json.loads((out / "meta.json").read_text())
                tokens = meta["n_train_tokens"] + meta["n_val_tokens"]
                shutil.rmtree(out)
                count = work / "baseline_tokens.json"
                cmd = [sys.executable, "-m", "benchmarks.bench_data", "--baseline", str(corpus),
                       str(model), str(n), str(count)]  # fmt: skip
                runs.setdefault(("datasets", n), []).append(measure(cmd))
                theirs = json.loads(count.read_text())["tokens"]
                if theirs != tokens:
                    raise SystemExit(f"token counts differ: datasets {theirs}, ours {tokens}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    names = {"ours": "megapipe prepare_data (streaming)", "datasets": "datasets load_dataset + map"}
    print(f"corpus: {mb:.1f} MB of text (.jsonl), {tokens / 1e6:.1f} M tokens, vocab "
          f"{args.vocab_size}, chunk {args.chunk_mb} MB, best of {args.repeat}; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} "
          "cores (wall times mean little on a busy machine; CPU s are steadier)\n")  # fmt: skip
    print("| method | workers | wall s | CPU s | text MB/s | tokens/s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for side in ("ours", "datasets"):
        for n in workers:
            print(row(names[side], n, fastest(runs[side, n]), mb, tokens))
    print(f"\nsentencepiece training on the first {args.sample_mb} MB: {train_s:.1f} s (done "
          "once before the runs; prepare_data without --tokenizer adds it)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
