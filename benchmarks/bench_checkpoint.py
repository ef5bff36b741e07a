"""Checkpoint save and resume times, bytes read per rank, and a save's step-time overhead.

    python -m benchmarks.bench checkpoint [--layers 4 --d-model 256 --vocab 4096 --repeats 5
                                      --rounds 10 --block 3 --out F.json]

Gloo workers, one thread each (a world of 1 runs in this process, without a process group); every
job is built with train/build.py's `build()` from the same seed, trains 2 steps so that AdamW has
its moments, and is saved with train/checkpoint.py's `save()` (what the training loop's `Saver`
calls when checkpoint.async_save is off).

1. Save and resume. Each mesh (1 process, tp=2, dp=2, dp=2 zero=1) saves its job `--repeats`
   times (the time of the slower rank, its collectives, fsyncs and checksums included; its
   first part, `save_state()`, which gathers what to write, is also timed alone). The
   tp=2 checkpoint (and the 1-process one) is then resumed by fresh jobs under the same and
   other meshes: `resume_path()` (every file's size and CRC-32, the reading split over the
   ranks) and `load()`, each timed `--repeats` times; `meta["bytes_read"]` is what DCP read
   from disk for this rank, against the checkpoint's tensor bytes (its .distcp files). Every
   resumed job then trains the 3rd step; its loss is compared with the saving job's.
2. Step-time overhead at tp=2. One job, one background-save `Saver` (checkpoint.async_save);
   blocks of `--block` steps under five settings: no checkpoint; a synchronous save after every
   step / every `--block` steps; an async save every step / every `--block` steps. The settings
   take turns, the order rotated each round, `--rounds` rounds after one warmup round. An async
   block starts its save, trains, and ends with `Saver.wait()`: what the write did not hide
   behind the block's steps is waited for in the block, as the next save would in a run (with a
   save every step that wait falls on every step). Each block is timed between barriers as the
   slower rank's; per round, ratio = block time / the no-checkpoint block of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.harness import ROOT, add_model_args, alternate, echo_command, spawn, write_json
from megapipe.config import load_config

MESHES = {  # name -> (world size, parallel overrides)
    "1 process": (1, []),
    "tp=2": (2, ["parallel.tp=2"]),
    "dp=2": (2, ["parallel.dp=2"]),
    "dp=2 zero=1": (2, ["parallel.dp=2", "parallel.zero=1"]),
}
SAVED_FIRST = 2  # steps trained before a save
SETTINGS = ("none", "sync every step", "async every step", "sync every k", "async every k")


def make_config(args, mesh: str, run_dir: str, more=()):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}", f"train.global_batch={args.batch}",
        "train.steps=100000", f"run.dir={run_dir}", "log.progress=false",
        "parallel.timeout_s=600", *MESHES[mesh][1], *more,
    ])  # fmt: skip


def _barrier() -> None:
    from megapipe.distributed.launch import barrier

    barrier()


def _timed(fn, *args):
    """(seconds on this rank, result) of fn(*args), the ranks starting together."""
    _barrier()
    began = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - began, out


class Trained:
    """A job under `mesh` (on this rank), its optimizer and the data."""

    def __init__(self, args, mesh: str, run_dir: str, more=(), steps: int = SAVED_FIRST):
        from megapipe.data.loader import build_data
        from megapipe.distributed.launch import init_distributed
        from megapipe.train.build import build

        self.cfg = make_config(args, mesh, run_dir, more)
        torch.manual_seed(self.cfg.train.seed)
        self.job = build(self.cfg, init_distributed(self.cfg))
        self.optimizer = self.job.optimizer()
        self.data = build_data(self.cfg.data, self.cfg.model, self.cfg.train.seed)
        self.step = 0
        for _ in range(steps):
            self.train()

    def train(self) -> float:
        batch = self.data.batch(self.step, self.cfg.train.global_batch)
        loss = self.job.train_step(self.optimizer, batch, self.step).loss
        self.step += 1
        return loss


def _dir_bytes(path: str) -> dict:
    """Bytes of a checkpoint's tensor files (.distcp) and of all its files."""
    names = os.listdir(path)
    size = {n: os.path.getsize(os.path.join(path, n)) for n in names}
    return {
        "tensor": sum(b for n, b in size.items() if n.endswith(".distcp")),
        "all": sum(size.values()),
    }


