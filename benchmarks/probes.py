"""The compute probes that measure this machine's CPU for a profile (calibrate.py fits them),
each a median over rounds that alternate its cases, with the spread, since the cores are
shared with whatever else runs. They run in `ranks_per_node` processes at once
(`concurrent_compute_probes`, pooled by `pool_ranks`); gloo's probes between two processes are
gloo_probes.py's.

  GEMMs       float32 torch.mm over a sweep of shapes (every (m, n, k) from {64, 256, 1024}, and
              squares 128, 512, 2048), operands cold in cache (a training step's other kernels
              stream through it between two GEMMs), each the median of several timed rounds.
              cost_terms.Device prices a GEMM of F FLOPs moving Y bytes (operands and output) at
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

The machine's other work (`cpu_ticks`, `others_load`): `wait_quiet` waits for it to calm down
before a calibration's groups of probes (tools/plan.py) and each local-truth run.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from megapipe.config import load_config
from megapipe.models.activations import gelu_tanh
from megapipe.models.gpt import GPT
from megapipe.pipeline.stages import build_model

GEMM_SHAPES = [(m, n, k) for m in (64, 256, 1024) for n in (64, 256, 1024) for k in (64, 256, 1024)]
GEMM_SHAPES += [(s, s, s) for s in (128, 512, 2048)]
COPY_BYTES = 256 << 20
COLD_BYTES = 96 << 20  # operands of the GEMM probe: several times a server's last-level cache
KERNEL_ELEMENTS = 1 << 18  # 1 MiB of float32: one activation of a small model's microbatch


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
    """Seconds per element of GPT-2's tanh GeLU forward and backward as the model runs them
    (models/activations.gelu_tanh: its backward is aten's gelu_backward)."""
    n = KERNEL_ELEMENTS
    x, g = torch.randn(n // 1024, 1024), torch.randn(n // 1024, 1024)
    cases = {
        "fwd": lambda: gelu_tanh(x),
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
    """`compute_probes` in `ranks` processes at the same time, pooled over the ranks
    (pool_ranks). The ranks of one machine share its cores' caches, memory bandwidth and
    turbo budget: measured alone, one process runs faster here than each of two running
    together (compare cpu_solo.yaml's GEMM peak with cpu.yaml's), so a profile for
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
    return pool_ranks([got[r] for r in range(ranks)])


def _spread(values: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(median, min, max) figures of every rank as one: the median of the medians, with the
    widest range."""
    return (
        statistics.median(v[0] for v in values),
        min(v[1] for v in values),
        max(v[2] for v in values),
    )


def pool_ranks(per_rank: list[tuple]) -> tuple:
    """`compute_probes`' figures from every rank measured at once, pooled probe by probe:
    the ranks measured the same kernels under the same load, so their median halves the
    noise of one rank's single quick round (calibrate.probe_around)."""
    gemm, bandwidth, kernels, gelu, attention, fixed = zip(*per_rank)
    median = statistics.median
    return (
        {shape: _spread([g[shape] for g in gemm]) for shape in gemm[0]},
        _spread(bandwidth),
        {k: (median(r[k][0] for r in kernels), kernels[0][k][1]) for k in kernels[0]},
        tuple(median(g[i] for g in gelu) for i in (0, 1)),
        {shape: median(a[shape] for a in attention) for shape in attention[0]},
        {n: tuple(median(f[n][i] for f in fixed) for i in (0, 1)) for n in fixed[0]},
    )


# -- the machine's other work: probes and timed runs wait for it to calm down --------------------


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine (/proc/stat), or (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def others_load(seconds: float = 1.0) -> float:
    """Cores the rest of the machine keeps busy over `seconds` (this process idle)."""
    busy0, total0 = cpu_ticks()
    time.sleep(seconds)
    busy1, total1 = cpu_ticks()
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
