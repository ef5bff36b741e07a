"""Spawned gloo workers for distributed tests: spawn once per world size, run many cases.

`WorkerPool(world)` starts `world` processes (one thread each) joined in one gloo group over a
TCP store on a free port. `pool.run(fn, *args)` sends an importable module-level function to
every rank and returns the list of per-rank results; a worker's exception comes back as its
traceback text in an AssertionError, and a case that does not finish within `timeout` kills the
pool (the next case respawns it) instead of hanging pytest.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 90  # a rank stuck in a collective errors out after this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    import gc

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    count = 0
    while (task := tasks.get()) is not None:
        # A world of its own for each case: a gloo group holds three threads until it is
        # destroyed (a pool that ran a few hundred cases held ~500 a worker, most of a core
        # between them), and each case's groups under their own store prefix, since torch
        # names the groups it makes again from the same ranks after a destroy.
        count += 1
        prefix = dist.PrefixStore(f"case{count}", store)
        dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world, timeout=timeout)
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - every failure goes back as text
            results.put((rank, False, traceback.format_exc()))
        dist.destroy_process_group()
        gc.collect()


class WorkerPool:
    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.cases = 0  # cases run: see Pools.MAX_CASES
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results))
            for r in range(world)
        ]
        for p in self.procs:
            p.daemon = True
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 180.0) -> list:
        """fn(*args) on every rank; the per-rank results in rank order."""
        self.cases += 1
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        out, errors = [None] * self.world, {}
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                raise AssertionError(
                    f"{fn.__name__}: no result within {timeout:.0f} s from world {self.world}; "
                    f"errors so far: {errors}"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
                timeout = min(timeout, COLLECTIVE_TIMEOUT_S + 30)  # the others may be stuck
        if errors:
            self.close(kill=True)  # collectives may be out of step: start afresh next time
            rank = min(errors)
            raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{errors[rank]}")
        return out

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class Pools:
    """Session cache: live pools by world size, reused across test files.

    Idle workers wait on their queues and use no CPU, only memory (~0.35 GB each), so pools of
    other sizes stay up: tests alternate between world sizes ~80 times in one run, and each
    respawn costs several seconds of start-up. Beyond MAX_IDLE_WORKERS the least recently used
    pool is closed."""

    MAX_IDLE_WORKERS = 14  # worlds 2, 4 and 8 together; a 16-rank pool evicts them
    # A training case leaves one gloo group's three threads behind in each worker even after
    # its world is destroyed (a backend held from C++); a pool starts afresh after this many.
    MAX_CASES = 50

    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}  # least recently used first

    def __call__(self, world: int) -> WorkerPool:
        pool = self.pools.pop(world, None)
        if pool is not None and (not pool.alive or pool.cases >= self.MAX_CASES):
            pool.close(kill=not pool.alive)
            pool = None
        if pool is None:
            while self.pools and sum(self.pools) + world > self.MAX_IDLE_WORKERS:
                self.pools.pop(next(iter(self.pools))).close()
            pool = WorkerPool(world)
        self.pools[world] = pool
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


# Cases whose parallel split changes float32 rounding inside attention or the sequence (ring
# attention's log-sum-exp merge, Seq1F1B's per-segment sums) train at lr 3e-4 instead of the tiny
# config's 3e-3. AdamW maps an element with a near-zero grad (|g| ~ 1e-8 against a median ~1e-3)
# to a step of lr·g/(|g| + eps), so ~1e-10 of round-off moves the weights by up to ~5e-5 of a
# tensor's norm after 3 steps at 3e-3: one process measured as much when only SDPA's CPU kernel
# was swapped (flash vs math, seed 7). At 3e-4 it stays below ~5e-6, under the 1e-5 bar.
LOW_LR = "train.lr=3e-4"

# ---- cases: module-level functions run on every rank --------------------------------------


def mesh_params(cases: dict, marks=()) -> list:
    """pytest params (world, dp, tp, extra) from {world: [(name, dp, tp, extra), ...]}."""
    import pytest

    return [
        pytest.param(world, dp, tp, extra, id=f"w{world}-{name}", marks=marks)
        for world, group in cases.items()
        for name, dp, tp, extra in group
    ]


def rank_microbatches(extra, dp: int) -> str:
    """The one-process reference's `parallel.microbatches`: dp × the case's, so each of its
    microbatches holds the rows one dp rank's does (its low-precision grads, casts and scales
    are then the mesh's; what differs is how the float32 sums add them up)."""
    m = next((int(x.split("=")[1]) for x in extra if x.startswith("parallel.microbatches=")), 1)
    return f"parallel.microbatches={dp * m}"


def tiny_config(overrides, run_dir: str):
    from megapipe.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config(
        os.path.join(root, "configs", "tiny.yaml"), [*overrides, f"run.dir={run_dir}"]
    )


