"""This machine's CPU profile, measured, and the local truth: the projection of small meshes
against the step times `train.py` measures on them (docs/architecture.md, "Layers", perf).

A CPU "node" is the machine: `ranks_per_node` training processes of `threads` torch threads
each share its cores and talk gloo over loopback (torchrun sets OMP_NUM_THREADS=1 for its
workers; a plain `python train.py` uses every core). `calibrate` measures, with `threads` torch
threads in each of `ranks_per_node` processes running the probes at the same time (the ranks
of a step share the cores' caches and memory bandwidth; a one-rank profile, `cpu_solo.yaml`,
prices the one-process run):

  GEMMs       float32 torch.mm over a sweep of shapes (every (m, n, k) from {64, 256, 1024}, and
              squares 128, 512, 2048), operands cold in cache (a training step's other kernels
              stream through it between two GEMMs), each the median of several timed rounds.
              costs.Device prices a GEMM of F FLOPs moving Y bytes (operands and output) at
              t = F·(AI + κ·P/B) / (P·e·AI) = F/(e·P) + κ·Y/(e·B), linear in (F, Y): a least
              squares fit on relative error gives e (e_max) and κ for P the sweep's best
              throughput (`peak_tflops`) and B below.
  bandwidth   B (`hbm_gbps`): a 256 MiB float32 copy, bytes read + written per second.
  kernels     μ (`memory_efficiency`): the memory-bound kernels of a layer step besides the
              activation (residual add, scale, layer norm, the to/from-heads relayout, the
              cross entropy's log-softmax) on one 1 MiB activation, outputs allocated as in
              training: total bytes over total time, over B. A CPU runs them from its caches,
              so μ may exceed 1.
  GeLU        GPT-2's tanh GeLU and its backward per element (`gelu_*_ns`): compute-bound on a
              CPU (several ns per element), so priced per element instead of by bytes.
  attention   the causal SDPA kernel (forward + backward) on three shapes: the model's time for
              them (costs.py, fused attention at the GEMM curve) over the measured one is
              `attention_efficiency`.
  fixed time  what a block costs whatever its size (Python, op dispatch, autograd): the GPT as
              training builds it (pipeline/stages.build_model) at d_model 16 and 8 tokens,
              forward and backward timed with 1 and 5 layers: the difference per layer
              (`layer_*_us`), the rest the embedding and head (`ends_*_us`).
  gloo        two processes (`threads` threads each) over loopback: all-reduce and a
              batch_isend_irecv ping-pong (as pipeline/p2p.StageLinks posts them) of 1 KiB to
              16 MiB; α and β fitted to comm.py's ring formula for n = 2 (2α + S/β; the ring
              link, `nvlink_*`, which every collective inside the node uses) and α + S/β (the
              p2p link, `p2p_*`).

The node never talks to another node, so the network fields repeat the loopback ring's. Every
probe is a median over rounds that alternate its cases, and the spread is written next to each
value in the YAML, since the cores are shared with whatever else runs.

Local truth (`local_points`): the same config on each of LOCAL_MESHES, measured as `train.py`
runs it (tools/launch.py -> torchrun for two ranks; one process with OMP_NUM_THREADS as the
profile), per-step times from metrics.jsonl, against `perf.model.project` with the profile
(runtime megapipe, float32). The model prices dedicated cores; other work on the machine takes
them away, so each run waits for the machine to go quiet, is rerun when it was disturbed, and
reports the other work's load and the ranks' run-queue wait (/proc schedstat: time runnable
without a core) next to its time. `timed_steps` times the same build()/train_step in an
already initialised gloo world (the tests' worker pool) or one process.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megapipe.config import Config, load_config
from megapipe.data.loader import build_data
from megapipe.distributed.mesh import MeshSizes, ParallelMesh
from megapipe.perf.cluster import CLUSTER_DIR, Cluster, load_cluster
from megapipe.perf.costs import Calibration, Device
from megapipe.perf.model import Projection, project
from megapipe.perf.runtime import MEGAPIPE
from megapipe.pipeline.stages import build_model
from megapipe.train.build import build
from models.gpt import GPT

ROOT = Path(__file__).resolve().parents[2]
GEMM_SHAPES = [(m, n, k) for m in (64, 256, 1024) for n in (64, 256, 1024) for k in (64, 256, 1024)]
GEMM_SHAPES += [(s, s, s) for s in (128, 512, 2048)]
GLOO_SIZES = [1 << p for p in range(10, 25, 2)]  # 1 KiB .. 16 MiB
BLOCKING_SIZES = [1 << 16, 1 << 18, 1 << 20]  # a small model's tp activations (64 KiB .. 1 MiB)
SKEW_GEMMS = (256, 384, 512, 640, 768)  # n×n GEMMs between the probe's collectives: ~0.5-11 ms
COPY_BYTES = 256 << 20
COLD_BYTES = 96 << 20  # operands of the GEMM probe: several times a server's last-level cache
KERNEL_ELEMENTS = 1 << 18  # 1 MiB of float32: one activation of a small model's microbatch

# -- probes -------------------------------------------------------------------------------------


def timed(fn: Callable[[], object], min_s: float = 0.02) -> float:
    """Seconds per call of `fn`: repeated until `min_s` has passed (one warm-up call first)."""
    fn()
    calls, began = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - began
        if elapsed >= min_s:
            return elapsed / calls


def rounds_median(cases: dict, fn: Callable, rounds: int) -> dict:
    """{case: (median, min, max)} of fn(case) over `rounds` rounds that alternate the cases."""
    seen: dict = {case: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            seen[case].append(fn(case))
    return {c: (statistics.median(v), min(v), max(v)) for c, v in seen.items()}


def probe_gemm(rounds: int = 5, shapes=GEMM_SHAPES) -> dict:
    """{(m, n, k): (median s, min, max)} of float32 torch.mm with cold operands: each call
    takes the next of as many operand pairs as fill COLD_BYTES (past the last-level cache), as
    in a training step, where other kernels stream through the cache between two GEMMs."""

    def run(shape):
        m, n, k = shape
        pairs = max(2, math.ceil(COLD_BYTES / (4 * (m * k + k * n))))
        ops = [(torch.ones(m, k), torch.ones(k, n)) for _ in range(pairs)]
        turn = iter(range(1 << 62))
        return timed(lambda: torch.mm(*ops[next(turn) % pairs]), 0.05)

    return rounds_median(shapes, run, rounds)


def probe_bandwidth(rounds: int = 5) -> tuple[float, float, float]:
    """Bytes/s of a large float32 copy (read + write): (median, min, max)."""
    src = torch.randn(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    out = rounds_median(["copy"], lambda _: timed(lambda: dst.copy_(src), 0.1), rounds)["copy"]
    return tuple(2 * COPY_BYTES / t for t in (out[0], out[2], out[1]))


def _kernels() -> dict[str, tuple[Callable[[], object], int]]:
    """The memory-bound kernels of a layer step (besides the activation function) at one
    activation's size, and the bytes each moves (read + write), outputs freshly allocated as
    in training."""
    n = KERNEL_ELEMENTS
    x, y = torch.randn(n), torch.randn(n)
    rows = x.view(-1, 256)
    heads = x.view(4, 256, 4, 64)
    w, b = torch.ones(256), torch.zeros(256)
    f = torch.nn.functional
    return {
        "add": (lambda: x + y, 12 * n),  # residual adds, bias, grad sums
        "scale": (lambda: x * 0.5, 8 * n),
        "layer_norm": (lambda: f.layer_norm(rows, (256,), w, b), 8 * n),
        "relayout": (lambda: heads.transpose(1, 2).contiguous(), 8 * n),  # to / from heads
        "log_softmax": (lambda: torch.log_softmax(rows, -1), 8 * n),  # the cross entropy
    }


def probe_kernels(rounds: int = 3) -> dict[str, tuple[float, int]]:
    """{kernel: (median seconds, bytes)}."""
    kernels = _kernels()
    out = rounds_median(kernels, lambda k: timed(kernels[k][0], 0.02), rounds)
    return {k: (out[k][0], kernels[k][1]) for k in kernels}


def probe_gelu(rounds: int = 5) -> tuple[float, float]:
    """Seconds per element of GPT-2's tanh GeLU forward and backward (aten.gelu_backward)."""
    n = KERNEL_ELEMENTS
    x, g = torch.randn(n // 1024, 1024), torch.randn(n // 1024, 1024)
    f = torch.nn.functional
    cases = {
        "fwd": lambda: f.gelu(x, approximate="tanh"),
        "bwd": lambda: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    }
    out = rounds_median(cases, lambda k: timed(cases[k]), rounds)
    return out["fwd"][0] / n, out["bwd"][0] / n


ATTENTION_SHAPES = [(4, 8, 128, 64), (2, 4, 512, 64), (8, 2, 256, 32)]  # (b, heads, s, hd)


def probe_attention(rounds: int = 5) -> dict:
    """{(b, heads, s, hd): median seconds of the causal SDPA forward + backward}, float32."""
    f = torch.nn.functional
    inputs = {
        shape: [torch.randn(*shape, requires_grad=True) for _ in range(3)]
        for shape in ATTENTION_SHAPES
    }

    def run(shape):
        q, k, v = inputs[shape]
        out = f.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    out = rounds_median(inputs, lambda s: timed(lambda: run(s)), rounds)
    return {s: v[0] for s, v in out.items()}


def _tiny_gpt(layers: int) -> GPT:
    tiny = ["model.d_model=16", "model.n_heads=2", "model.seq_len=8", "model.vocab_size=64"]
    cfg = load_config(None, [f"model.n_layers={layers}", *tiny, "model.dropout=0.0"])
    return build_model(cfg)  # as training builds it


def probe_fixed(rounds: int = 5, calls: int = 40) -> dict[int, tuple[float, float]]:
    """{layers: (forward s, backward s)} of the real GPT at d_model 16, one sequence of 8
    tokens: the time that does not scale with the work (module docstring)."""
    ids = torch.randint(0, 64, (1, 9))
    models = {layers: _tiny_gpt(layers) for layers in (1, 5)}

    def one(layers: int) -> tuple[float, float]:
        model, fwd, bwd = models[layers], [], []
        for _ in range(calls):
            began = time.perf_counter()
            loss = model(ids[:, :-1], ids[:, 1:])
            mid = time.perf_counter()
            loss.backward()
            fwd.append(mid - began)
            bwd.append(time.perf_counter() - mid)
        return statistics.median(fwd), statistics.median(bwd)

    seen: dict = {k: [] for k in models}
    for _ in range(rounds):
        for k in models:
            seen[k].append(one(k))
    return {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for k, v in seen.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, threads: int, rounds: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    peer = 1 - rank
    seen: dict = {("all_reduce", s): [] for s in GLOO_SIZES}
    seen.update({("p2p", s): [] for s in GLOO_SIZES})

    def exchange(op, x):
        for work in dist.batch_isend_irecv([dist.P2POp(op, x, peer)]):
            work.wait()

    for _ in range(rounds):
        for size in GLOO_SIZES:
            x = torch.ones(size // 4)
            reps = max(3, min(30, int(3e7 // size)))
            for _ in range(reps):
                dist.barrier()
                began = time.perf_counter()
                dist.all_reduce(x)
                seen["all_reduce", size].append(time.perf_counter() - began)
                dist.barrier()
                began = time.perf_counter()
                first, second = (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)
                exchange(first, x)
                exchange(second, x)
                seen["p2p", size].append((time.perf_counter() - began) / 2)  # one way
    seen.update(_blocking_probe(rounds))
    if rank == 0:
        results.put({k: (statistics.median(v), min(v), max(v)) for k, v in seen.items()})
    dist.destroy_process_group()


def _blocking_probe(rounds: int, reps: int = 20) -> dict:
    """{("blocking", bytes, n): [s per all-reduce], ("gemm", n): [s per GEMM]}: a tp layer's
    pattern, an n×n GEMM then a blocking all-reduce, timed against the GEMMs alone (both ranks
    computing in both loops, so their sharing of the cores cancels). The difference is what a
    collective costs in training: the isolated all-reduce (the barrier-aligned probe above)
    plus the ranks' arrival skew and the wake-up of the waiting one, which the aligned probe
    cannot see. Two GEMM sizes (SKEW_GEMMS) tell the part that grows with the compute between
    two collectives (the skew of ranks sharing cores) from the part that does not."""
    import torch.distributed as dist

    seen: dict = {}
    for _ in range(rounds):
        for n in SKEW_GEMMS:
            a, b = torch.randn(n, n), torch.randn(n, n)
            for size in BLOCKING_SIZES:
                x = torch.ones(size // 4)
                dist.barrier()
                began = time.perf_counter()
                for _ in range(reps):
                    torch.mm(a, b)
                alone = time.perf_counter() - began
                dist.barrier()
                began = time.perf_counter()
                for _ in range(reps):
                    torch.mm(a, b)
                    dist.all_reduce(x)
                extra = (time.perf_counter() - began - alone) / reps
                seen.setdefault(("blocking", size, n), []).append(extra)
                seen.setdefault(("gemm", n), []).append(alone / reps)
    return seen


def probe_gloo(threads: int = 1, rounds: int = 3) -> dict:
    """{("all_reduce" | "p2p", bytes): (median s, min, max)} between two local processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_gloo_worker, args=(r, port, threads, rounds, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


# -- fits ---------------------------------------------------------------------------------------


def fit_linear(xs: list[tuple[float, float]], ts: list[float]) -> tuple[float, float]:
    """(a, b) >= 0 minimising Σ((a·x0 + b·x1)/t − 1)²: a time model linear in two features,
    fitted on relative error so that small and large cases count alike."""
    rows = [(x0 / t, x1 / t) for (x0, x1), t in zip(xs, ts)]
    s00 = sum(r[0] * r[0] for r in rows)
    s01 = sum(r[0] * r[1] for r in rows)
    s11 = sum(r[1] * r[1] for r in rows)
    y0, y1 = sum(r[0] for r in rows), sum(r[1] for r in rows)
    det = s00 * s11 - s01 * s01
    a, b = (y0 * s11 - y1 * s01) / det, (y1 * s00 - y0 * s01) / det
    if b < 0:  # one feature alone
        a, b = y0 / s00, 0.0
    elif a < 0:
        a, b = 0.0, y1 / s11
    return a, b


def gemm_features(m: int, n: int, k: int, elt: int = 4) -> tuple[float, float]:
    """(FLOPs, bytes of operands and output) of one (m×k)·(k×n) GEMM."""
    return 2.0 * m * n * k, float(elt * (m * k + k * n + m * n))


def fit_gemm(samples: dict, bandwidth: float) -> tuple[float, float, float]:
    """(peak FLOP/s, e_max, κ) from {(m, n, k): seconds} (module docstring)."""
    shapes = list(samples)
    feats = [gemm_features(*s) for s in shapes]
    times = [samples[s] for s in shapes]
    peak = max(f[0] / t for f, t in zip(feats, times))
    a, b = fit_linear(feats, times)
    e_max = 1.0 / (a * peak)
    return peak, e_max, b * bandwidth * e_max


def fit_link(samples: dict[int, float], latency_steps: int) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of t = steps·α + S/β over {bytes: seconds}."""
    sizes = sorted(samples)
    c0, c1 = fit_linear([(1.0, float(s)) for s in sizes], [samples[s] for s in sizes])
    return c0 / latency_steps, (1.0 / c1 if c1 > 0 else math.inf)


# -- the profile --------------------------------------------------------------------------------


@dataclass
class Measured:
    """Everything calibrate measures (seconds; bytes/s), with the spreads for the YAML."""

    threads: int
    ranks_per_node: int
    gemm: dict  # (m, n, k) -> (median, min, max)
    bandwidth: tuple[float, float, float]
    kernels: dict  # name -> (median s, bytes)
    gelu: tuple[float, float]  # s per element, forward and backward
    attention: dict  # (b, heads, s, hd) -> s forward + backward
    fixed: dict  # layers -> (fwd s, bwd s)
    gloo: dict  # (kind, bytes) -> (median, min, max)
    notes: dict = field(default_factory=dict)


def compute_probes(threads: int, rounds: int) -> tuple:
    """GEMMs, copy bandwidth, memory-bound kernels, GeLU, attention and the fixed time per
    block, in this process with `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gemm = probe_gemm(rounds)
        bandwidth = probe_bandwidth(rounds)
        kernels = probe_kernels(rounds)
        gelu = probe_gelu(rounds)
        attention = probe_attention(rounds)
        fixed = probe_fixed(rounds)
    finally:
        torch.set_num_threads(before)
    return gemm, bandwidth, kernels, gelu, attention, fixed


def _compute_worker(rank: int, threads: int, rounds: int, start, results) -> None:
    start.wait()  # every rank's probes run at once, as the ranks of a training step do
    results.put((rank, compute_probes(threads, rounds)))


def concurrent_compute_probes(threads: int, rounds: int, ranks: int) -> tuple:
    """`compute_probes` in `ranks` processes at the same time; rank 0's figures. The ranks of
    one machine share its cores' caches, memory bandwidth and turbo budget: measured alone,
    one process runs ~1.4x faster here than each of two running together (local truth, dp2's
    rank CPU time per step against half the one-process step), so a profile for
    `ranks_per_node` ranks is measured with that many running."""
    if ranks == 1:
        return compute_probes(threads, rounds)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(ranks), ctx.Queue()
    args = [(r, threads, rounds, start, results) for r in range(ranks)]
    procs = [ctx.Process(target=_compute_worker, args=a) for a in args]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=900) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got[0]


def measure(
    threads: int = 1,
    ranks_per_node: int = 2,
    rounds: int = 5,
    say: Callable[[str], None] = lambda _: None,
    settle: Callable[[], float | None] = lambda: None,
) -> Measured:
    """Run every probe with `threads` torch threads in each of `ranks_per_node` processes at
    once (module docstring); `settle` runs before each group (tools/plan.py waits there for the
    machine's other work to calm down)."""
    loads = [settle()]
    say(
        f"GEMM sweep ({len(GEMM_SHAPES)} shapes x {rounds} rounds), copy bandwidth, memory-bound"
        f" kernels, GeLU, attention, fixed time per block: {ranks_per_node} rank(s) at once"
    )
    gemm, bandwidth, kernels, gelu, attention, fixed = concurrent_compute_probes(
        threads, rounds, ranks_per_node
    )
    loads.append(settle())
    say("gloo all-reduce and p2p between two processes")
    gloo = probe_gloo(threads, max(rounds // 2, 1))
    notes = {"other_work_cores": [x for x in loads if isinstance(x, (int, float))]}
    return Measured(
        threads, ranks_per_node, gemm, bandwidth, kernels, gelu, attention, fixed, gloo, notes
    )


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "CPU"


def profile_values(m: Measured, name: str) -> dict:
    """The profile's keys (cluster.Cluster) from the measurements."""
    bandwidth = m.bandwidth[0]
    peak, e_max, knee = fit_gemm({s: v[0] for s, v in m.gemm.items()}, bandwidth)
    kernel_bytes = sum(b for _, b in m.kernels.values())
    kernel_time = sum(t for t, _ in m.kernels.values())
    mu = kernel_bytes / kernel_time / bandwidth
    ar_alpha, ar_beta = fit_link({s: v[0] for s, v in _probe(m.gloo, "all_reduce").items()}, 2)
    p2p_alpha, p2p_beta = fit_link({s: v[0] for s, v in _probe(m.gloo, "p2p").items()}, 1)
    (f1, b1), (f5, b5) = m.fixed[1], m.fixed[5]
    layer_f, layer_b = max((f5 - f1) / 4, 0.0), max((b5 - b1) / 4, 0.0)
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    dev = Device(peak, bandwidth, Calibration(e_max, knee, mu))
    attention = sum(attention_model(dev, s) for s in m.attention) / sum(m.attention.values())
    sync, skew = collective_sync(m.gloo)
    return {
        "name": name,
        "gpu": f"{cpu_name()}, {os.cpu_count()} cores, {m.threads} torch thread(s) per rank",
        "peak_tflops": round(peak / 1e12, 6),
        "hbm_gib": round(ram_gib / m.ranks_per_node, 2),
        "hbm_gbps": round(bandwidth / 1e9, 3),
        "nvlink_gbps": round(ar_beta / 1e9, 4),
        "nvlink_efficiency": 1.0,
        "nvlink_latency_us": round(ar_alpha * 1e6, 2),
        "gpus_per_node": m.ranks_per_node,
        "network_gbps": round(ar_beta / 1e9 * m.ranks_per_node, 4),
        "network_efficiency": 1.0,
        "network_latency_us": round(ar_alpha * 1e6, 2),
        "device": "cpu",
        "threads": m.threads,
        "gemm_efficiency": round(e_max, 4),
        "gemm_knee": round(knee, 4),
        "memory_efficiency": round(mu, 4),
        "p2p_gbps": round(p2p_beta / 1e9, 4),
        "p2p_latency_us": round(p2p_alpha * 1e6, 2),
        "layer_forward_us": round(layer_f * 1e6, 1),
        "layer_backward_us": round(layer_b * 1e6, 1),
        "ends_forward_us": round(max(f1 - layer_f, 0.0) * 1e6, 1),
        "ends_backward_us": round(max(b1 - layer_b, 0.0) * 1e6, 1),
        "gelu_forward_ns": round(m.gelu[0] * 1e9, 3),
        "gelu_backward_ns": round(m.gelu[1] * 1e9, 3),
        "attention_efficiency": round(attention, 4),
        "collective_sync_us": round(sync * 1e6, 1),
        "collective_skew": round(skew, 4),
    }


def _probe(gloo: dict, kind: str) -> dict:
    """{bytes: times} of one gloo probe (keys (kind, bytes); the blocking probe's carry more)."""
    return {key[1]: v for key, v in gloo.items() if key[0] == kind and len(key) == 2}


def collective_sync(gloo: dict) -> tuple[float, float]:
    """(seconds, fraction): what a blocking all-reduce costs in training beyond the aligned
    probe's, as a fixed part plus a fraction of the compute since the previous collective.
    Per message size, the blocking probe's excess over the aligned all-reduce against the GEMM
    time, over the SKEW_GEMMS sizes, is fitted with a least-squares line: its slope is the
    fraction (the ranks' arrival skew grows with the compute before the collective), its
    intercept the fixed part (the waiting rank's wake-up). Medians over BLOCKING_SIZES,
    neither below 0; (0, 0) without the probe."""
    times = [gloo["gemm", n][0] for n in SKEW_GEMMS if ("gemm", n) in gloo]
    if len(times) < 2:
        return 0.0, 0.0
    fixed, slope = [], []
    for s in BLOCKING_SIZES:
        keys = [("blocking", s, n) for n in SKEW_GEMMS]
        if ("all_reduce", s) not in gloo or not all(k in gloo for k in keys):
            continue
        excess = [gloo[k][0] - gloo["all_reduce", s][0] for k in keys]
        r, c = _line(times, excess)
        slope.append(r)
        fixed.append(c)
    if not slope:
        return 0.0, 0.0
    return max(statistics.median(fixed), 0.0), max(statistics.median(slope), 0.0)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    r = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return r, my - r * mx


def attention_model(dev: Device, shape: tuple[int, int, int, int]) -> float:
    """Seconds costs.CostModel gives a causal fused attention forward + backward of `shape`
    (b, heads, s, hd) in float32 before the kernel's own efficiency."""
    b, heads, s, hd = shape
    pairs = s * (s + 1) / 2
    fwd = 4.0 * hd * pairs * b * heads
    intensity = 4.0 * hd * pairs / (4 * hd * 2 * (s + s))
    return dev.matmul(fwd, intensity) + dev.matmul(2.5 * fwd, intensity)


def _spread(v: tuple[float, float, float], scale: float, unit: str, invert: bool = False) -> str:
    med, lo, hi = (scale / x for x in v) if invert else (x * scale for x in v)
    lo, hi = sorted((lo, hi))
    return f"median {med:.4g} {unit}, range {lo:.4g}-{hi:.4g}"


def render(values: dict, m: Measured, command: str) -> str:
    """The profile as commented YAML (every value with how it was measured)."""
    peak = values["peak_tflops"] * 1e12
    best = max(m.gemm, key=lambda s: gemm_features(*s)[0] / m.gemm[s][0])
    worst = max(abs(_gemm_model(values, s) / m.gemm[s][0] - 1) for s in m.gemm)
    ar, p2p = _probe(m.gloo, "all_reduce"), _probe(m.gloo, "p2p")
    big, small = max(ar), min(ar)
    lines = [
        f"# This machine's CPU as a 'cluster' of one node: {values['gpus_per_node']} rank(s) of "
        f"{m.threads} torch thread(s), gloo over loopback.",
        f"# Measured by `{command}` (megapipe/perf/calibrate.py) on "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores shared with other work: medians over rounds, spreads below.",
        "# other work on the machine before each probe group (cores): "
        + (", ".join(f"{x:.2f}" for x in m.notes.get("other_work_cores", [])) or "not measured"),
        f"name: {values['name']}",
        f"gpu: {values['gpu']}",
        f"# float32 torch.mm, best of the sweep: {best} at {peak / 1e9:.1f} GFLOP/s "
        f"({_spread(m.gemm[best], gemm_features(*best)[0] / 1e9, 'GFLOP/s', True)})",
        f"peak_tflops: {values['peak_tflops']}",
        f"hbm_gib: {values['hbm_gib']}  # RAM / ranks per node",
        f"# {COPY_BYTES >> 20} MiB float32 copy, read + write: "
        f"{_spread(m.bandwidth, 1e-9, 'GB/s')}",
        f"hbm_gbps: {values['hbm_gbps']}",
        "# gloo all-reduce of 1 KiB..16 MiB between two processes, fitted to 2α + S/β "
        f"(comm.ring_time, n = 2): {small} B {_spread(ar[small], 1e6, 'us')}; {big} B "
        f"{_spread(ar[big], 1e3, 'ms')}",
        f"nvlink_gbps: {values['nvlink_gbps']}",
        "nvlink_efficiency: 1.0  # the measured rate is the achieved one",
        f"nvlink_latency_us: {values['nvlink_latency_us']}",
        f"gpus_per_node: {values['gpus_per_node']}",
        "# one machine: no other node to reach; the loopback ring's values",
        f"network_gbps: {values['network_gbps']}",
        "network_efficiency: 1.0",
        f"network_latency_us: {values['network_latency_us']}",
        "device: cpu  # attention as config/memory.attention_path picks it on CPU",
        f"threads: {values['threads']}",
        f"# e_max and κ: least squares on relative time over the {len(m.gemm)} GEMM shapes "
        f"(worst shape off by {worst:.0%})",
        f"gemm_efficiency: {values['gemm_efficiency']}",
        f"gemm_knee: {values['gemm_knee']}",
        "# μ: "
        + ", ".join(f"{k} {b / t / 1e9:.1f}" for k, (t, b) in m.kernels.items())
        + " GB/s, total bytes over total time, over the copy's",
        f"memory_efficiency: {values['memory_efficiency']}",
        "# gloo batch_isend_irecv ping-pong (pipeline/p2p.py's calls), one way, fitted to "
        f"α + S/β: {small} B {_spread(p2p[small], 1e6, 'us')}; {big} B "
        f"{_spread(p2p[big], 1e3, 'ms')}",
        f"p2p_gbps: {values['p2p_gbps']}",
        f"p2p_latency_us: {values['p2p_latency_us']}",
        "# the GPT (models/gpt.py) at d_model 16, 8 tokens: forward / backward "
        + ", ".join(
            f"{k} layer(s) {f * 1e3:.3f} / {b * 1e3:.3f} ms"
            for k, (f, b) in sorted(m.fixed.items())
        )
        + "; per layer the difference / 4, the ends the rest",
        f"layer_forward_us: {values['layer_forward_us']}",
        f"layer_backward_us: {values['layer_backward_us']}",
        f"ends_forward_us: {values['ends_forward_us']}",
        f"ends_backward_us: {values['ends_backward_us']}",
        f"# tanh GeLU over {KERNEL_ELEMENTS} float32 elements, forward and aten.gelu_backward, "
        "ns per element (compute-bound here: priced per element, not by bytes)",
        f"gelu_forward_ns: {values['gelu_forward_ns']}",
        f"gelu_backward_ns: {values['gelu_backward_ns']}",
        "# causal SDPA forward + backward (b, heads, s, hd) "
        + ", ".join(f"{sh} {t * 1e3:.2f} ms" for sh, t in m.attention.items())
        + ": the model's time for them (costs.py, fused) over the measured",
        f"attention_efficiency: {values['attention_efficiency']}",
        "# an n×n GEMM then a blocking all-reduce, against the GEMMs alone: "
        + ", ".join(
            f"n {n} ({m.gloo['gemm', n][0] * 1e3:.2f} ms), {s} B "
            + _spread(m.gloo["blocking", s, n], 1e6, "us")
            for n in SKEW_GEMMS
            for s in BLOCKING_SIZES
            if ("blocking", s, n) in m.gloo
        )
        + "; less the aligned all-reduce, a line in the GEMM's time: its intercept (us) and",
        "# its slope (the fraction of the compute between collectives a rank waits, skew)",
        f"collective_sync_us: {values['collective_sync_us']}",
        f"collective_skew: {values['collective_skew']}",
    ]
    return "\n".join(lines) + "\n"


def _gemm_model(values: dict, shape) -> float:
    """Seconds costs.Device prices a float32 GEMM at with the profile's values."""
    flops, nbytes = gemm_features(*shape)
    peak, bw = values["peak_tflops"] * 1e12, values["hbm_gbps"] * 1e9
    e, knee = values["gemm_efficiency"], values["gemm_knee"]
    return flops / (e * peak) + knee * nbytes / (e * bw)


def write_profile(path: str | Path, values: dict, m: Measured, command: str) -> Cluster:
    """Write the YAML and load it back through cluster.load_cluster (the same checks)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.yaml")
    tmp.write_text(render(values, m, command))
    cluster = load_cluster(str(tmp))
    os.replace(tmp, path)
    return cluster


def default_profile(threads: int = 1, ranks: int = 2) -> str:
    """The profile a run of `threads` threads per rank uses: clusters/cpu.yaml (1), cpu_Nt;
    measured with one rank on the machine (a one-process run): `_solo` after it."""
    name = "cpu" if threads == 1 else f"cpu_{threads}t"
    return name + ("_solo" if ranks == 1 else "")


def profile_path(name: str) -> Path:
    return Path(name) if name.endswith((".yaml", ".yml")) else CLUSTER_DIR / f"{name}.yaml"


# -- local truth --------------------------------------------------------------------------------

# One config for every point: big enough that a step is mostly GEMMs (about 25 GFLOP), small
# enough for a few seconds of steps on one core.
LOCAL_CONFIG = [
    "model.arch=gpt2",
    "model.n_layers=4",
    "model.d_model=256",
    "model.n_heads=4",
    "model.seq_len=128",
    "model.vocab_size=2048",
    "model.dropout=0.0",
    "train.global_batch=8",
    "parallel.microbatches=4",
    "train.lr=3e-4",
    "train.warmup=1",
    "data.source=synthetic",
    "log.progress=false",
    "log.interval=1",
]
LOCAL_MESHES = {
    "1 process": [],
    "dp2": ["parallel.dp=2"],
    "pp2 1f1b": ["parallel.pp=2", "parallel.schedule=1f1b"],
    "pp2 zb_h1": ["parallel.pp=2", "parallel.schedule=zb_h1"],
    "tp2": ["parallel.tp=2"],
}


def local_config(mesh: list[str], extra: list[str] = ()) -> Config:
    return load_config(None, [*LOCAL_CONFIG, *extra, *mesh])


def project_point(cfg: Config, cluster: Cluster) -> Projection:
    """The projection local truth compares against: runtime megapipe, float32, no memory."""
    return project(cfg, cluster, MEGAPIPE, memory=False)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine (/proc/stat), or (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid` (/proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _workers(proc: subprocess.Popen, world: int) -> list[int]:
    """The train.py processes: `proc` itself on one process, else torchrun's workers."""
    if world == 1:
        return [proc.pid]
    found = []
    for pid in _children(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train.py") for a in argv) and b"torch.distributed.run" not in argv:
            found.append(pid)
    return found


def _sched(pid: int) -> tuple[float, float, float]:
    """(main thread's CPU s, its run-queue wait s: runnable but not running, the process's
    CPU s over all threads) from /proc/<pid>/task/<pid>/schedstat and /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0, 0.0
    return run_ns * 1e-9, wait_ns * 1e-9, ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One train.py run, over its steps after the warm-up: per-step seconds (metrics.jsonl),
    per rank the run-queue wait per step (the time its training thread was runnable but had
    no core: the machine's other work), and the rest of the machine's load in cores."""

    steps: list[float]
    wait: list[float]  # per rank, s per step
    others: float  # cores the rest of the machine kept busy meanwhile
    cpu: list[float] = field(default_factory=list)  # per rank, its training thread's CPU s/step


def train_run(
    mesh: list[str],
    steps: int,
    warmup: int,
    threads: int,
    extra: list[str] = (),
    timeout: float = 600,
) -> Run:
    """Run train.py (tools/launch.py -> torchrun for world > 1) on the local config; step
    times from its metrics.jsonl (the loop times each train_step). While it runs, the ranks'
    scheduler counters are read when the warm-up's last step and the last step are logged."""
    cfg = local_config(mesh, extra)
    world = cfg.derived.world_size
    with tempfile.TemporaryDirectory(prefix="megapipe-local-") as tmp:
        args = [f"--{o}" for o in (*LOCAL_CONFIG, *extra, *mesh)]
        args += [f"--train.steps={steps + warmup}", f"--run.dir={tmp}/run"]
        if world == 1:
            cmd = [sys.executable, str(ROOT / "train.py"), *args]
        else:
            cmd = [
                sys.executable,
                str(ROOT / "tools" / "launch.py"),
                f"--nproc-per-node={world}",
                str(ROOT / "train.py"),
                *args,
            ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "WANDB_MODE": "disabled",
            "PYTHONPATH": str(ROOT),
        }
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        with open(Path(tmp) / "log.txt", "w+") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
            began, marks = time.perf_counter(), {}
            try:
                while proc.poll() is None:
                    if time.perf_counter() - began > timeout:
                        raise RuntimeError(f"train.py on {mesh or 'one process'}: over {timeout} s")
                    done = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
                    for mark in (warmup, warmup + steps):
                        if done >= mark and mark not in marks:
                            pids = _workers(proc, world)
                            marks[mark] = (
                                time.perf_counter(),
                                _cpu_ticks(),
                                [_sched(p) for p in pids],
                            )
                    time.sleep(0.005)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            log.seek(0)
            output = log.read()
        if proc.returncode != 0:
            tail = output.strip().splitlines()[-5:]
            raise RuntimeError(f"train.py on {mesh or 'one process'} failed: " + " | ".join(tail))
        tokens = cfg.derived.tokens_per_step
        with open(metrics) as f:
            times = [tokens / json.loads(line)["tokens_per_s"] for line in f]
    complete = warmup + steps in marks and warmup in marks
    if not complete or len(marks[warmup][2]) != world or len(marks[warmup + steps][2]) != world:
        return Run(times[warmup:], [math.nan] * world, math.nan, [math.nan] * world)
    (t0, ticks0, s0), (t1, ticks1, s1) = marks[warmup], marks[warmup + steps]
    wait = [(b[1] - a[1]) / steps for a, b in zip(s0, s1)]
    cpu = [(b[0] - a[0]) / steps for a, b in zip(s0, s1)]
    ours = sum(b[2] - a[2] for a, b in zip(s0, s1))
    busy = (ticks1[0] - ticks0[0]) / os.sysconf("SC_CLK_TCK")
    return Run(times[warmup:], wait, max(busy - ours, 0.0) / (t1 - t0), cpu)


@dataclass
class Point:
    name: str
    mesh: list[str]
    steps: list[float]  # every measured step, all rounds
    rounds: list[float]  # median of each round
    others: list[float]  # the other work's load (cores) during each round
    wait: list[float]  # each round's run-queue wait per step (s, the most waiting rank)
    projected: Projection
    cpu: list[float] = field(default_factory=list)  # each round's busiest rank's CPU s/step

    @property
    def measured(self) -> float:
        return statistics.median(self.steps)

    @property
    def error(self) -> float:
        return self.projected.step_time_s / self.measured - 1


def _thread_wait() -> float:
    """Seconds this thread has been runnable without a core (/proc/thread-self/schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return math.nan


def timed_steps(mesh: list[str], steps: int, warmup: int, extra: list[str] = ()) -> dict:
    """train_step timed as train.py's loop times it, on the local config under `mesh`: in the
    initialised gloo world of the calling process (tests/parity.WorkerPool's ranks) or, with
    none, on this one process. Per-step seconds after `warmup` steps and this thread's
    run-queue wait per step."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="megapipe-local-") as tmp:
        cfg = local_config(mesh, [*extra, f"run.dir={tmp}/run"])
        grid = ParallelMesh(MeshSizes.of(cfg)) if dist.is_initialized() else None
        job = build(cfg, grid, "cpu")
        optimizer = job.optimizer()
        data = build_data(cfg.data, cfg.model, cfg.train.seed)
        times, wait0 = [], 0.0
        for step in range(warmup + steps):
            if step == warmup:
                if grid is not None:
                    dist.barrier()
                wait0 = _thread_wait()
            batch = data.batch(step, cfg.train.global_batch)
            began = time.perf_counter()
            job.train_step(optimizer, batch, step)
            times.append(time.perf_counter() - began)
        wait = (_thread_wait() - wait0) / steps
    return {"steps": times[warmup:], "wait": wait}


def others_load(seconds: float = 1.0) -> float:
    """Cores the rest of the machine keeps busy over `seconds` (this process idle)."""
    busy0, total0 = _cpu_ticks()
    time.sleep(seconds)
    busy1, total1 = _cpu_ticks()
    if total1 == total0:
        return 0.0
    return (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1)


def wait_quiet(
    threshold: float,
    timeout: float,
    say: Callable[[str], None] = lambda _: None,
    window: float = 2.0,
) -> float:
    """Wait (at most `timeout` s) until the machine's other work uses at most `threshold`
    cores over `window` s; the load last seen."""
    began, said = time.perf_counter(), False
    while True:
        load = others_load(window)
        if load <= threshold or time.perf_counter() - began >= timeout:
            return load
        if not said:
            say(f"  waiting for the machine to go quiet: other work uses {load:.1f} cores")
            said = True


def local_points(
    steps: int = 10,
    rounds: int = 3,
    warmup: int = 2,
    threads: int = 1,
    solo_threads: int | None = None,
    meshes: dict = LOCAL_MESHES,
    profile: str | None = None,
    solo_profile: str | None = None,
    quiet: float = 0.25,
    patience: float = 300.0,
    retries: int = 2,
    say: Callable[[str], None] = lambda _: None,
) -> list[Point]:
    """Measure every mesh `rounds` times, alternating, and project it (module docstring).
    One process runs `solo_threads` threads (default: `threads`) with its profile.

    The cores are shared with other work, which the model does not know about: each run
    waits (up to `patience` s) for the rest of the machine to use at most `quiet` cores, and
    a run during which it used more is run again (up to `retries` times; the least disturbed
    is kept). The table shows the other work's load during the runs kept."""
    solo_threads = solo_threads or threads
    clusters = {
        1: load_cluster(solo_profile or default_profile(solo_threads, ranks=1)),
        2: load_cluster(profile or default_profile(threads)),
    }
    runs: dict[str, list[Run]] = {name: [] for name in meshes}
    for r in range(rounds):
        for name, mesh in meshes.items():
            world = local_config(mesh).derived.world_size
            tries = []
            for _ in range(retries + 1):
                wait_quiet(quiet, patience, say)
                run = train_run(mesh, steps, warmup, solo_threads if world == 1 else threads)
                tries.append(run)
                say(
                    f"round {r + 1}/{rounds}: {name}: median {statistics.median(run.steps):.3f} s,"
                    f" other work {run.others:.2f} cores"
                    + ("" if run.others <= quiet else " (disturbed)")
                )
                if run.others <= quiet:
                    break
            runs[name].append(min(tries, key=lambda x: x.others))
    points = []
    for name, mesh in meshes.items():
        cfg = local_config(mesh)
        cluster = clusters[1 if cfg.derived.world_size == 1 else 2]
        got = runs[name]
        points.append(
            Point(
                name,
                mesh,
                [t for run in got for t in run.steps],
                [statistics.median(run.steps) for run in got],
                [run.others for run in got],
                [max(run.wait) for run in got],
                project_point(cfg, cluster),
                [max(run.cpu) for run in got],
            )
        )
    return points


def markdown(points: list[Point]) -> str:
    """The local-truth table: measured median (quartiles over every step, range of the round
    medians), the other work's load and the ranks' run-queue wait, projected, error; then the
    busiest rank's CPU time per step against the projection's compute + optimizer (what a rank
    computes, whoever else shares the cores), and where the projection puts the time."""
    rows = [
        "| mesh | measured (s) | steps p25-p75 | round medians | other work (cores) "
        "| run-queue wait (s/step) | projected (s) | error | rank CPU (s/step) "
        "| projected compute + optimizer (s) | error | projected compute / tp / bubble+p2p / dp "
        "/ optimizer (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        q = statistics.quantiles(p.steps, n=4) if len(p.steps) > 1 else [p.measured] * 3
        b = p.projected.breakdown
        keys = ("compute_s", "tp_comm_s", "pipeline_bubble_p2p_s", "dp_comm_s", "optimizer_s")
        parts = " / ".join(f"{b[k]:.3f}" for k in keys)
        cpu = statistics.median(p.cpu) if p.cpu else math.nan
        work = b["compute_s"] + b["optimizer_s"]
        rows.append(
            f"| {p.name} | {p.measured:.3f} | {q[0]:.3f}-{q[2]:.3f} | "
            f"{min(p.rounds):.3f}-{max(p.rounds):.3f} | {statistics.median(p.others):.2f} | "
            f"{statistics.median(p.wait):.3f} | {p.projected.step_time_s:.3f} | "
            f"{p.error:+.1%} | {cpu:.3f} | {work:.3f} | {work / cpu - 1:+.1%} | {parts} |"
        )
    errs = [abs(p.error) for p in points]
    rows.append(f"\nstep time: mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%}")
    return "\n".join(rows)


def points_json(points: list[Point]) -> dict:
    """The local truth as one JSON object (tools/plan.py local --json)."""
    return {
        "config": LOCAL_CONFIG,
        "points": [
            {
                "mesh": p.name,
                "overrides": p.mesh,
                "measured_s": p.measured,
                "steps_s": p.steps,
                "round_medians_s": p.rounds,
                "other_work_cores": p.others,
                "run_queue_wait_s": p.wait,
                "rank_cpu_s": p.cpu,
                "projected_s": p.projected.step_time_s,
                "error": p.error,
                "breakdown": p.projected.breakdown,
            }
            for p in points
        ],
    }
