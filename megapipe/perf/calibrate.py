"""This machine's CPU profile: the probes (perf/probes.py, perf/gloo_probes.py) fitted into the
terms of a cluster profile (perf/cluster.py) and written as commented YAML
(docs/architecture.md, "Layers", perf).

A CPU "node" is the machine: `ranks_per_node` training processes of `threads` torch threads
each share its cores and talk gloo over loopback (torchrun sets OMP_NUM_THREADS=1 for its
workers; a plain `python train.py` uses every core). `measure` runs the compute probes with
`threads` torch threads in each of `ranks_per_node` processes at the same time (the ranks of a
step share the cores' caches and memory bandwidth; a one-rank profile, `cpu_solo.yaml`, prices
the one-process run), then gloo between two processes. The fits:

  GEMMs       costs.Device prices a GEMM of F FLOPs moving Y bytes (operands and output) at
              t = F·(AI + κ·P/B) / (P·e·AI) = F/(e·P) + κ·Y/(e·B), linear in (F, Y): a least
              squares fit on relative error gives e (e_max) and κ for P the sweep's best
              throughput (`peak_tflops`) and B the copy bandwidth (`hbm_gbps`).
  kernels     μ (`memory_efficiency`): the kernels' total bytes over their total time, over B.
  fixed time  the GPT with 1 and 5 layers: the difference per layer (`layer_*_us`), the rest
              the embedding and head (`ends_*_us`).
  gloo        α and β fitted to comm.py's ring formula for n = 2 (2α + S/β; the ring link,
              `nvlink_*`, which every collective inside the node uses) and α + S/β (the p2p
              link, `p2p_*`); a blocking all-reduce after GEMMs of five sizes, less the
              all-reduce as that fit prices it, as a line in the GEMM's time
              (`collective_sync_us`, `collective_skew`); the wait at one after ~0.1 s of
              GEMMs, less the same, over that compute (`step_skew`). The waits are means
              over their samples (gloo_probes.MEAN_CELLS: a step pays their sum), the rest
              medians.

The node never talks to another node, so the network fields repeat the loopback ring's.
`probe_around` measures the fields the probes decide again, one quick round, around a timed
run (the local truth) on a machine whose speed drifts.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch

from megapipe.perf.cluster import CLUSTER_DIR, Cluster, Link, load_cluster
from megapipe.perf.comm import ring_time
from megapipe.perf.costs import Calibration, Device
from megapipe.perf.gloo_probes import (
    BLOCKING_SIZES,
    SKEW_GEMMS,
    STEP_GEMMS,
    STEP_N,
    STEP_SYNCS,
    probe_gloo,
)
from megapipe.perf.probes import (
    COPY_BYTES,
    GEMM_SHAPES,
    KERNEL_ELEMENTS,
    concurrent_compute_probes,
    pool_ranks,
)

T = TypeVar("T")

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


# The fewest rounds of the gloo probes, in a calibration and around each local-truth run. The
# blocking probe's waits are heavy-tailed, and their mean over one round's samples swung: five
# 1-round probes in a row priced a 256 KiB tp all-reduce after 1.7 ms of compute (tp2's
# local-truth step) at 1.05-1.86 ms, three 3-round probes at 1.78-1.87 ms (the wait tp2's
# measured step implies: ~1.9 ms).
GLOO_ROUNDS = 3


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
    gloo = probe_gloo(threads, max(rounds, GLOO_ROUNDS))
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


def compute_values(m: Measured) -> dict:
    """The profile's fields the compute probes decide (the rest are gloo's and the machine's)."""
    bandwidth = m.bandwidth[0]
    peak, e_max, knee = fit_gemm({s: v[0] for s, v in m.gemm.items()}, bandwidth)
    kernel_bytes = sum(b for _, b in m.kernels.values())
    kernel_time = sum(t for t, _ in m.kernels.values())
    mu = kernel_bytes / kernel_time / bandwidth
    (f1, b1), (f5, b5) = m.fixed[1], m.fixed[5]
    layer_f, layer_b = max((f5 - f1) / 4, 0.0), max((b5 - b1) / 4, 0.0)
    dev = Device(peak, bandwidth, Calibration(e_max, knee, mu))
    attention = sum(attention_model(dev, s) for s in m.attention) / sum(m.attention.values())
    return {
        "peak_tflops": round(peak / 1e12, 6),
        "hbm_gbps": round(bandwidth / 1e9, 3),
        "gemm_efficiency": round(e_max, 4),
        "gemm_knee": round(knee, 4),
        "memory_efficiency": round(mu, 4),
        "layer_forward_us": round(layer_f * 1e6, 1),
        "layer_backward_us": round(layer_b * 1e6, 1),
        "ends_forward_us": round(max(f1 - layer_f, 0.0) * 1e6, 1),
        "ends_backward_us": round(max(b1 - layer_b, 0.0) * 1e6, 1),
        "gelu_forward_ns": round(m.gelu[0] * 1e9, 3),
        "gelu_backward_ns": round(m.gelu[1] * 1e9, 3),
        "attention_efficiency": round(attention, 4),
    }


