"""This machine's CPU profile: the probes (probes.py, gloo_probes.py) run, fitted into the terms
of a cluster profile (megapipe/perf/cluster.py, its host terms megapipe/perf/host.py) and written
as commented YAML (docs/architecture.md, "benchmarks").

    python -m benchmarks.bench calibrate [--out megapipe/perf/clusters/cpu.yaml] [--threads 1]
        [--ranks-per-node 2] [--rounds 5]

A CPU "node" is the machine: `ranks_per_node` training processes of `threads` torch threads
each share its cores and talk gloo over loopback (torchrun sets OMP_NUM_THREADS=1 for its
workers; a plain `python train.py` uses every core). `measure` runs the compute probes with
`threads` torch threads in each of `ranks_per_node` processes at the same time (the ranks of a
step share the cores' caches and memory bandwidth; a one-rank profile, `cpu_solo.yaml`, prices
the one-process run), then gloo between two processes. probe_fits.py fits what they
measured into the profile's fields (its docstring gives each fit).

The node never talks to another node, so the network fields repeat the loopback ring's.
`probe_around` measures the fields the probes decide again around a timed run (the local
truth) on a machine whose speed drifts: the compute probes one quick round, gloo's at least
GLOO_ROUNDS.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from benchmarks.gloo_probes import (
    BLOCKING_SIZES,
    SKEW_GEMMS,
    STEP_GEMMS,
    STEP_N,
    STEP_SYNCS,
    probe_gloo,
)
from benchmarks.harness import Parser, UsageError, run_cli, say
from benchmarks.probe_fits import (
    Measured,
    compute_values,
    gemm_features,
    gloo_samples,
    link_values,
)
from benchmarks.probes import (
    COPY_BYTES,
    GEMM_SHAPES,
    KERNEL_ELEMENTS,
    concurrent_compute_probes,
    pool_ranks,
    wait_quiet,
)
from megapipe.perf.cluster import CLUSTER_DIR, Cluster, ClusterError, load_cluster, with_values
from megapipe.perf.cost_terms import Calibration, Device

T = TypeVar("T")

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
    once (module docstring); `settle` runs before each group (main waits there for the
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
    cluster: Cluster,
    ranks: int,
    threads: int,
    run: Callable[[], T],
    rounds: int = 1,
    links: bool = True,
) -> tuple[Cluster, T]:
    """`run()` bracketed by the probes, and `cluster` with what they measured: gloo's first
    (with `links` and two ranks or more, GLOO_ROUNDS rounds, ~15 s), then one quick round of the
    compute probes (in `ranks` processes of `threads` threads at once, ~4 s) just before
    `run` and again just after it, pooled (probes.pool_ranks: their mean). This shared
    machine's speed moves by tens of percent within minutes (other tenants' load on the host),
    and the run's compute sits between the two compute probes."""
    gloo = probe_gloo(threads, max(rounds, GLOO_ROUNDS)) if links and ranks > 1 else {}
    before = concurrent_compute_probes(threads, rounds, ranks)
    result = run()
    after = concurrent_compute_probes(threads, rounds, ranks)
    return _repriced(cluster, ranks, threads, [before, after], gloo), result


def _repriced(cluster: Cluster, ranks: int, threads: int, computes: list, gloo: dict) -> Cluster:
    """`cluster` with the compute fields of the pooled `computes` and, given gloo's probes,
    the link fields."""
    m = Measured(threads, ranks, *pool_ranks(computes), gloo=gloo)
    return with_values(cluster, {**compute_values(m), **(link_values(m) if gloo else {})})


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
    ar = gloo_samples(m.gloo, "all_reduce")
    sizes = min(ar), max(ar)  # the smallest and largest gloo message, in bytes
    lines = [
        *_machine_lines(values, m, command),
        *_compute_lines(values, m),
        *_ring_lines(values, ar, sizes),
        "device: cpu  # attention as config/memory_terms.attention_path picks it on CPU",
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
        f"# Measured by `{command}` (benchmarks/calibrate.py) on "
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
    p2p = gloo_samples(m.gloo, "p2p")
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
        f"# tanh GeLU over {KERNEL_ELEMENTS} float32 elements, forward as the model runs it "
        "(models/activations.gelu_tanh) and aten.gelu_backward, ns per element (compute-bound "
        "here: priced per element, not by bytes)",
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
    """Seconds cost_terms.Device prices a float32 GEMM at with the profile's values."""
    cal = Calibration(values["gemm_efficiency"], values["gemm_knee"], values["memory_efficiency"])
    dev = Device(values["peak_tflops"] * 1e12, values["hbm_gbps"] * 1e9, cal)
    return dev.gemm(*shape, elt=4)


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


def parse(argv: list[str]):
    c = Parser(prog="python -m benchmarks.bench calibrate",
               description="measure this machine's CPU into a profile")  # fmt: skip
    c.add_argument(
        "--out", help="default: megapipe/perf/clusters/cpu.yaml (cpu_Nt, _solo for one rank)"
    )
    c.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    c.add_argument("--ranks-per-node", type=int, default=2, help="ranks sharing the machine")
    c.add_argument("--rounds", type=int, default=5, help="rounds of every probe")
    c.add_argument("--quiet", type=float, default=0.25, help="wait for other work <= cores")
    c.add_argument("--patience", type=float, default=300.0, help="seconds to wait for it")
    args, rest = c.parse_known_args(argv)
    if rest:
        raise UsageError(f"calibrate takes no {' '.join(rest)}")
    if args.threads < 1 or args.ranks_per_node < 1 or args.rounds < 1:
        raise UsageError("--threads, --ranks-per-node and --rounds must be at least 1")
    return args


def calibrate(argv: list[str]) -> int:
    """Measure, fit, write the profile and print its values."""
    args = parse(argv)
    default = default_profile(args.threads, args.ranks_per_node)
    out = args.out or str(profile_path(default))
    name = Path(out).stem
    if not name.startswith("cpu"):
        raise UsageError(f"--out {out}: a measured profile's file name starts with 'cpu'")
    measured = measure(
        args.threads, args.ranks_per_node, args.rounds, say,
        settle=lambda: wait_quiet(args.quiet, args.patience, say),
    )  # fmt: skip
    values = profile_values(measured, name)
    write_profile(out, values, measured, "python -m benchmarks.bench calibrate " + " ".join(argv))
    print(f"wrote {out}")
    for key, value in values.items():
        print(f"  {key}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(calibrate, argv, (ClusterError,))


if __name__ == "__main__":
    sys.exit(main())