def build_mesh(cfg):
    """The case's mesh over the already-initialised world, or None on one process."""
    import torch.distributed as dist

    from megapipe.distributed.mesh import MeshSizes, ParallelMesh

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return ParallelMesh(MeshSizes.of(cfg))


def built_case(overrides: list[str], bucket_mb: float = 0.01):
    """(cfg, mesh, job, optimizer, data) of the tiny config under `overrides`, wired by
    train.py's `parallelize()` on this worker's world, seeded as train.py seeds."""
    import tempfile

    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, mesh, "cpu", bucket_mb)
    optimizer = job.optimizer()
    return cfg, mesh, job, optimizer, build_data(cfg.data, cfg.model, cfg.train.seed)


def train_case(
    overrides: list[str],
    steps: int = 3,
    bucket_mb: float = 0.01,
    own_rows: bool = False,
    exact: bool = False,
    grad_error: tuple[str, float] | None = None,
    grad_noise: float = 0.0,
    noise_seed: int = 0,
    output_noise: bool = False,
) -> dict:
    """Train `steps` steps of the tiny config under its mesh, wired by the same `parallelize()` that
    train.py runs: per-step losses and grad norms, the final weights by logical name (this
    rank's chunks, whole over tp) and the dp-replica spread. `own_rows`: each rank reads only
    its dp rows of each batch, as train/loop.py does (else the whole global batch). `exact`
    (one process): the same run in float64 from the float32 initial weights, the yardstick of
    tests/util.py's bounds. `grad_error` (name, r): a planted bug, that parameter's grad off by
    a relative r (seeded noise), for tests that show the bounds still fail. `grad_noise` r:
    every parameter's grad perturbed by r of its RMS (seeded noise), the round-off twin of
    reference_case. `output_noise`: every tp linear's output perturbed too (_perturb_outputs),
    the round-off of the sums a mesh orders otherwise before an FP8 cast."""
    import tempfile

    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    torch.manual_seed(cfg.train.seed)
    init = _float32_init(cfg, mesh, bucket_mb) if exact else None
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if exact else default)
    try:  # float64: every tensor the run makes without naming a dtype
        job = parallelize(cfg, mesh, "cpu", bucket_mb)
        _plant(job, init, grad_error, grad_noise, noise_seed)
        if output_noise:
            _perturb_outputs(job, seed=noise_seed)
        optimizer = job.optimizer()
        data = build_data(cfg.data, cfg.model, cfg.train.seed)
        losses, norms = [], []
        for step in range(steps):
            rows = job.slice.rows(cfg.train.global_batch) if own_rows else None
            batch = data.batch(step, cfg.train.global_batch, rows=rows)
            result = job.train_step(optimizer, batch, step)
            losses.append(result.loss)
            norms.append(result.grad_norm)
    finally:
        torch.set_default_dtype(default)
    return _outcome(cfg, mesh, job, optimizer, losses, norms, steps)


def _float32_init(cfg, mesh, bucket_mb) -> list[torch.Tensor]:
    """The float32 run's initial weights: a float64 init draws other numbers from the seed."""
    from megapipe.train.parallelize import parallelize

    assert mesh is None, "the float64 reference runs on one process"
    chunks = parallelize(cfg, mesh, "cpu", bucket_mb).engine.chunks
    return [p.detach().clone() for chunk in chunks for p in chunk.parameters()]


@torch.no_grad()
def _plant(job, init, grad_error, grad_noise: float = 0.0, noise_seed: int = 0) -> None:
    """The float32 initial weights into a float64 job; the planted grad error's hook; the
    round-off noise on every grad."""
    params = [p for chunk in job.engine.chunks for p in chunk.parameters()]
    for param, value in zip(params, init or (), strict=init is not None):
        param.copy_(value)
    named = dict(p for chunk in job.engine.chunks for p in chunk.named_parameters())
    if grad_error is not None:
        name, r = grad_error
        _perturb(named[name], r, seed=0, fresh=False)
    if grad_noise:
        for seed, param in enumerate(named.values()):
            _perturb(param, grad_noise, seed=1 + seed + 1000 * noise_seed, fresh=True)


def _perturb_outputs(job, seed: int) -> None:
    """Every tp linear's output y = x Wᵀ perturbed by u·√in of its RMS (seeded N(0, 1) noise,
    fresh each call): the random-walk size of float32 summation's error over the `in` products
    of each output (roundoff_noise's rule), which another order of the same sums (tp's partial
    products, cp's merges) leaves before the next FP8 cast."""
    gen = torch.Generator().manual_seed(10_000 + seed)

    def hook(module, args, out):
        r = FLOAT32_EPS * args[0].shape[-1] ** 0.5
        z = torch.randn(out.shape, generator=gen).to(out.dtype)
        return out + r * out.detach().float().pow(2).mean().sqrt().to(out.dtype) * z

    for chunk in job.engine.chunks:
        for module in chunk.modules():
            if getattr(module, "tp_splits", None) is not None:
                module.register_forward_hook(hook)