def link_values(m: Measured) -> dict:
    """The profile's fields the gloo probes decide: the ring and p2p links, and what a
    blocking collective costs beyond the aligned one."""
    ar_alpha, ar_beta = fit_link({s: v[0] for s, v in _probe(m.gloo, "all_reduce").items()}, 2)
    p2p_alpha, p2p_beta = fit_link({s: v[0] for s, v in _probe(m.gloo, "p2p").items()}, 1)
    link = Link("ring", ar_beta, ar_alpha)  # the fit, as the cost model prices it
    ring = {s: ring_time("all_reduce", s, 2, link) for s in BLOCKING_SIZES}
    sync, skew = collective_sync(m.gloo, ring)
    step_skew = step_sync(m.gloo, ring)
    return {
        "nvlink_gbps": round(ar_beta / 1e9, 4),
        "nvlink_latency_us": round(ar_alpha * 1e6, 2),
        "network_gbps": round(ar_beta / 1e9 * m.ranks_per_node, 4),
        "network_latency_us": round(ar_alpha * 1e6, 2),
        "p2p_gbps": round(p2p_beta / 1e9, 4),
        "p2p_latency_us": round(p2p_alpha * 1e6, 2),
        "collective_sync_us": round(sync * 1e6, 1),
        "collective_skew": round(skew, 4),
        "step_skew": round(step_skew, 4),
    }


def profile_values(m: Measured, name: str) -> dict:
    """The profile's keys (cluster.Cluster) from the measurements."""
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    machine = {
        "name": name,
        "gpu": f"{cpu_name()}, {os.cpu_count()} cores, {m.threads} torch thread(s) per rank",
        "hbm_gib": round(ram_gib / m.ranks_per_node, 2),
        "nvlink_efficiency": 1.0,
        "gpus_per_node": m.ranks_per_node,
        "network_efficiency": 1.0,
        "device": "cpu",
        "threads": m.threads,
    }
    return {**machine, **compute_values(m), **link_values(m)}


def probe_around(
    cluster: Cluster, ranks: int, threads: int, run: Callable[[], T], rounds: int = 1
) -> tuple[Cluster, T]:
    """`run()` bracketed by the probes, and `cluster` with what they measured: gloo's first
    (two ranks or more, GLOO_ROUNDS rounds, ~15 s), then one quick round of the
    compute probes (in `ranks` processes of `threads` threads at once, ~4 s) just before
    `run` and again just after it, pooled (probes.pool_ranks: their mean). This shared
    machine's speed moves by tens of percent within minutes (other tenants' load on the host),
    and the run's compute sits between the two compute probes."""
    gloo = probe_gloo(threads, max(rounds, GLOO_ROUNDS)) if ranks > 1 else {}
    before = concurrent_compute_probes(threads, rounds, ranks)
    result = run()
    after = concurrent_compute_probes(threads, rounds, ranks)
    return _repriced(cluster, ranks, threads, [before, after], gloo), result


def _repriced(cluster: Cluster, ranks: int, threads: int, computes: list, gloo: dict) -> Cluster:
    """`cluster` with the compute fields of the pooled `computes` and, given gloo's probes,
    the link fields."""
    m = Measured(threads, ranks, *pool_ranks(computes), gloo=gloo)
    return replace(cluster, **compute_values(m), **(link_values(m) if gloo else {}))


def _probe(gloo: dict, kind: str) -> dict:
    """{bytes: times} of one gloo probe (keys (kind, bytes); the blocking probe's carry more)."""
    return {key[1]: v for key, v in gloo.items() if key[0] == kind and len(key) == 2}


