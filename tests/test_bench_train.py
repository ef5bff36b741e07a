"""benchmarks/bench_train.py (`python -m benchmarks.bench train`): what its rows report (page
faults a step, the paired ratios), and the claim behind --keep-freed-memory: once glibc's malloc
keeps freed memory, a large block made again is served by pages already mapped instead of fresh
ones (a fault per 4 KiB). What that does to each variant's step is the benchmark's own
page-fault column."""

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import bench_train

ROOT = Path(__file__).resolve().parents[1]


def test_rows_report_median_faults_and_each_rounds_ratio():
    s = bench_train.Shape("default", 1, 8, 1, 16, 2, 4, "float32", "cpu")
    times = {"eager": [1.0, 2.0, 4.0], "transformers": [2.0, 3.0, 4.0]}
    faults = {"eager": [5, 1, 3], "transformers": [100, 90, 80]}
    rows = bench_train.variant_rows(s, times, faults, {})
    eager, base = rows["megapipe eager"], rows["transformers"]
    assert (eager["faults_per_step"], base["faults_per_step"]) == (3, 90)
    assert eager["paired_ratios"] == [1.0, 1.5, 2.0]  # transformers' seconds over eager's
    assert eager["tokens_per_s"] == 8 / 2.0 and "paired_ratios" not in base


def _faults_per_remade_block(keep: bool) -> float:
    """Minor faults each time a 48 MiB block (above glibc's largest dynamic mmap threshold,
    32 MiB) is malloc'ed, written and freed, in a fresh process."""
    code = textwrap.dedent(f"""
        import ctypes, ctypes.util
        from benchmarks import bench_train
        if {keep}:
            bench_train.keep_freed_memory()
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        def remake(n=48 * 2**20):
            p = libc.malloc(n)
            ctypes.memset(p, 1, n)
            libc.free(p)
        remake()
        before = bench_train.minor_faults()
        for _ in range(8):
            remake()
        print((bench_train.minor_faults() - before) / 8)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        cwd=ROOT,
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_serves_a_remade_block_from_mapped_pages():
    pages = 48 * 2**20 // 4096
    assert _faults_per_remade_block(keep=False) > pages / 2  # fresh pages every time
    assert _faults_per_remade_block(keep=True) < pages / 50
