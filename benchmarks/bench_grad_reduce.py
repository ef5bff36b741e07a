"""What reducing the grads every microbatch costs against once a step (parallel.grad_reduce).

    python -m benchmarks.bench grad_reduce [--dp 2 --microbatches 4 --steps 20 --warmup 2
                                            --layers 4 --d-model 256 --out F.json]

A gloo world of --dp ranks, one thread each. At zero=2 (zero=3 always reduces every
microbatch: no full-size grads under ZeRO-3) two jobs are built from the same seed with
train/parallelize.py's `parallelize()`, as train.py does: `step` (Megatron's distributed
optimizer: one reduce-scatter per bucket in the last microbatch's backward, full-size
local grads accumulated until then) and `microbatch` (FSDP, DeepSpeed: every microbatch's
backward reduce-scatters each bucket as it completes and frees its local grads;
docs/parallelism.md, "When the grads are reduced"). Every round the jobs step in turn, the order
rotated, on the same batches; a step is timed between barriers as its slower rank's time.

Reported: the median over rounds of microbatch's step time over step's, with its
quartiles; the bytes each mode reduce-scatters per step (megapipe.distributed.collectives'
COUNTER: step-wise one pass over the grads, per microbatch `--microbatches` passes); the most
grad bytes a rank holds at any grad arrival (.grad storages, main grads, send buffers and
shard sums); and the largest loss gap between the two, which train the same model (fp32
reduction order only).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from benchmarks.harness import (
    ROOT,
    Parser,
    add_model_args,
    echo_command,
    run_cli,
    say,
    spawn,
    storage_bytes,
    write_json,
)
from megapipe.config import load_config

MODES = ("step", "microbatch")
ZERO = 2  # the level with both modes (zero=3 always reduces every microbatch)


def make_config(args, zero: int, mode: str):
    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"model.n_layers={args.layers}", f"model.d_model={args.d_model}",
        f"model.n_heads={args.heads}", f"model.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}", f"train.global_batch={args.batch}",
        f"train.steps={args.warmup + args.steps}", f"parallel.dp={args.dp}",
        f"parallel.zero={zero}", f"parallel.grad_reduce={mode}",
        f"parallel.microbatches={args.microbatches}", "model.dropout=0.0",
        f"run.dir={tempfile.mkdtemp()}", "log.progress=false",
    ])  # fmt: skip


class Run:
    """One job on this rank, with a probe of the grad bytes held at every grad arrival."""

    def __init__(self, args, mesh, zero: int, mode: str) -> None:
        from megapipe.train.parallelize import parallelize

        self.cfg = make_config(args, zero, mode)
        torch.manual_seed(self.cfg.train.seed)
        self.job = parallelize(self.cfg, mesh, "cpu", args.bucket_mb)
        self.optimizer = self.job.optimizer()
        self.reducer = self.job.engine.reducer
        self.params = [p for p in self.job.model.parameters() if p.requires_grad]
        self.most = 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._probe)
            if hasattr(p, "main_grad_hooks"):
                p.main_grad_hooks.append(self._probe)

    def _held(self) -> int:
        """Grad bytes on this rank now: local grads, main grads, send buffers, shard sums."""
        r, model = self.reducer, self.job.model
        tensors = [p.grad for p in self.params]
        whole = getattr(model, "main_grads", None)
        tensors += [whole.flat] if whole is not None else []
        tensors += [
            b.flat for b in getattr(r, "buckets", []) if getattr(b, "flat", None) is not None
        ]
        tensors += list(getattr(r, "sums", {}).values())
        held = getattr(r, "bucket_grads", None)
        return storage_bytes(tensors) + (held.resident_bytes() if held is not None else 0)

    def _probe(self, *_) -> None:
        self.most = max(self.most, self._held())

    def step(self, batch: torch.Tensor, i: int) -> float:
        return self.job.train_step(self.optimizer, batch, i).loss


def measure(args) -> dict:
    """On each rank: every (level, mode)'s step times, losses and reduce-scatter bytes."""
    import torch.distributed as dist

    from megapipe.data.loader import build_data
    from megapipe.distributed import collectives
    from megapipe.distributed.mesh import MeshSizes, ParallelMesh

    mesh = ParallelMesh(MeshSizes(dp=args.dp))
    runs = {f"{ZERO}-{m}": Run(args, mesh, ZERO, m) for m in MODES}
    cfg = runs[f"{ZERO}-step"].cfg
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    names, times, losses, sent = list(runs), defaultdict(list), defaultdict(list), {}
    for i in range(args.warmup + args.steps):
        batch = data.batch(i, args.batch)
        k = i % len(names)
        for name in names[k:] + names[:k]:
            collectives.COUNTER = [] if i == 0 else None
            dist.barrier()
            began = time.perf_counter()
            losses[name].append(runs[name].step(batch, i))
            times[name].append(time.perf_counter() - began)
            if i == 0:
                sent[name] = sum(n for op, n in collectives.COUNTER if op == "reduce_scatter")
        collectives.COUNTER = None
    return {
        "times": {n: t[args.warmup :] for n, t in times.items()},
        "losses": dict(losses),
        "reduce_scatter_bytes": sent,
        "grads_held": {n: r.most for n, r in runs.items()},
    }