def _perturb(param, r: float, seed: int, fresh: bool) -> None:
    """Add r × the grad's RMS × N(0, 1) noise to each grad `param` gets (`fresh`: new noise each
    time, as round-off is; else the same noise, a systematic error)."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)

    def hook(g):
        if not fresh:
            return g + r * g.norm() / g.numel() ** 0.5 * noise
        # round-off: none where nothing was summed (an embedding row no token of the step hit)
        z = torch.randn(param.shape, generator=gen, dtype=param.dtype) * (g != 0)
        return g + r * g.norm() / g.numel() ** 0.5 * z

    param.register_hook(hook)


def _outcome(cfg, mesh, job, optimizer, losses, norms, steps) -> dict:
    from megapipe.parallel.tensor.gather import gather_logical

    weights, engine = {}, job.engine
    with job.full_weights():  # zero >= 1: gathered after the step or on use
        for chunk in engine.chunks:
            for name, value in gather_logical(chunk).items():
                if name in weights and not torch.equal(weights[name], value):  # ZB-V tied copy
                    raise AssertionError(f"{name}: the two local copies differ")
                weights[name] = value
    out = {
        "losses": losses,
        "grad_norms": norms,
        "weights": weights,
        "dp_spread": _dp_spread(weights, mesh),
        "adam_reach": cfg.train.lr * steps,
        "optim_bytes": _optim_bytes(optimizer),
    }
    if cfg.parallel.pp == 1:
        out["overlapped_buckets"] = getattr(engine.reducer, "overlapped", 0)
        out["buckets"] = len(engine.reducer.buckets) if engine.reducer else 0
    else:
        out["events"] = [str(e.action) for e in engine.runtime.events]
        out["actions"] = [str(a) for a in engine.actions]
        out["deferred_matmuls"] = engine.runtime.deferred_matmuls
    return out


def _optim_bytes(optimizer) -> int:
    """Bytes of optimizer state tensors (AdamW's moments; the scalar step counts left out)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


def _dp_spread(weights: dict, mesh) -> float:
    """Largest |difference| between this rank's weights and dp rank 0's (0: replicas agree)."""
    import torch.distributed as dist

    if mesh is None or mesh.size("dp") == 1:
        return 0.0
    flat = torch.cat([w.flatten() for w in weights.values()])
    copies = [torch.empty_like(flat) for _ in range(mesh.size("dp"))]
    dist.all_gather(copies, flat, group=mesh.group("dp"))
    return max((c - copies[0]).abs().max().item() for c in copies)


_REFERENCES: dict = {}


FLOAT32_EPS = torch.finfo(torch.float32).eps / 2  # u, the unit round-off


def roundoff_noise(overrides) -> float:
    """Relative size of the noise the round-off twin adds to each grad: u·√N for a grad summed
    over the step's N = global_batch × seq_len tokens in float32, the random-walk size of
    recursive summation's error (Higham, Accuracy and Stability, §4.2 and its probabilistic
    remark), taken relative to the grad's RMS: cancellation makes an element's error relative
    to its tensor's scale, not to its own value, which is what AdamW then magnifies."""
    cfg = tiny_config(list(overrides), "unused")
    return FLOAT32_EPS * (cfg.train.global_batch * cfg.model.seq_len) ** 0.5


NOISE_SAMPLES = 3  # CADNA's three randomly rounded runs (Vignes 2004)


def reference_case(overrides, steps: int = 3) -> dict:
    """The one-process float32 reference with "exact": its twins, each a sample of what float32
    round-off does to this trajectory (tests/util.py derives each tensor's bound from them): the
    same run in float64 from the float32 initial weights, and NOISE_SAMPLES float32 runs with
    round-off-sized noise in every grad (stochastic arithmetic's way of sampling round-off's
    heavy tail: the grads AdamW flips when they are near zero, a routing tie; one sample's
    spread varied 40× between seeds on an MoE expert bias). Cached per session."""
    key = (tuple(overrides), steps)
    if key not in _REFERENCES:
        ref = train_case(list(overrides), steps)
        noise = roundoff_noise(overrides)
        ref["exact"] = [train_case(list(overrides), steps, exact=True)["weights"]] + [
            train_case(list(overrides), steps, grad_noise=noise, noise_seed=i)["weights"]
            for i in range(NOISE_SAMPLES)
        ]
        _REFERENCES[key] = ref
    return _REFERENCES[key]
