"""The `perf` layer, above `train`: the performance model (docs/architecture.md, "Layers").

`project(cfg, cluster)` projects one training step of a resolved config onto a cluster profile
(`load_cluster("a100" | "h100" | "h200")`): time, model and hardware TFLOP/s per GPU, MFU,
bubble fraction, a breakdown and peak memory. No process groups: pure arithmetic over the
config, the schedule's action lists and the memory plan.
"""

from megapipe.perf.cluster import Cluster, ClusterError, cluster_names, load_cluster
from megapipe.perf.cost_terms import CALIBRATION, Calibration
from megapipe.perf.model import Projection, project
from megapipe.perf.software import MEGAPIPE, MEGATRON_2021, RUNTIMES, Runtime

__all__ = [
    "CALIBRATION", "Calibration", "Cluster", "ClusterError", "MEGAPIPE", "MEGATRON_2021",
    "Projection", "RUNTIMES", "Runtime", "cluster_names", "load_cluster", "project",
]  # fmt: skip