def save_times(args, mesh: str, root: str) -> dict:
    """Save `mesh`'s job `--repeats` times; the last checkpoint's path, sizes, the next loss."""
    from megapipe.train import checkpoint

    run = Trained(args, mesh, os.path.join(root, mesh.replace(" ", "_").replace("=", "")))
    times, gather, path = [], [], None
    for _ in range(args.repeats):  # the same step each time: save() replaces the older copy
        seconds, path = _timed(checkpoint.save, run.cfg, run.step, run.job.model, run.optimizer)
        times.append(seconds)
        # its first part alone: what to write, gathered (under tp, a ShardedTensor each)
        gather.append(_timed(checkpoint.save_state, run.cfg, run.job.model, run.optimizer)[0])
    _barrier()
    params = sum(p.numel() for p in run.job.model.parameters())
    return {"times": times, "gather": gather, "path": path, "bytes": _dir_bytes(path),
            "params": params, "next_loss": run.train()}  # fmt: skip


def load_times(args, mesh: str, path: str, root: str) -> dict:
    """Resume `path` into a fresh job under `mesh` `--repeats` times: verify and load timed,
    bytes this rank read; then the loss of the next step."""
    from megapipe.train import checkpoint

    run = Trained(args, mesh, root, [f"checkpoint.resume={path}"], steps=0)
    verify, load, read = [], [], []
    for _ in range(args.repeats):
        seconds, found = _timed(checkpoint.resume_path, run.cfg)
        verify.append(seconds)
        seconds, meta = _timed(checkpoint.load, found, run.cfg, run.job.model, run.optimizer)
        load.append(seconds)
        read.append(meta["bytes_read"])
    run.step = meta["step"]
    _barrier()
    return {"verify": verify, "load": load, "bytes_read": read[-1],
            "resharded": meta["resharded"], "next_loss": run.train()}  # fmt: skip


def overhead(args, root: str) -> dict:
    """Part 2 at tp=2: {setting: [block()'s four times, per round after warmup]}, this rank."""
    from megapipe.train import checkpoint
    from megapipe.train.checkpoint_async import Saver

    k = args.block
    run = Trained(args, "tp=2", root, ["checkpoint.async_save=true", "checkpoint.keep=2"])
    saver = Saver(run.cfg)
    assert saver.background
    saved = [0]

    def next_id() -> int:
        saved[0] += 1
        return saved[0]

    def block(setting: str) -> list[float]:
        """[block, in training steps, in checkpoint calls, in Saver.wait()] seconds, this rank."""
        every = 1 if "every step" in setting else k
        background = setting.startswith("async")
        in_steps = 0.0
        _barrier()
        began = time.perf_counter()
        for i in range(k):
            if background and i % every == 0:
                saver.save(next_id(), run.job.model, run.optimizer)
            t = time.perf_counter()
            run.train()
            in_steps += time.perf_counter() - t
            if setting.startswith("sync") and (i + 1) % every == 0:
                checkpoint.save(run.cfg, next_id(), run.job.model, run.optimizer)
        t = time.perf_counter()
        if background:
            saver.wait()
        waited = time.perf_counter() - t
        total = time.perf_counter() - began
        return [total, in_steps, total - in_steps, waited]

    turns = alternate({s: partial(block, s) for s in SETTINGS}, args.rounds + 1)
    times = {s: rounds[1:] for s, rounds in turns.items()}  # round 0 warms up
    return {"times": times, "saves": saved[0]}


def world_job(args, root: str, one_process: dict) -> dict:
    """Everything a world of 2 measures, on this rank."""
    out = {"save": {}, "load": {}}
    for mesh in ("tp=2", "dp=2", "dp=2 zero=1"):
        out["save"][mesh] = save_times(args, mesh, root)
    sources = {"tp=2": out["save"]["tp=2"]["path"], "1 process": one_process["path"]}
    for source, path in sources.items():
        for mesh in ("tp=2", "dp=2", "dp=2 zero=1"):
            if source == "1 process" and mesh != "tp=2":
                continue
            out["load"][f"{source} -> {mesh}"] = load_times(args, mesh, path, root)
    out["overhead"] = overhead(args, os.path.join(root, "overhead"))
    return out


