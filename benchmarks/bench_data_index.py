"""The epochs sampler at scale: index build time, start-up time against corpus size, bytes read
per rank per step against dp, and the blend index.

python -m benchmarks.bench data_index [--docs 1e8] [--seq-len 2048] [--big-gb 1000]
    [--small-gb 1] [--batch 512] [--blend 1e7] [--dir DIR]

- build: the index of a split of --docs documents (lengths drawn in [1, 2000), mean ~1000
  tokens: a ~10^11-token split; its .bin is a sparse file, never read by the build): seconds and
  the index's bytes on disk (sample_index.build_index).
- start-up: `build_data` + the first batch of one dp rank (index already cached, as every run
  after the first and every rank but the builder sees it) on a --big-gb sparse token file and
  a --small-gb one, both of 10^6 documents; the best of 5 in fresh MemmapData objects.
- reads: token bytes each rank reads for one step (MemmapData.bytes_read: the sum of its
  pieces' lengths × itemsize) for dp 1, 2, 4, 8, against what each rank read before (the whole
  global batch), and the read's wall time.
- blend: blend_indices for --blend samples over three datasets (one greedy pass, blend.py).

Sparse files need a file system that supports them (ext4, xfs, tmpfs); --dir picks where.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from megapipe.data.blend import blend_indices
from megapipe.data.layout import read_docs, read_meta
from megapipe.data.loader import build_data
from megapipe.data.sample_index import SampleIndex
from megapipe.train.batches import BatchSlice


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=float, default=1e8, help="documents for the build")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--big-gb", type=float, default=1000, help="the large sparse corpus")
    parser.add_argument("--small-gb", type=float, default=1)
    parser.add_argument("--batch", type=int, default=512, help="global batch (rows)")
    parser.add_argument("--blend", type=float, default=1e7, help="blend samples")
    parser.add_argument("--dir", default=None, help="where the sparse datasets go (default tmp)")
    return parser.parse_args(argv)


def sparse_dataset(out: Path, docs: np.ndarray, vocab: int = 50257) -> Path:
    """A format-2 dataset of `docs` (start offsets) over an all-zero sparse uint16 .bin."""
    out.mkdir(parents=True)
    n = int(docs[-1])
    for split in ("train", "val"):
        with (out / f"{split}.bin").open("wb") as f:
            f.truncate(2 * n)  # sparse: no block is written
        np.save(out / f"{split}.docs.npy", docs)
    meta = {"format": 2, "vocab_size": vocab, "dtype": "uint16", "eos_id": 0, "tokenizer": "-",
            "n_train_tokens": n, "n_val_tokens": n, "n_train_documents": len(docs) - 1,
            "n_val_documents": len(docs) - 1, "max_train_id": 0, "max_val_id": 0}  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def even_docs(n_tokens: int, n_docs: int) -> np.ndarray:
    return np.linspace(0, n_tokens, n_docs + 1).astype(np.int64)


def bench_build(work: Path, args) -> dict:
    n_docs = int(args.docs)
    rng = np.random.default_rng(0)
    docs = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(rng.integers(1, 2000, n_docs, dtype=np.int64), out=docs[1:])
    root = sparse_dataset(work / "build", docs)
    del docs
    start = time.perf_counter()
    index = SampleIndex.open(
        root, "train", read_docs(root, "train", read_meta(root)), args.seq_len, 0, 1
    )
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in index.folder.iterdir())
    tokens = int(index.cum[n_docs])
    shutil.rmtree(root)
    return {"docs": n_docs, "tokens": tokens, "windows": index.n_samples, "seconds": seconds,
            "index_bytes": size}  # fmt: skip


def cfgs(root: Path, seq_len: int):
    data = SimpleNamespace(source="memmap", path=str(root), tokenizer="", blend="",
                           sampler="epochs")  # fmt: skip
    return data, SimpleNamespace(vocab_size=50304, seq_len=seq_len)


def startup(root: Path, args, samples: dict) -> float:
    """build_data + dp rank 0 of 8's first batch, the index cached."""
    start = time.perf_counter()
    data = build_data(*cfgs(root, args.seq_len), seed=0, samples=samples)
    data.batch(0, args.batch, rows=BatchSlice(8, 0).rows(args.batch))
    return time.perf_counter() - start


