"""What every benchmark shares: a gloo world of spawned processes with one torch thread each,
variants timed in alternating rounds, medians with their spread, JSON out, and a command line
whose bad input is one line and exit code 2.

Run from the repo root with the project installed: `python -m benchmarks.bench NAME ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from megapipe.distributed.local_world import free_port, spawn  # noqa: F401 (the harness's)

ROOT = Path(__file__).resolve().parents[1]  # the checkout the benchmarks run from
T = TypeVar("T")


class UsageError(ValueError):
    """Bad command-line input: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors raise UsageError (one line, exit 2) instead of printing usage."""

    def error(self, message: str):
        raise UsageError(message)


def add_model_args(p: argparse.ArgumentParser, vocab: int) -> None:
    """The small GPT a spawned benchmark trains: --layers, --d-model, --heads, --seq-len,
    --vocab (default `vocab`), --batch (global, rows of seq-len tokens)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows of seq-len tokens)")


def echo_command(name: str, argv: list[str]) -> None:
    """Print the command line this benchmark was run with, so its output says how to rerun it."""
    print(f"$ {' '.join([f'python -m benchmarks.bench {name}', *argv])}\n")


def say(text: str) -> None:
    """Progress on stderr, so stdout stays the result."""
    print(text, file=sys.stderr, flush=True)


# -- a gloo world ---------------------------------------------------------------------------


# spawn and free_port: megapipe/distributed/local_world.py


# -- rounds and their statistics ------------------------------------------------------------


def alternate(
    variants: dict[str, Callable[[], T]], rounds: int, rotate: bool = True
) -> dict[str, list[T]]:
    """Each variant's `rounds` measurements (what its callable returns), the variants taking
    turns within every round (the order rotated by one each round when `rotate`) so that the
    machine's drift hits all alike."""
    names = list(variants)
    out: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            out[name].append(variants[name]())
    return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; views of one flat buffer
    count once): what a rank holds, as the benchmarks and the memory tests measure it."""
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def write_json(path: str | Path, obj: Any) -> None:
    """`obj` as JSON (indent 1) at `path`, its folder made, written whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def run_cli(
    main: Callable[[list[str]], int], argv: list[str] | None = None, errors: tuple = ()
) -> int:
    """main(argv) with UsageError (and `errors`: the users' other bad input) as one line on
    stderr and exit code 2."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except (UsageError, *errors) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
