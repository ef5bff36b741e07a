"""The mixture-of-experts figures of a step's metrics.jsonl record (docs/moe.md): `moe_load`
(rows routed to each expert, per MoE layer, before capacity drops), `moe_dropped` (rows over
capacity, all layers), `moe_aux` and `moe_z` (the balance and z losses before their coefs,
averaged over the global batch as the LM loss is, and over the MoE layers), and `moe_max_load`
(the load imbalance, `max_load`).

Each MoE layer sums its figures over the step's microbatches (models/moe.StatsSink, filled in
backward, once per microbatch even under recompute); here they are summed over the mesh: dp
ranks hold other sequences, cp (and tp under sequence parallelism) ranks other tokens of them,
pp ranks other layers; tp ranks without sequence parallelism hold copies, counted once.
"""

from __future__ import annotations

import re

import torch

from megapipe.config import Config
from megapipe.config.flops import is_moe_layer
from megapipe.distributed import collectives as C
from megapipe.models.moe import MoE

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")


def moe_layers(model: torch.nn.Module) -> dict[int, MoE]:
    """This rank's MoE layers by layer index (a GPT, or a pp rank's chunks)."""
    out = {}
    for name, module in model.named_modules():
        found = _LAYER.search(name)
        if found and isinstance(module, MoE):
            out[int(found.group(1))] = module
    return out


def moe_record(cfg: Config, model: torch.nn.Module, mesh=None) -> dict:
    """The step's MoE figures, the same on every rank (a collective over the world when
    `mesh` is given: every rank calls it); {} for a dense model. Takes the layers' sums."""
    m = cfg.model
    if m.n_experts == 0:
        return {}
    indices = [i for i in range(m.n_layers) if is_moe_layer(m, i)]
    table = torch.zeros(len(indices), m.n_experts + 3, dtype=torch.float64)
    for i, layer in moe_layers(model).items():
        table[indices.index(i)] += layer.stats.take().cpu()
    if mesh is not None:
        C.all_reduce(table, mesh.world_group)
        if not cfg.parallel.sequence_parallel:
            table /= mesh.size("tp")  # tp copies of the same tokens
    tokens = cfg.derived.tokens_per_step
    e = m.n_experts
    return {
        "moe_load": table[:, :e].round().long().tolist(),
        "moe_dropped": int(table[:, e].sum().round()),
        "moe_aux": float(table[:, e + 1].sum() / tokens / len(indices)),
        "moe_z": float(table[:, e + 2].sum() / tokens / len(indices)),
        "moe_max_load": max_load(table[:, :e]),
    }


def max_load(load: torch.Tensor) -> float:
    """max over layers and experts of load / the layer's mean load, from `load` (layers, E):
    each expert's rows of the global batch. 1 is perfect balance; Wang et al. 2024
    ("Auxiliary-Loss-Free Load Balancing", arXiv 2408.15664 §4.1) log MaxVio = this − 1."""
    mean = load.mean(-1, keepdim=True).clamp_min(1e-30)  # no rows (no backward ran): 0
    return float((load / mean).max())