def bench_startup(work: Path, args) -> dict:
    """Both corpora built first, then their start-ups taking turns, the best of 7 each."""
    samples = {"train": 1000 * args.batch, "val": 8 * args.batch}
    out, roots = {}, {}
    for name, gb in (("small", args.small_gb), ("big", args.big_gb)):
        n = int(gb * 1e9 / 2)
        roots[name] = sparse_dataset(work / name, even_docs(n, 10**6))
        start = time.perf_counter()
        build_data(*cfgs(roots[name], args.seq_len), seed=0, samples=samples)  # the index
        out[name] = {"gb": gb, "tokens": n, "first_build_s": time.perf_counter() - start,
                     "startup_s": float("inf")}  # fmt: skip
    for _ in range(7):
        for name, root in roots.items():
            seconds = startup(root, args, samples)
            out[name]["startup_s"] = min(out[name]["startup_s"], seconds)
    return out


def bench_reads(work: Path, args) -> list[dict]:
    root = work / "small"
    samples = {"train": 1000 * args.batch, "val": 8 * args.batch}
    out = []
    for dp in (1, 2, 4, 8):
        data = build_data(*cfgs(root, args.seq_len), seed=0, samples=samples)
        data.batch(0, args.batch)  # warm: the memmaps opened, the index's pages read once
        per_rank, seconds = [], []
        for rank in range(dp):
            data.bytes_read = 0
            start = time.perf_counter()
            data.batch(3, args.batch, rows=BatchSlice(dp, rank).rows(args.batch))
            seconds.append(time.perf_counter() - start)
            per_rank.append(data.bytes_read)
        data.bytes_read = 0
        data.batch(3, args.batch)  # what every rank read before: the whole global batch
        out.append({"dp": dp, "per_rank_bytes": max(per_rank), "global_bytes": data.bytes_read,
                    "read_s": max(seconds)})  # fmt: skip
    return out


def bench_blend(args) -> dict:
    weights = np.array([0.6, 0.3, 0.1])
    start = time.perf_counter()
    blend_indices(weights, int(args.blend))
    return {"samples": int(args.blend), "datasets": 3, "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_data_index_", dir=args.dir))
    try:
        build = bench_build(work, args)
        start = bench_startup(work, args)
        reads = bench_reads(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    blend = bench_blend(args)
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; seq_len "
          f"{args.seq_len}, global batch {args.batch}\n")  # fmt: skip
    print(f"index build: {build['docs']:.0e} documents, {build['tokens']:.2e} tokens, "
          f"{build['windows']:,} windows: {build['seconds']:.1f} s, "
          f"{build['index_bytes'] / 2**20:,.0f} MiB on disk\n")  # fmt: skip
    print("| corpus | tokens | index build s (once) | start-up s (index cached) |")
    print("|---|---|---|---|")
    for name in ("small", "big"):
        r = start[name]
        print(f"| {r['gb']:g} GB sparse | {r['tokens']:.1e} | {r['first_build_s']:.2f} "
              f"| {r['startup_s'] * 1e3:.1f} ms |")  # fmt: skip
    ratio = start["big"]["startup_s"] / start["small"]["startup_s"]
    print(f"\nstart-up ratio big / small: {ratio:.2f}\n")
    print("| dp | bytes read per rank per step | before (whole batch per rank) | ratio | read ms |")
    print("|---|---|---|---|---|")
    for r in reads:
        share = r["per_rank_bytes"] / r["global_bytes"]
        print(f"| {r['dp']} | {r['per_rank_bytes']:,} | {r['global_bytes']:,} | {share:.3f} "
              f"| {r['read_s'] * 1e3:.1f} |")  # fmt: skip
    print(
        f"\nblend index: {blend['samples']:.0e} samples over {blend['datasets']} datasets: "
        f"{blend['seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
