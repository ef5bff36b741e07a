"""Start-up work of one rank as the world grows: the last rank of a 64, 1,024 and 16,384-rank
world, built under torch's fake process-group backend on fake tensors (train/fake_ranks.py's
machinery), phase by phase.

python -m benchmarks.bench fake_startup [--worlds 64,1024,16384] [--json F]

The model and its split are fixed (tiny.yaml at 4 layers, pp 4 · tp 4, two microbatches of one
row per replica), so only dp grows with the world and the model's own work per rank is the
same at every size: what grows is start-up. Phases: `init` (init_process_group "fake"),
`mesh` (distributed/mesh.ParallelMesh: torch's DeviceMesh and new_group calls, and megapipe's
own rank arithmetic around them), `parallelize` (the model, its stages and buckets), `engine`
(the optimizer), `step` (the first training step). The mesh phase runs under cProfile, which
splits it: `torch groups` is the time inside the torch.distributed functions megapipe's code
calls (init_device_mesh, DeviceMesh's slicing and _flatten, new_group); `megapipe` is the rest of
ParallelMesh, megapipe's own Python. The profiler slows
what it profiles alike on both sides of the split. `groups` counts torch's new_group calls
(DeviceMesh's and megapipe's). Times are this process's CPU seconds (time.process_time), so a
busy shared machine's waits for a core are left out.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from benchmarks.harness import Parser, UsageError, run_cli, write_json
from megapipe._torch_compat import fake_tensor_mode
from megapipe.config import ConfigError, load_config
from megapipe.distributed.fake_world import fake_world
from megapipe.distributed.mesh import MeshSizes, ParallelMesh
from megapipe.train.fake_ranks import Measure
from megapipe.train.parallelize import parallelize

PP, TP = 4, 4
MEGAPIPE_MESH = "megapipe/distributed/mesh.py"
OURS = "/megapipe/"  # a file of this package: what it calls in torch.distributed is torch's


def config(world: int, run_dir: str):
    dp = world // (PP * TP)
    return load_config("configs/tiny.yaml", [
        f"--run.dir={run_dir}", "--model.n_layers=4", f"--parallel.pp={PP}",
        f"--parallel.tp={TP}", f"--parallel.dp={dp}", "--parallel.microbatches=2",
        f"--train.global_batch={2 * dp}", "--log.progress=false",
    ])  # fmt: skip


def mesh_split(profile: cProfile.Profile) -> tuple[float, float, int]:
    """(seconds in ParallelMesh, of them in torch.distributed: every function of it that
    megapipe's code calls directly (DeviceMesh, its slicing and flattening, new_group), torch's
    new_group calls). megapipe's own tensor arithmetic (the rank grid) stays megapipe's."""
    stats = pstats.Stats(profile).stats
    total = torch_s = 0.0
    calls = 0
    for (file, _, name), (_, ncalls, _, cum, callers) in stats.items():
        if name == "__init__" and file.endswith(MEGAPIPE_MESH):
            total += cum
        elif "torch/distributed/" in file:
            torch_s += sum(c[3] for (f, _, _), c in callers.items() if OURS in f)
        if name == "new_group" and file.endswith("distributed_c10d.py"):
            calls += ncalls  # DeviceMesh's and megapipe's
    return total, torch_s, calls


def startup(world: int, run_dir: str) -> dict:
    """The phases of the last rank of `world`, in seconds."""
    cfg, out = config(world, run_dir), {"world": world}
    sizes = MeshSizes.of(cfg)
    began = time.process_time()
    with fake_world(world - 1, world):
        out["init"] = time.process_time() - began
        profile = cProfile.Profile(time.process_time)
        profile.enable()
        mesh = ParallelMesh(sizes)
        profile.disable()
        total, torch_s, out["groups"] = mesh_split(profile)
        out["mesh"], out["torch groups"], out["megapipe"] = total, torch_s, total - torch_s
        with fake_tensor_mode(), Measure():  # Measure: answers .item() on fake tensors
            at = time.process_time()
            job = parallelize(cfg, mesh, "cpu")
            out["parallelize"], at = time.process_time() - at, time.process_time()
            optimizer = job.optimizer()
            out["engine"], at = time.process_time() - at, time.process_time()
            m = cfg.model
            batch = torch.randint(0, m.vocab_size, (cfg.train.global_batch, m.seq_len + 1))
            job.train_step(optimizer, batch, 0)
            out["step"] = time.process_time() - at
    return out


COLUMNS = ("world", "groups", "init", "mesh", "torch groups", "megapipe", "parallelize",
           "engine", "step")  # fmt: skip


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"{r[c]:,}" if isinstance(r[c], int) else f"{r[c]:.3f}" for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="64,1024,16384")
    parser.add_argument("--run-dir", default="/tmp/bench_fake_startup")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w.isdigit() and int(w) % (PP * TP) == 0]
    if len(worlds) != len(args.worlds.split(",")):
        raise UsageError(f"--worlds={args.worlds}: give multiples of pp·tp = {PP * TP}")
    rows = [startup(w, args.run_dir) for w in worlds]
    print(table(rows))
    if args.json:
        write_json(args.json, rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv, errors=(ConfigError,))
