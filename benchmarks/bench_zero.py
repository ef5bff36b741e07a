"""ZeRO levels (parallel.zero=1, 2, 3) against plain data parallelism (zero=0).

    python -m benchmarks.bench zero [--layers 4 --d-model 256 --seq-len 128 --steps 60
                                     --zero 0 1 2 3 --dp 1 2 4 --out F.json]

Gloo workers, one thread each; every world builds one job per level from the same seed with
train/parallelize.py's `parallelize()`, as train.py does, and trains them on the same batches.

1. Step time at dp=2: the jobs step in turn (zero=0, 1, 2, 3, and each sharded level without
   its overlap: zero=1/2's gathers waited for right after the step, zero=3 unprefetched), each
   step timed between barriers as the slower rank's time; the median of the per-round ratios to
   zero=0 (IQR). Hidden = (step without overlap − step with it, median of rounds) / the same
   gathers run alone; and the wait for gathers inside back-to-back steps.
2. Bytes per rank for dp in {1, 2, 4}: weights (resident parameter storage; zero=3's master
   shards), gradients (the storage the grads live in at the optimizer step, bucket padding
   included) and the AdamW state tensors (the scalar step left out), against ZeRO's float32
   counts: zero=0 16, zero=1 4 + 4 + 8/d, zero=2 4 + (4 + 8)/d, zero=3 (4 + 4 + 8)/d plus the
   gathered block (the most parameter storage resident at any module's forward end). The
   largest rank is reported.
3. Bytes communicated per step at dp=2 and dp=4, counted by megapipe.distributed.collectives'
   COUNTER (all-reduce and reduce-scatter by their full input, all-gather by its full output),
   with the ring per-rank wire volume (all-reduce of N bytes 2(R-1)/R N; reduce-scatter or
   all-gather of an N-byte full buffer (R-1)/R N). Checked: zero=1's reduce-scatter +
   all-gather moves what one all-reduce does, plus only the padding of each bucket to a
   multiple of R elements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

from benchmarks.harness import (
    ROOT,
    add_model_args,
    echo_command,
    spawn,
    storage_bytes,
    write_json,
)
from megapipe.config import load_config
from megapipe.config.states import DEFAULT_BUCKET_MB
from megapipe.train.hooks import TrainHooks

FP32 = 4


def make_config(args, dp: int, zero: int):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}", f"train.global_batch={args.batch}",
        f"train.steps={args.warmup + args.steps}", f"parallel.dp={dp}", f"parallel.zero={zero}",
        f"run.dir={tempfile.mkdtemp()}", "log.progress=false",
    ])  # fmt: skip


def _state_bytes(optimizer) -> int:
    """AdamW's state tensors on this rank (both moments; the scalar step left out)."""
    return sum(
        t.numel() * t.element_size()
        for st in optimizer.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


def _resident(params) -> list:
    """The parameters whose storage is allocated (zero=3 frees a block's between uses)."""
    return [p for p in params if p.untyped_storage().nbytes()]


class _GradBytes(TrainHooks):
    """The most grad storage (full-size .grad, or zero >= 2's reduce-scattered shards) and
    weight storage (resident parameters, zero=3's master shards) seen right before an
    optimizer step (the step core's hook)."""

    def __init__(self, model, reducer) -> None:
        self.model, self.reducer, self.most, self.weights = model, reducer, 0, 0

    def optimizer_begin(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grads += self.reducer.shards() if hasattr(self.reducer, "shards") else []
        self.most = max(self.most, storage_bytes(grads))
        masters = getattr(self.reducer, "master", [])
        resident = storage_bytes(_resident(self.model.parameters()) + masters)
        self.weights = max(self.weights, resident)


class _GathersAtStep(_GradBytes):
    """The variant without overlap: zero=1/2's weight all-gathers waited for right after the
    optimizer step (zero=1 as it was before its gathers overlapped the next forward)."""

    def optimizer_end(self) -> None:
        if hasattr(self.reducer, "wait_params"):
            self.reducer.wait_params()


class _GatheredPeak:
    """The most parameter storage resident at any module's forward end (zero=3: the gathered
    block(s) on top of the shards)."""

    def __init__(self, model) -> None:
        self.model, self.most = model, 0
        for module in model.modules():
            module.register_forward_hook(self._seen)

    def _seen(self, *_) -> None:
        self.most = max(self.most, storage_bytes(_resident(self.model.parameters())))


class Run:
    """One job (zero=0 or zero=1) on this rank; a step hook sees the grads as they are when the
    optimizer steps."""

    def __init__(self, args, mesh, dp: int, zero: int, overlap: bool = True) -> None:
        from megapipe.train.parallelize import parallelize

        self.cfg = make_config(args, dp, zero)
        torch.manual_seed(self.cfg.train.seed)
        self.job = parallelize(self.cfg, mesh, "cpu", args.bucket_mb)
        self.optimizer = self.job.optimizer()
        self.reducer = getattr(self.job.engine, "reducer", None)
        self.grads = (_GradBytes if overlap else _GathersAtStep)(self.job.model, self.reducer)
        self.gathered = _GatheredPeak(self.job.model)
        if not overlap and hasattr(self.reducer, "prefetch"):
            self.reducer.prefetch = False  # zero=3: each block's gather waited for at once

    def step(self, batch: torch.Tensor, i: int) -> float:
        return self.job.train_step(self.optimizer, batch, i, self.grads).loss

    def memory(self) -> dict:
        params = list(self.job.model.parameters())
        reducer = self.reducer
        size = getattr(reducer, "size", 1)
        buckets = [b.numel for b in reducer.buckets] if reducer is not None else []
        return {
            "params": sum(p.numel() for p in params),
            "weights": self.grads.weights,
            "gathered_peak": self.gathered.most,
            "grads": self.grads.most,
            "state": _state_bytes(self.optimizer),
            "buckets": len(buckets),
            # zero=1 pads each bucket to a multiple of R elements before the reduce-scatter
            "pad_bytes": sum(FP32 * (-(-n // size) * size - n) for n in buckets) if size else 0,
        }


def measure(args, world: int) -> dict:
    """Per rank: every level's memory and counted collectives, and (at --time-dp) the
    alternated timing with each level's exposed weight-gather wait."""
    import torch.distributed as dist

    from megapipe.data.loader import build_data
    from megapipe.distributed import collectives

    mesh = None
    if world > 1:
        from megapipe.distributed.mesh import MeshSizes, ParallelMesh

        mesh = ParallelMesh(MeshSizes(dp=world))
    timed = world == args.time_dp
    runs = {str(zero): Run(args, mesh, world, zero) for zero in args.zero}
    if timed and world > 1:  # each sharded level also without its overlap ("1s", ...)
        runs.update({f"{z}s": Run(args, mesh, world, z, False) for z in args.zero if z})
    data = build_data(runs["0"].cfg.data, runs["0"].cfg.model, runs["0"].cfg.train.seed)
    total = args.warmup + args.steps if timed else 1
    times, losses, comm = defaultdict(list), defaultdict(list), {}
    for i in range(total):
        batch = data.batch(i, args.batch)
        for zero, run in runs.items():
            if i == 0:
                collectives.COUNTER = []
            if world > 1:
                dist.barrier()
            began = time.perf_counter()
            losses[zero].append(run.step(batch, i))
            times[zero].append(time.perf_counter() - began)
            if i == 0:
                counts = defaultdict(lambda: [0, 0])
                for op, nbytes in collectives.COUNTER:
                    counts[op][0] += 1
                    counts[op][1] += nbytes
                comm[zero] = dict(counts)
                collectives.COUNTER = None
    overlapped = [(z, r) for z, r in runs.items() if not z.endswith("s")]
    return {
        "times": {z: t[args.warmup :] for z, t in times.items()} if timed else None,
        "waited": {z: _exposed(r, data, args, total) for z, r in overlapped} if timed else None,
        "gather": {z: _sync_gather(r, args.steps) for z, r in overlapped} if timed else None,
        "losses": dict(losses),
        "memory": {z: r.memory() for z, r in overlapped},
        "comm": comm,
    }


def _exposed(run: Run, data, args, first: int) -> list[float]:
    """Per step, the seconds spent waiting for weight gathers over `args.steps` steps run back
    to back as train/loop.py runs them (no barrier between steps to hide gathers behind)."""
    out = []
    for i in range(first, first + args.steps) if hasattr(run.reducer, "waited_s") else ():
        before = run.reducer.waited_s
        run.step(data.batch(i, args.batch), i)
        out.append(run.reducer.waited_s - before)
    return out


def _sync_gather(run: Run, repeats: int) -> list[float]:
    """Seconds of one step's weight all-gathers done alone, each waited for at once: zero=1/2
    every bucket; zero=3 each block's gather before its forward, then before its backward."""
    import torch.distributed as dist

    reducer, out = run.reducer, []
    if not hasattr(reducer, "waited_s"):
        return []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        if hasattr(reducer, "master"):  # zero=3: the same collectives as a step's, unprefetched
            for needs in [*reducer.fwd, *reducer.bwd[::-1]]:
                reducer._acquire(needs)
                reducer._release(needs)
        else:
            reducer.gather_params()
            reducer.wait_params()
        out.append(time.perf_counter() - began)
    return out


def run_world(args, world: int) -> list[dict]:
    """measure() on each of `world` ranks; the per-rank results (JSON keys become strings)."""
    if world == 1:
        torch.set_num_threads(1)
        return [json.loads(json.dumps(measure(args, 1)))]
    return json.loads(json.dumps(spawn(world, measure, args, world)))


# ---- tables ---------------------------------------------------------------------------------


def timing_table(ranks: list[dict], zeros: list[str]) -> tuple[str, dict]:
    """Step time of each level against zero=0 (median of per-round ratios); the weight
    all-gathers hidden: the step without overlap ("zs") minus the step with it (median of the
    per-round differences) over the same gathers run alone; and the wait for gathers inside
    back-to-back steps (which also holds the other ranks' lateness)."""
    # a step's time is its slowest rank's (the ranks start together after a barrier)
    steps = {z: [max(ts) for ts in zip(*(r["times"][z] for r in ranks))] for z in ranks[0]["times"]}
    out = {"losses": {z: ranks[0]["losses"][z] for z in zeros}}
    lines = [
        "| zero | step (median) | ratio to zero=0 (IQR) | step without overlap | saved by "
        "overlap (median of rounds, IQR) | gathers alone | hidden = saved / alone | gather wait in "
        "back-to-back steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for z in zeros:
        ratios = [b / a for a, b in zip(steps["0"], steps[z])]
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        waits = [max(w) for w in zip(*(r["waited"][z] for r in ranks))]
        gathers = [max(g) for g in zip(*(r["gather"][z] for r in ranks))]
        alone = statistics.median(gathers) if gathers else 0.0
        sync = steps.get(f"{z}s")
        diffs = [a - b for a, b in zip(sync, steps[z])] if sync else [0.0, 0.0]
        saved = statistics.median(diffs)
        s1, _, s3 = statistics.quantiles(diffs, n=4, method="inclusive")
        gap = max(abs(a - b) for r in ranks for a, b in zip(r["losses"]["0"], r["losses"][z]))
        out[z] = {
            "step_ms": statistics.median(steps[z]) * 1e3,
            "median_ratio": statistics.median(ratios),
            "iqr": [q1, q3],
            "step_without_overlap_ms": statistics.median(sync) * 1e3 if sync else None,
            "saved_ms": saved * 1e3,
            "saved_iqr_ms": [s1 * 1e3, s3 * 1e3],
            "gather_alone_ms": alone * 1e3,
            "hidden": saved / alone if alone else None,
            "exposed_wait_ms": statistics.median(waits) * 1e3 if waits else 0.0,
            "max_loss_gap": gap,
        }
        o = out[z]
        lines.append(
            f"| {z} | {o['step_ms']:.1f} ms | {o['median_ratio']:.3f} ({q1:.3f}–{q3:.3f}) | "
            + (f"{o['step_without_overlap_ms']:.1f} ms | " if sync else "— | ")
            + f"{saved * 1e3:.1f} ms ({s1 * 1e3:.1f}–{s3 * 1e3:.1f}) | {alone * 1e3:.1f} ms | "
            + ("— | " if o["hidden"] is None else f"{o['hidden']:.0%} | ")
            + f"{o['exposed_wait_ms']:.1f} ms |"
        )
    return "\n".join(lines), out


FORMULAS = {  # float32 weights, grads, AdamW moments, d replicas: bytes per parameter
    "0": (lambda d: 16, "4 + 4 + 8"),
    "1": (lambda d: 4 + 4 + 8 / d, "4 + 4 + 8/d"),
    "2": (lambda d: 4 + (4 + 8) / d, "4 + (4 + 8)/d"),
    "3": (lambda d: (4 + 4 + 8) / d, "(4 + 4 + 8)/d"),
}


def memory_table(worlds: dict[int, list[dict]], zeros: list[str]) -> tuple[str, list[dict]]:
    lines = [
        "| dp | zero | weights B/param | grads B/param | AdamW state B/param | total B/param | "
        "formula | Δ | gathered peak B/param |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for dp, ranks in worlds.items():
        for zero in zeros:
            mem = [r["memory"][zero] for r in ranks]
            n = mem[0]["params"]
            big = max(mem, key=lambda m: m["weights"] + m["grads"] + m["state"])
            w, g, s = (big[k] / n for k in ("weights", "grads", "state"))
            formula, name = FORMULAS[zero]
            f_total = formula(dp)  # at dp=1 nothing shards: every formula gives 16
            peak = max(m["gathered_peak"] for m in mem) / n
            rows.append({
                "dp": dp, "zero": int(zero), "params": n, "weights_bytes": big["weights"],
                "grad_bytes": big["grads"], "state_bytes": big["state"],
                "state_bytes_per_rank": [m["state"] for m in mem], "buckets": big["buckets"],
                "state_per_param": s, "total_per_param": w + g + s, "formula_total": f_total,
                "gathered_peak_per_param": peak,
            })  # fmt: skip
            lines.append(
                f"| {dp} | {zero} | {w:.4f} | {g:.4f} | {s:.4f} | {w + g + s:.4f} | "
                f"{name} = {f_total:g} | {((w + g + s) / f_total - 1) * 100:+.3f}% | {peak:.4f} |"
            )
    return "\n".join(lines), rows


def _wire(op: str, nbytes: int, r: int) -> float:
    """Per-rank bytes sent by a ring collective over `r` ranks whose full buffer is `nbytes`."""
    return (2 if op == "all_reduce" else 1) * (r - 1) / r * nbytes


def comm_table(worlds: dict[int, list[dict]]) -> tuple[str, list[dict], list[str]]:
    lines = [
        "| dp | zero | collective | calls | payload B/step | ring wire B/rank/step |",
        "|---|---|---|---|---|---|",
    ]
    checks, rows, failures = [], [], []
    for dp, ranks in worlds.items():
        if dp == 1:
            continue
        wire = {}
        for zero in sorted(z for z in ranks[0]["comm"] if not z.endswith("s")):
            comm = ranks[0]["comm"][zero]
            if any(r["comm"][zero] != comm for r in ranks):
                failures.append(f"dp={dp} zero={zero}: ranks counted different collectives")
            wire[zero] = 0.0
            for op, (calls, nbytes) in sorted(comm.items()):
                w = _wire(op, nbytes, dp)
                wire[zero] += w
                lines.append(f"| {dp} | {zero} | {op} | {calls} | {nbytes:,} | {w:,.0f} |")
                rows.append({"dp": dp, "zero": int(zero), "op": op, "calls": calls,
                             "payload_bytes": nbytes, "wire_bytes": w})  # fmt: skip
        mem = ranks[0]["memory"]["1"]
        pad, buckets = mem["pad_bytes"], mem["buckets"]
        diff = wire["1"] - wire["0"]
        expected = 2 * (dp - 1) / dp * pad  # the padding goes through both collectives
        bound = 2 * (dp - 1) / dp * FP32 * (dp - 1) * buckets  # < R elements padded per bucket
        ok = abs(diff - expected) < 1e-6 and 0 <= diff <= bound
        if not ok:
            failures.append(f"dp={dp}: RS+AG - AR wire = {diff:,.0f} B, outside [0, {bound:,.0f}]")
        checks.append(
            f"- dp={dp}: zero=1 wire − zero=0 wire = {diff:,.0f} B per rank "
            f"(= 2·{dp - 1}/{dp} × {pad} B of bucket padding); bound 0 ≤ Δ ≤ "
            f"2(R−1)/R · 4 B · (R−1) · {buckets} bucket(s) = {bound:,.0f} B: "
            f"{'ok' if ok else 'VIOLATED'}"
        )
    return "\n".join(lines + [""] + checks), rows, failures


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, vocab=256)
    p.add_argument("--steps", type=int, default=60, help="timed pairs of steps at --time-dp")
    p.add_argument("--warmup", type=int, default=5, help="untimed pairs of steps first")
    p.add_argument("--time-dp", type=int, default=2, help="the world the timing runs at")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="worlds to measure")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], help="levels (0 first)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                   help="gradient bucket size (train.py's default)")  # fmt: skip
    p.add_argument("--out", help="also write the figures here as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    echo_command("zero", argv)
    began = time.perf_counter()
    worlds = {dp: run_world(args, dp) for dp in sorted(set(args.dp) | {args.time_dp})}
    n = worlds[min(worlds)][0]["memory"]["0"]["params"]
    print(
        f"Model: {args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq_len}, "
        f"vocab {args.vocab}: {n:,} parameters; global batch {args.batch} × {args.seq_len} "
        f"tokens; float32; buckets of {args.bucket_mb:g} MB; gloo, 1 thread per process, "
        f"{os.cpu_count()} cores.\n"
    )
    result = {"args": vars(args), "params": n}
    zeros = [str(z) for z in args.zero]
    if args.time_dp in worlds and args.time_dp > 1:
        table, result["timing"] = timing_table(worlds[args.time_dp], zeros)
        losses = result["timing"]["losses"]["0"]
        print(
            f"1. Step time at dp={args.time_dp}, zero={'/'.join(zeros)} built once and stepped "
            f"in turn, {args.steps} rounds after {args.warmup} warmup rounds (a step = the "
            f"slower rank between barriers), each sharded level also without its overlap (its "
            f"gathers waited for right after the step; zero=3 without prefetch):\n"
        )
        print(table)
        gap = max(result["timing"][z]["max_loss_gap"] for z in zeros)
        print(
            f"\nLargest |loss(zero=z) − loss(zero=0)| over the {args.warmup + args.steps} "
            f"steps: {gap:.2e} (zero=0 loss {losses[0]:.3f} → {losses[-1]:.3f})\n"
        )
    table, result["memory"] = memory_table(worlds, zeros)
    print("2. Bytes per parameter on the largest rank, measured at the optimizer step:\n")
    print(table)
    print(
        "\nWeights: resident parameter storage (zero=3: its master shards; the blocks are "
        "freed between uses) at the optimizer step; gathered peak: the most parameter storage "
        "resident at any module's forward end. Grads: the storage they live in when the "
        "optimizer steps (zero=1: the padded flat bucket, full size, zeros outside this rank's "
        "shard; zero>=2: the reduce-scattered shards). Δ = measured / formula − 1.\n"
    )
    table, result["comm"], failures = comm_table(worlds)
    print(
        "3. Collectives counted per training step (COUNTER; all-reduce and reduce-scatter by "
        "full input, all-gather by full output), and the ring model's bytes each rank sends:\n"
    )
    print(table)
    print(f"\n({time.perf_counter() - began:.0f} s)")
    if args.out:
        write_json(args.out, result)
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
