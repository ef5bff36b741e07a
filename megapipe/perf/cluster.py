"""Cluster profiles: one GPU kind in nodes of G GPUs, read from the data files in clusters/.

A profile holds what the performance model prices work with (docs/architecture.md, "Layers",
perf): the GPU's peak dense bf16 TFLOP/s, HBM capacity and bandwidth, the per-GPU NVLink /
NVSwitch bandwidth inside a node, the node's network bandwidth to other nodes (the sum over its
NICs) and a latency per hop of each. Every number is cited in its YAML file. `efficiency` fields
are the fraction of the signalling rate NCCL's rings reach at large messages (nccl-tests), taken
from published measurements, not fitted here.

A profile may also state the device's own achievable rates, the constants of the cost model
(cost_terms.Calibration) it otherwise takes from Table 1's fit on A100s: `gemm_efficiency`
(e_max), `gemm_knee` (κ), `memory_efficiency` (μ), and `attention_efficiency`, the fused
attention kernel's rate as a fraction of the GEMM rate the model gives its FLOPs
(`cudnn_attention_efficiency` for cuDNN's kernel, which a runtime with attention_kernel "cudnn"
runs). `compute_capability` ("9.0") names the GPU's generation: which attention kernel
megapipe's code runs there (runtime.resolved_for). Each constant is 0 (absent) where the
profile has no measurement of it: the fit's, or 1 for
attention. The measured profiles (clusters/cpu*.yaml, benchmarks/calibrate.py) measure them
on the machine; the H100 and H200 profiles read them from published H100 kernel benchmarks,
each cited in the YAML.

A profile measured on the machine at hand (clusters/cpu*.yaml) also has its host's terms, in
the same flat YAML: the loader gathers those keys into one `host.HostOverheads`
(`Cluster.host`; None for the GPU profiles, so their projections price no host terms).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from megapipe.perf.cost_terms import Calibration
from megapipe.perf.host import HostOverheads

CLUSTER_DIR = Path(__file__).resolve().parent / "clusters"


class ClusterError(ValueError):
    """A bad cluster name or profile: the message is one line naming the fix."""


@dataclass(frozen=True)
class Link:
    """One kind of link a ring crosses: achieved bandwidth per GPU (bytes/s) and per-step
    latency (s)."""

    name: str  # "nvlink" | "network"
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: str
    peak_tflops: float  # dense bf16/fp16 tensor-core TFLOP/s
    hbm_gib: float  # device memory, GiB
    hbm_gbps: float  # HBM bandwidth, GB/s
    nvlink_gbps: float  # per GPU, per direction, GB/s
    nvlink_efficiency: float
    nvlink_latency_us: float
    gpus_per_node: int
    network_gbps: float  # per node (all its NICs), per direction, GB/s
    network_efficiency: float
    network_latency_us: float
    # the device's own constants (module docstring); 0: the Table 1 fit's (attention: 1)
    gemm_efficiency: float = 0.0
    gemm_knee: float = 0.0
    memory_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    cudnn_attention_efficiency: float = 0.0
    # CUDA compute capability "major.minor" ("": not stated, or a CPU): the attention kernel
    # megapipe's code runs on the GPU (parallel/context/kernel_choice.attention_kernel_for)
    compute_capability: str = ""
    # dense FP8 tensor-core TFLOP/s (train.fp8's GEMMs, perf/fp8_costs.py); 0: none (A100)
    fp8_tflops: float = 0.0
    host: HostOverheads | None = None  # a measured profile's host terms (module docstring)

    @property
    def device(self) -> str:
        """The kernels the memory plan and the attention path assume: "cuda" or "cpu"."""
        return self.host.device if self.host else "cuda"

    @property
    def capability(self) -> tuple[int, int] | None:
        """(major, minor) of compute_capability, None where the profile states none."""
        if not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)

    def calibration(self, fit: Calibration) -> Calibration:
        """The cost model's constants on this device: each one the profile states, else the
        fit's (Table 1's on A100s, unless a refit is passed)."""
        return Calibration(
            gemm=self.gemm_efficiency or fit.gemm,
            knee=self.gemm_knee or fit.knee,
            memory=self.memory_efficiency or fit.memory,
        )

    def attention_factor(self, kernel: str) -> float:
        """The fused attention kernel's rate over the GEMM rate the model gives its FLOPs:
        cuDNN's where asked for and stated, else the profile's flash kernel's, else 1."""
        if kernel == "cudnn" and self.cudnn_attention_efficiency > 0:
            return self.cudnn_attention_efficiency
        return self.attention_efficiency or 1.0

    @property
    def p2p(self) -> Link:
        """The point-to-point link inside a node: its own measurement, else the ring link's."""
        h = self.host
        if h and h.p2p_gbps > 0:
            return Link("p2p", h.p2p_gbps * 1e9, h.p2p_latency_us * 1e-6)
        return self.nvlink

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bandwidth(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30

    @property
    def nvlink(self) -> Link:
        """The intra-node link of one GPU."""
        return Link(
            "nvlink", self.nvlink_gbps * 1e9 * self.nvlink_efficiency, self.nvlink_latency_us * 1e-6
        )

    def network(self, share: int = 1) -> Link:
        """The inter-node link of `share` GPUs of a node together: the node's NICs are shared
        by all its GPUs, each owning 1/G of them (a DGX has one NIC per GPU)."""
        per_gpu = self.network_gbps * 1e9 * self.network_efficiency / self.gpus_per_node
        return Link("network", per_gpu * share, self.network_latency_us * 1e-6)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node


def cluster_names() -> list[str]:
    """The datasheet (GPU) profiles."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml") if not p.stem.startswith("cpu"))


def measured_names() -> list[str]:
    """The profiles measured on a machine by benchmarks/calibrate.py (clusters/cpu*.yaml)."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("cpu*.yaml"))


_FIELDS = {f.name: f.type for f in dataclasses.fields(Cluster) if f.name != "host"}
_HOST_FIELDS = {f.name: f.type for f in dataclasses.fields(HostOverheads)}
_REQUIRED = {f.name for f in dataclasses.fields(Cluster) if f.default is dataclasses.MISSING}
_CONSTANTS = ("gemm_efficiency", "gemm_knee", "memory_efficiency", "attention_efficiency",
              "cudnn_attention_efficiency", "fp8_tflops")  # fmt: skip


def with_values(cluster: Cluster, values: dict) -> Cluster:
    """`cluster` with the profile keys in `values` replaced, each where it lives: a host key
    in its HostOverheads (made if the profile had none), any other on the Cluster."""
    host = {k: v for k, v in values.items() if k in _HOST_FIELDS}
    rest = {k: v for k, v in values.items() if k not in _HOST_FIELDS}
    if host:
        rest["host"] = dataclasses.replace(cluster.host or HostOverheads(), **host)
    return dataclasses.replace(cluster, **rest)


def load_cluster(name: str, gpus_per_node: int | None = None) -> Cluster:
    """The profile `name` (a100, h100, h200, or a path to a YAML file of the same keys), with
    the node size overridden by `gpus_per_node` (None: the profile's)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CLUSTER_DIR / f"{name}.yaml"
    if not path.is_file():
        measured = measured_names()
        also = f", or a measured profile: {', '.join(measured)}" if measured else ""
        names = ", ".join(cluster_names())
        raise ClusterError(f"unknown GPU {name!r}: choose one of {names}{also}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    missing = sorted(_REQUIRED - set(raw))
    unknown = sorted(set(raw) - set(_FIELDS) - set(_HOST_FIELDS))
    if missing or unknown:
        raise ClusterError(f"{path}: missing keys {missing}, unknown keys {unknown}")
    kinds = _FIELDS | _HOST_FIELDS
    values = {k: (str(v) if kinds[k] == "str" else v) for k, v in raw.items()}
    if gpus_per_node is not None:
        values["gpus_per_node"] = gpus_per_node
    host = {k: values.pop(k) for k in list(values) if k in _HOST_FIELDS}
    cluster = Cluster(**values, host=HostOverheads(**host) if host else None)
    if cluster.gpus_per_node < 1:
        raise ClusterError(f"--gpus-per-node must be >= 1, got {cluster.gpus_per_node}")
    for key in ("peak_tflops", "hbm_gib", "hbm_gbps", "nvlink_gbps", "network_gbps"):
        if not getattr(cluster, key) > 0:
            raise ClusterError(f"{path}: {key} must be > 0")
    for key in _CONSTANTS:
        if getattr(cluster, key) < 0:
            raise ClusterError(f"{path}: {key} must be >= 0 (0 or absent: not measured)")
    cap = cluster.compute_capability
    if cap and not re.fullmatch(r"\d+\.\d+", cap):
        raise ClusterError(f'{path}: compute_capability must read like "9.0", got {cap!r}')
    if cluster.device not in ("cuda", "cpu"):
        raise ClusterError(f"{path}: device must be cuda or cpu, got {cluster.device!r}")
    return cluster
