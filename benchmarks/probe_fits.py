"""The measurements of this machine's CPU (probes.py, gloo_probes.py), `Measured`, fitted into the
terms of a cluster profile (megapipe/perf/cluster.py, host.py): arithmetic only; calibrate.py
runs the probes and writes the profile (docs/architecture.md, "benchmarks"). The fits:

  GEMMs       cost_terms.Device prices a GEMM of F FLOPs moving Y bytes (operands and output) at
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
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from benchmarks.gloo_probes import BLOCKING_SIZES, SKEW_GEMMS
from megapipe.perf.cluster import Link
from megapipe.perf.comm import ring_time
from megapipe.perf.cost_terms import Calibration, Device


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
    ar = {s: v[0] for s, v in gloo_samples(m.gloo, "all_reduce").items()}  # the medians
    p2p = {s: v[0] for s, v in gloo_samples(m.gloo, "p2p").items()}
    ar_alpha, ar_beta = fit_link(ar, 2)
    p2p_alpha, p2p_beta = fit_link(p2p, 1)
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


def gloo_samples(gloo: dict, kind: str) -> dict:
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