def run_world(args, root: str, one: dict, world: int = 2) -> list[dict]:
    """world_job on each of `world` gloo ranks; the per-rank results as JSON reads them back."""
    return json.loads(json.dumps(spawn(world, world_job, args, root, one, timeout_s=600)))


# ---- tables ---------------------------------------------------------------------------------


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per repeat, the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank)]


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.0f} ms"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def save_table(saves: dict) -> str:
    lines = [
        "| saved under | ranks | save (median) | min–max | save_state() alone (median) | "
        "tensor bytes (.distcp) | all files |",
        "|---|---|---|---|---|---|---|",
    ]
    for mesh, ranks in saves.items():
        t = _slowest([r["times"] for r in ranks])
        gather = _slowest([r["gather"] for r in ranks])
        b = ranks[0]["bytes"]
        lines.append(
            f"| {mesh} | {len(ranks)} | {_ms(t)} | {min(t) * 1e3:.0f}–{max(t) * 1e3:.0f} ms | "
            f"{_ms(gather)} | {b['tensor']:,} B ({_mb(b['tensor'])}) | {_mb(b['all'])} |"
        )
    return "\n".join(lines)


def load_table(loads: dict, saves: dict) -> tuple[str, float]:
    lines = [
        "| saved under → resumed under | resharded | verify (median) | load (median) | "
        "load min–max | bytes read per rank (load) | of the tensor bytes | next-step loss Δ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for name, ranks in loads.items():
        source, mesh = name.split(" -> ")
        total = saves[source][0]["bytes"]["tensor"]
        ref = saves[source][0]["next_loss"]
        verify = _slowest([r["verify"] for r in ranks])
        load = _slowest([r["load"] for r in ranks])
        read = [r["bytes_read"] for r in ranks]
        gap = max(abs(r["next_loss"] - ref) / abs(ref) for r in ranks)
        worst = max(worst, gap)
        reads = " / ".join(_mb(b) for b in read)
        shares = " / ".join(f"{b / total:.2f}" for b in read)
        lines.append(
            f"| {source} → {mesh} | {'yes' if ranks[0]['resharded'] else 'no'} | "
            f"{_ms(verify)} | {_ms(load)} | {min(load) * 1e3:.0f}–{max(load) * 1e3:.0f} ms | "
            f"{reads} | {shares} | {gap:.1e} |"
        )
    return "\n".join(lines), worst


def overhead_table(ranks: list[dict], k: int) -> tuple[str, dict]:
    # per round and setting, the slower rank's block, split as that rank's was
    blocks = {
        s: [max(parts) for parts in zip(*(r["overhead"]["times"][s] for r in ranks))]
        for s in SETTINGS
    }
    base = [b[0] for b in blocks["none"]]
    lines = [
        "| setting | step time (median) | ratio to no checkpoint (median of rounds) | IQR | "
        "min–max | of which training, per step | in checkpoint calls, per step | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out = {}
    for s in SETTINGS:
        total, steps, ckpt, waited = ([b[j] / k for b in blocks[s]] for j in range(4))
        ratios = [b[0] / a for a, b in zip(base, blocks[s])]
        q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        label = s.replace("every k", f"every {k} steps")
        out[label] = {"step_ms": [t * 1e3 for t in total], "train_ms": [t * 1e3 for t in steps],
                      "checkpoint_ms": [t * 1e3 for t in ckpt],
                      "wait_ms": [t * 1e3 for t in waited], "ratios": ratios}  # fmt: skip
        cells = ["—"] * 3 if s == "none" else [
            f"{med:.2f}", f"{q1:.2f}–{q3:.2f}", f"{min(ratios):.2f}–{max(ratios):.2f}"
        ]  # fmt: skip
        lines.append(
            f"| {label} | {_ms(total)} | " + " | ".join(cells)
            + f" | {_ms(steps)} | {_ms(ckpt)} | {len(ratios)} |"
        )  # fmt: skip
    return "\n".join(lines), out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, vocab=4096)
    p.add_argument("--repeats", type=int, default=5, help="saves and resumes per mesh")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds of part 2 (+1 warmup)")
    p.add_argument("--block", type=int, default=3, help="steps per block; k of 'every k steps'")
    p.add_argument("--dir", help="where checkpoints go (default: a temporary dir, removed)")
    p.add_argument("--out", help="also write the figures here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    echo_command("checkpoint", argv)
    began, load0 = time.perf_counter(), os.getloadavg()
    one, ranks, single, root = measure(args)
    saves = {"1 process": [one], **{m: [r["save"][m] for r in ranks] for m in ranks[0]["save"]}}
    loads = {k: [r["load"][k] for r in ranks] for k in ranks[0]["load"]}
    loads["tp=2 -> 1 process"] = [single]
    n = one["params"]
    print_setup(args, n, root)
    worst = print_save_and_resume(args, saves, loads)
    result_overhead = print_overhead(args, ranks)
    load1 = os.getloadavg()
    print(
        f"\nLoad average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
        f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}. "
        f"({time.perf_counter() - began:.0f} s)"
    )
    if args.out:
        write_json(args.out, {
            "args": vars(args), "params": n, "saves": saves, "loads": loads,
            "overhead": result_overhead, "max_loss_gap": worst,
            "loadavg": [load0, load1],
        })  # fmt: skip
    if worst > 1e-4:
        print(f"FAILED: a resumed job's next loss is {worst:.1e} off the saving job's",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def measure(args) -> tuple[dict, list[dict], dict, str]:
    """Every figure: the 1-process save, each rank's of the world of 2 (parts 1 and 2), the
    tp=2 checkpoint resumed by one process; and where the checkpoints went (removed unless
    --dir)."""
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    try:
        torch.set_num_threads(1)
        one = save_times(args, "1 process", root)
        ranks = run_world(args, root, {"path": one["path"]})
        single = load_times(args, "1 process", ranks[0]["save"]["tp=2"]["path"], root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return one, ranks, single, root


def print_setup(args, n_params: int, root: str) -> None:
    print(
        f"Model: {args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq_len}, "
        f"vocab {args.vocab}: {n_params:,} parameters (float32; AdamW's two moments make the "
        f"checkpoint ~12 B/param); global batch {args.batch} × {args.seq_len} tokens; gloo, 1 "
        f"thread per process, {os.cpu_count()} cores; checkpoints under {Path(root).parent}.\n"
    )


def print_save_and_resume(args, saves: dict, loads: dict) -> float:
    """Parts 1a and 1b; the worst relative gap of a resumed job's next loss."""
    print(
        f"1a. Save, {args.repeats} repeats per mesh (the slower rank; fsync and CRC-32 "
        "included); save_state() alone = its first part, gathering what to write (timed "
        "separately after each save):\n"
    )
    print(save_table(saves))
    table, worst = load_table(loads, saves)
    print(
        f"\n1b. Resume into a fresh job, {args.repeats} repeats: verify = resume_path() (sizes "
        "and CRC-32 of every file, split over the ranks), load = load(); bytes read per rank = "
        "meta['bytes_read'] (rank 0 / rank 1), against the saved tensor bytes; loss Δ = "
        "relative difference of the next step's loss from the saving job's:\n"
    )
    print(table)
    return worst


def print_overhead(args, ranks: list[dict]) -> dict:
    """Part 2 and the async settings' split of their checkpoint time; its figures."""
    table, result_overhead = overhead_table(ranks, args.block)
    print(
        f"\n2. Step time at tp=2 with checkpoints, blocks of {args.block} steps, "
        f"{args.rounds} rounds after 1 warmup round, settings rotated each round; an async "
        f"block ends with Saver.wait() (the write not hidden behind its steps); training = "
        f"time inside train_step, checkpoint calls = the rest (save(), or Saver.save() and "
        f"Saver.wait()):\n"
    )
    print(table)
    print(f"\nAsync, medians: {async_waits(result_overhead)}.")
    return result_overhead


def async_waits(result_overhead: dict) -> str:
    """Per async setting, the median time in Saver.save() and in the block's final wait."""
    waits = []
    for label, r in result_overhead.items():
        if label.startswith("async"):
            started = [c - w for c, w in zip(r["checkpoint_ms"], r["wait_ms"])]
            waits.append(
                f"{label}: {statistics.median(started):.0f} ms per step in Saver.save() (which "
                f"first waits for the save before it), {statistics.median(r['wait_ms']):.0f} ms "
                "in the block's final Saver.wait()"
            )
    return "; ".join(waits)


if __name__ == "__main__":
    sys.exit(main())