def table(ranks: list[dict], zeros: list[int]) -> tuple[str, dict]:
    lines = [
        "| zero | step-wise step (median) | per-microbatch step | ratio (median of rounds, "
        "quartiles) | reduce-scatter bytes step / microbatch | most grad bytes held step / "
        "microbatch | loss gap |",
        "|---|---|---|---|---|---|---|",
    ]
    out = {}
    for z in zeros:
        a, b = (f"{z}-{m}" for m in MODES)
        slow = {n: [max(ts) for ts in zip(*(r["times"][n] for r in ranks))] for n in (a, b)}
        ratios = [y / x for x, y in zip(slow[a], slow[b])]
        q1, q3 = statistics.quantiles(ratios, n=4, method="inclusive")[::2]
        gap = max(abs(x - y) for r in ranks for x, y in zip(r["losses"][a], r["losses"][b]))
        held = [max(r["grads_held"][n] for r in ranks) for n in (a, b)]
        sent = [ranks[0]["reduce_scatter_bytes"][n] for n in (a, b)]
        out[z] = {
            "step_ms": [statistics.median(slow[n]) * 1e3 for n in (a, b)],
            "median_ratio": statistics.median(ratios),
            "quartiles": [q1, q3],
            "reduce_scatter_bytes": sent,
            "grads_held_bytes": held,
            "max_loss_gap": gap,
        }
        o = out[z]
        lines.append(
            f"| {z} | {o['step_ms'][0]:.1f} ms | {o['step_ms'][1]:.1f} ms | "
            f"{o['median_ratio']:.3f} ({q1:.3f}–{q3:.3f}) | {sent[0]:,} / {sent[1]:,} | "
            f"{held[0]:,} / {held[1]:,} | {gap:.2e} |"
        )
    return "\n".join(lines), out


def main(argv: list[str] | None = None) -> int:
    def run(argv: list[str]) -> int:
        p = Parser(prog="python -m benchmarks.bench grad_reduce")
        add_model_args(p, vocab=512)
        p.add_argument("--dp", type=int, default=2)
        p.add_argument("--microbatches", type=int, default=4)
        p.add_argument("--steps", type=int, default=20)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--bucket-mb", type=float, default=1.0)
        p.add_argument("--out", default=None)
        args = p.parse_args(argv)
        echo_command("grad_reduce", argv)
        say(f"dp={args.dp}: 2 jobs, {args.warmup + args.steps} rounds")
        ranks = json.loads(json.dumps(spawn(args.dp, measure, args)))
        text, out = table(ranks, [ZERO])
        print(text)
        if args.out:
            write_json(args.out, {"args": vars(args), "ranks": ranks, "summary": out})
        return 0

    return run_cli(run, argv)
