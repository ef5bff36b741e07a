"""Cluster profiles: one GPU kind in nodes of G GPUs, read from the data files in clusters/.

A profile holds what the performance model prices work with (docs/architecture.md, "Layers",
perf): the GPU's peak dense bf16 TFLOP/s, HBM capacity and bandwidth, the per-GPU NVLink /
NVSwitch bandwidth inside a node, the node's network bandwidth to other nodes (the sum over its
NICs) and a latency per hop of each. Every number is cited in its YAML file. `efficiency` fields
are the fraction of the signalling rate NCCL's rings reach at large messages (nccl-tests), taken
from published measurements, not fitted here.

The fields after `network_latency_us` are optional, for profiles measured on the machine at hand
rather than read from datasheets (perf/calibrate.py writes them for this machine's CPU, each
commented in the YAML): `device` (which attention kernel config/memory.attention_path picks:
"cuda" or "cpu"), `threads` (torch threads per rank the profile was measured with), the three
model constants measured instead of Table 1's fit (`gemm_efficiency` e_max, `gemm_knee` κ,
`memory_efficiency` μ: cost_terms.Calibration; 0 means "use the fit"), a separate point-to-point
link (`p2p_gbps`, `p2p_latency_us`: gloo's send/receive is not its all-reduce; 0: the intra-node
link), and the framework's fixed seconds per block and action (`layer_forward_us`,
`layer_backward_us` per transformer layer, `ends_forward_us`, `ends_backward_us` for the
embedding and head together: the Python and op-dispatch time a block costs whatever its size,
negligible on a GPU whose kernels run asynchronously, not on a CPU), GPT-2's tanh GeLU per
element (`gelu_forward_ns`, `gelu_backward_ns`: compute-bound on a CPU, so not priced by bytes)
and the fused attention kernel's fraction of the GEMM rate the model gives its FLOPs
(`attention_efficiency`; 0: 1), and what a blocking collective costs in training beyond the
aligned probe (`collective_sync_us`: the waiting one's wake-up, added to each tp collective,
and `collective_skew`: the ranks' arrival skew as a fraction of the compute since the previous
collective, added to each F and B with a tp collective, the layers' and the ends'; and
`step_skew`: the same wait at the step-scale synchronisations of a run without tp, the dp
gradient reduction and each pipeline message, as a fraction of the compute before them,
measured at ~0.1 s apart; 0 on a GPU, where NCCL's kernels queue on the stream and the host
does not wait). The GPU profiles leave them out, so their projections are unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

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
    # optional (module docstring): measured profiles
    device: str = "cuda"
    threads: int = 0
    gemm_efficiency: float = 0.0
    gemm_knee: float = 0.0
    memory_efficiency: float = 0.0
    p2p_gbps: float = 0.0
    p2p_latency_us: float = 0.0
    layer_forward_us: float = 0.0
    layer_backward_us: float = 0.0
    ends_forward_us: float = 0.0
    ends_backward_us: float = 0.0
    gelu_forward_ns: float = 0.0
    gelu_backward_ns: float = 0.0
    attention_efficiency: float = 0.0
    collective_sync_us: float = 0.0
    collective_skew: float = 0.0
    step_skew: float = 0.0

    @property
    def measured_constants(self) -> tuple[float, float, float] | None:
        """(e_max, κ, μ) measured for this device, or None: use the calibrated fit."""
        c = (self.gemm_efficiency, self.gemm_knee, self.memory_efficiency)
        return c if all(x > 0 for x in c) else None

    @property
    def p2p(self) -> Link:
        """The point-to-point link inside a node: its own measurement, else the ring link's."""
        if self.p2p_gbps > 0:
            return Link("p2p", self.p2p_gbps * 1e9, self.p2p_latency_us * 1e-6)
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
    """The profiles measured on a machine by perf/calibrate.py (clusters/cpu*.yaml)."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("cpu*.yaml"))


_FIELDS = {f.name: f.type for f in dataclasses.fields(Cluster)}
_REQUIRED = {f.name for f in dataclasses.fields(Cluster) if f.default is dataclasses.MISSING}


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
    unknown = sorted(set(raw) - set(_FIELDS))
    if missing or unknown:
        raise ClusterError(f"{path}: missing keys {missing}, unknown keys {unknown}")
    values = {k: (str(v) if _FIELDS[k] == "str" else v) for k, v in raw.items()}
    if gpus_per_node is not None:
        values["gpus_per_node"] = gpus_per_node
    cluster = Cluster(**values)
    if cluster.gpus_per_node < 1:
        raise ClusterError(f"--gpus-per-node must be >= 1, got {cluster.gpus_per_node}")
    for key in ("peak_tflops", "hbm_gib", "hbm_gbps", "nvlink_gbps", "network_gbps"):
        if not getattr(cluster, key) > 0:
            raise ClusterError(f"{path}: {key} must be > 0")
    if cluster.device not in ("cuda", "cpu"):
        raise ClusterError(f"{path}: device must be cuda or cpu, got {cluster.device!r}")
    return cluster
