"""Cluster profiles: one GPU kind in nodes of G GPUs, read from the data files in clusters/.

A profile holds what the performance model prices work with (docs/architecture.md, "Layers",
perf): the GPU's peak dense bf16 TFLOP/s, HBM capacity and bandwidth, the per-GPU NVLink /
NVSwitch bandwidth inside a node, the node's network bandwidth to other nodes (the sum over its
NICs) and a latency per hop of each. Every number is cited in its YAML file. `efficiency` fields
are the fraction of the signalling rate NCCL's rings reach at large messages (nccl-tests), taken
from published measurements, not fitted here.
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
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


_FIELDS = {f.name: f.type for f in dataclasses.fields(Cluster)}


def load_cluster(name: str, gpus_per_node: int | None = None) -> Cluster:
    """The profile `name` (a100, h100, h200, or a path to a YAML file of the same keys), with
    the node size overridden by `gpus_per_node` (None: the profile's)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CLUSTER_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ClusterError(f"unknown GPU {name!r}: choose one of {', '.join(cluster_names())}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    missing = sorted(set(_FIELDS) - set(raw))
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
    return cluster