def collective_sync(gloo: dict, ring: dict[int, float]) -> tuple[float, float]:
    """(seconds, fraction): what a blocking all-reduce costs in training beyond the aligned
    probe's, as a fixed part plus a fraction of the compute since the previous collective.
    Per message size, the blocking probe's excess over the all-reduce as the profile prices it
    (`ring`: the α/β fit over every size, not that size's own aligned median, which one burst
    of other work moved from 0.5 to 3 ms and with it the excess to 0) against the GEMM
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
        if s not in ring or not all(k in gloo for k in keys):
            continue
        excess = [gloo[k][0] - ring[s] for k in keys]
        r, c = _line(times, excess)
        slope.append(r)
        fixed.append(c)
    if not slope:
        return 0.0, 0.0
    return max(statistics.median(fixed), 0.0), max(statistics.median(slope), 0.0)


def step_sync(gloo: dict, ring: dict[int, float]) -> float:
    """The fraction of the compute between two step-scale synchronisations (a dp step's
    gradient reduction, a pipeline's messages) that a rank waits at the second: the step
    probe's mean wait less the all-reduce as priced (`ring`), over its mean compute (means
    over the samples), not below 0; 0 without the probe. Measured at ~0.1 s, not read off the
    tp line: the line is fitted over 0.5-16 ms, and the waits do not grow on with the compute."""
    if ("step_wait",) not in gloo or BLOCKING_SIZES[0] not in ring:
        return 0.0
    wait = gloo["step_wait",][0] - ring[BLOCKING_SIZES[0]]
    return max(wait / gloo["step_compute",][0], 0.0)


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


def _spread(
    v: tuple[float, float, float],
    scale: float,
    unit: str,
    invert: bool = False,
    centre: str = "median",
) -> str:
    med, lo, hi = (scale / x for x in v) if invert else (x * scale for x in v)
    lo, hi = sorted((lo, hi))
    return f"{centre} {med:.4g} {unit}, range {lo:.4g}-{hi:.4g}"


def render(values: dict, m: Measured, command: str) -> str:
    """The profile as commented YAML (every value with how it was measured)."""
    ar = _probe(m.gloo, "all_reduce")
    sizes = min(ar), max(ar)  # the smallest and largest gloo message, in bytes
    lines = [
        *_machine_lines(values, m, command),
        *_compute_lines(values, m),
        *_ring_lines(values, ar, sizes),
        "device: cpu  # attention as config/memory.attention_path picks it on CPU",
        f"threads: {values['threads']}",
        *_efficiency_lines(values, m),
        *_p2p_lines(values, m, sizes),
        *_fixed_time_lines(values, m),
        *_kernel_lines(values, m),
        *_sync_lines(values, m),
    ]
    return "\n".join(lines) + "\n"


def _machine_lines(values: dict, m: Measured, command: str) -> list[str]:
    """The YAML's head: what was measured, when and how, and the profile's name and GPU."""
    return [
        f"# This machine's CPU as a 'cluster' of one node: {values['gpus_per_node']} rank(s) of "
        f"{m.threads} torch thread(s), gloo over loopback.",
        f"# Measured by `{command}` (megapipe/perf/calibrate.py) on "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores shared with other work: medians over rounds, spreads below.",
        "# other work on the machine before each probe group (cores): "
        + (", ".join(f"{x:.2f}" for x in m.notes.get("other_work_cores", [])) or "not measured"),
        f"name: {values['name']}",
        f"gpu: {values['gpu']}",
    ]


def _compute_lines(values: dict, m: Measured) -> list[str]:
    """The YAML lines of the peak (the GEMM sweep's best), the memory and the copy bandwidth."""
    peak = values["peak_tflops"] * 1e12
    best = max(m.gemm, key=lambda s: gemm_features(*s)[0] / m.gemm[s][0])
    return [
        f"# float32 torch.mm, best of the sweep: {best} at {peak / 1e9:.1f} GFLOP/s "
        f"({_spread(m.gemm[best], gemm_features(*best)[0] / 1e9, 'GFLOP/s', True)})",
        f"peak_tflops: {values['peak_tflops']}",
        f"hbm_gib: {values['hbm_gib']}  # RAM / ranks per node",
        f"# {COPY_BYTES >> 20} MiB float32 copy, read + write: "
        f"{_spread(m.bandwidth, 1e-9, 'GB/s')}",
        f"hbm_gbps: {values['hbm_gbps']}",
    ]


def _ring_lines(values: dict, ar: dict, sizes: tuple[int, int]) -> list[str]:
    """The YAML lines of the ring link (the gloo all-reduce `ar`) and the network's copy of it."""
    small, big = sizes
    return [
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
    ]


def _efficiency_lines(values: dict, m: Measured) -> list[str]:
    """The YAML lines of the GEMM curve's fit (e_max, κ) and the kernels' μ."""
    worst = max(abs(_gemm_model(values, s) / m.gemm[s][0] - 1) for s in m.gemm)
    return [
        f"# e_max and κ: least squares on relative time over the {len(m.gemm)} GEMM shapes "
        f"(worst shape off by {worst:.0%})",
        f"gemm_efficiency: {values['gemm_efficiency']}",
        f"gemm_knee: {values['gemm_knee']}",
        "# μ: "
        + ", ".join(f"{k} {b / t / 1e9:.1f}" for k, (t, b) in m.kernels.items())
        + " GB/s, total bytes over total time, over the copy's",
        f"memory_efficiency: {values['memory_efficiency']}",
    ]


def _p2p_lines(values: dict, m: Measured, sizes: tuple[int, int]) -> list[str]:
    """The YAML lines of the p2p link (gloo's ping-pong at the `sizes` shown)."""
    small, big = sizes
    p2p = _probe(m.gloo, "p2p")
    return [
        "# gloo batch_isend_irecv ping-pong (pipeline/p2p.py's calls), one way, fitted to "
        f"α + S/β: {small} B {_spread(p2p[small], 1e6, 'us')}; {big} B "
        f"{_spread(p2p[big], 1e3, 'ms')}",
        f"p2p_gbps: {values['p2p_gbps']}",
        f"p2p_latency_us: {values['p2p_latency_us']}",
    ]


def _fixed_time_lines(values: dict, m: Measured) -> list[str]:
    """The YAML lines of the GPT's fixed times: per layer and for the ends."""
    return [
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
    ]


def _kernel_lines(values: dict, m: Measured) -> list[str]:
    """The YAML lines of the GeLU kernels' times and attention's efficiency."""
    return [
        f"# tanh GeLU over {KERNEL_ELEMENTS} float32 elements, forward and aten.gelu_backward, "
        "ns per element (compute-bound here: priced per element, not by bytes)",
        f"gelu_forward_ns: {values['gelu_forward_ns']}",
        f"gelu_backward_ns: {values['gelu_backward_ns']}",
        "# causal SDPA forward + backward (b, heads, s, hd) "
        + ", ".join(f"{sh} {t * 1e3:.2f} ms" for sh, t in m.attention.items())
        + ": the model's time for them (costs.py, fused) over the measured",
        f"attention_efficiency: {values['attention_efficiency']}",
    ]


def _sync_lines(values: dict, m: Measured) -> list[str]:
    """The YAML lines of the waits at a blocking collective and at a step's synchronisation."""
    return [
        "# an n×n GEMM then a blocking all-reduce, against the GEMMs alone: "
        + ", ".join(
            f"n {n} ({m.gloo['gemm', n][0] * 1e3:.2f} ms), {s} B "
            + _spread(m.gloo["blocking", s, n], 1e6, "us", centre="mean")
            for n in SKEW_GEMMS
            for s in BLOCKING_SIZES
            if ("blocking", s, n) in m.gloo
        )
        + "; less the all-reduce as priced (the ring above), a line in the GEMM's time:",
        "# its intercept (us) and its slope (the fraction of the compute between collectives a"
        " rank waits, skew)",
        f"collective_sync_us: {values['collective_sync_us']}",
        f"collective_skew: {values['collective_skew']}",
        _step_comment(m.gloo),
        f"step_skew: {values['step_skew']}",
    ]


def _step_comment(gloo: dict) -> str:
    if ("step_wait",) not in gloo:
        return "# no step-scale probe"
    return (
        f"# {STEP_GEMMS} GEMMs of n {STEP_N} (mean {gloo['step_compute',][0] * 1e3:.1f} ms)"
        f" then a blocking all-reduce, {STEP_SYNCS} times a round: the pair's wait in it, "
        + _spread(gloo["step_wait",], 1e3, "ms", centre="mean")
        + ", less the all-reduce as priced (the ring above), over the compute before it"
    )


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
