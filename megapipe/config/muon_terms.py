"""Muon in the one memory model and the performance model (train.optimizer=muon: train/muon.py,
train/muon_zero.py): its optimizer state and its Newton-Schulz FLOPs, per rank.

State. Muon keeps one float32 momentum buffer per hidden matrix (4 B per element) where AdamW
keeps two float32 moments (8 B); the other parameters (embeddings, head, norms, biases, stacked
experts) keep AdamW's, and bf16 weights add every parameter's float32 main param (4 B), as in
config/states.py. Under ZeRO (d > 1 replicas) AdamW's moments and the main params are 1/d, but
each Muon matrix's buffer is whole on the one rank that owns it (train/muon_zero.py deals the
matrices by `deal`); the plan reports the worst rank of the group: the most elements any rank
owns.

FLOPs. Newton-Schulz (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
networks", Keller Jordan's post; torch.optim._muon._zeropower_via_newtonschulz): each of the
train.muon_ns_steps iterations (5 by default) on an m × n matrix, m <= n (the code transposes a
tall one), runs three matmuls of the matrix's shape: A = X·Xᵀ (2m²n FLOPs), A·A in
B = bA + cA² (2m³) and B·X (2m²n). Each logical matrix is orthogonalised whole (a fused
q | k | v as three), on every tp rank (train/muon.py gathers it over tp), by its owner under
ZeRO (the worst rank's owned matrices).
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.config.schema import Config
from megapipe.config.states import FLOAT32, _bytes, optimizer_bytes, state_layout

MOMENTUM_BYTES = FLOAT32  # Muon's one float32 momentum buffer per element

# one Muon parameter on a rank: (its local elements, the (rows, cols) of each logical matrix)
MuonMatrix = tuple[int, tuple[tuple[int, int], ...]]


def deal(sizes: Sequence[int], ranks: int) -> list[int]:
    """The owner of each of the matrices of `sizes` elements among `ranks`: largest first to the
    least-loaded rank (Graham's LPT rule; ties: the earlier matrix, the lower rank), so every
    rank computes the same deal from the layout alone."""
    loads, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i], loads[owner] = owner, loads[owner] + sizes[i]
    return owners


def most_owned(sizes: Sequence[int], ranks: int) -> int:
    """The most elements any of `ranks` owns under `deal` (all of them on one rank)."""
    loads = [0] * ranks
    for size, owner in zip(sizes, deal(sizes, ranks)):
        loads[owner] += size
    return max(loads, default=0)


def worst_owned(cfg: Config, matrices: Sequence[MuonMatrix]) -> list[MuonMatrix]:
    """The Muon parameters the worst rank of the shard group steps (the most elements under
    `deal`): all of them without sharding (zero=0, or no replicas)."""
    ranks = owner_ranks(cfg)
    if ranks == 1:
        return list(matrices)
    owners = deal([n for n, _ in matrices], ranks)
    loads = [sum(m[0] for m, o in zip(matrices, owners) if o == r) for r in range(ranks)]
    worst = max(range(ranks), key=lambda r: (loads[r], -r))
    return [m for m, o in zip(matrices, owners) if o == worst]


def muon_optimizer_bytes(
    n_params: float, matrices: Sequence[MuonMatrix], cfg: Config, experts: float = 0
) -> float:
    """The optimizer state of a rank holding `n_params` (`experts` of them routed experts'),
    of which `matrices` are Muon's (module docstring): AdamW's for the rest, each Muon
    element's main param (bf16 weights) sharded as AdamW's, the worst owner's momentum."""
    muon = sum(n for n, _ in matrices)
    s = state_layout(cfg)
    rest = optimizer_bytes(n_params - muon, cfg, experts)
    main = _bytes(muon, s.optimizer - 2 * FLOAT32, s.optimizer_shards)  # bf16: main params
    return rest + main + MOMENTUM_BYTES * most_owned([n for n, _ in matrices], owner_ranks(cfg))


def optimizer_lower_bound(n_params: float, cfg: Config, experts: float = 0) -> float:
    """A floor under the optimizer bytes of a rank holding `n_params` knowing only their count
    (the planner's bounds, perf/bounds.py): AdamW's state less half its moments under Muon,
    as if every parameter were Muon's with perfectly balanced owners (4 B of 8 per element,
    averaged over the shards); AdamW's under AdamW."""
    whole = optimizer_bytes(n_params, cfg, experts)
    if not is_muon(cfg):
        return whole
    return whole - _bytes(n_params, MOMENTUM_BYTES, state_layout(cfg).optimizer_shards)


def owner_ranks(cfg: Config) -> int:
    """The ranks that own Muon matrices: the shard group under ZeRO, else 1 (every rank steps
    each matrix)."""
    s = state_layout(cfg)
    return s.d if s.optimizer_shards > 1 else 1


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` Newton-Schulz iterations on a rows × cols matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def muon_step_flops(matrices: Sequence[MuonMatrix], cfg: Config) -> float:
    """Newton-Schulz FLOPs of one optimizer step on the worst rank holding `matrices`."""
    return sum(2.0 * m * n * k * count for m, n, k, count in ns_matmuls(matrices, cfg))


def ns_matmuls(matrices: Sequence[MuonMatrix], cfg: Config) -> list[tuple[int, int, int, int]]:
    """The worst rank's Newton-Schulz GEMMs of a step as (m, n, k, count), (m×k)·(k×n) each: per
    logical matrix (m <= n rows) and iteration X·Xᵀ, A·A and B·X (module docstring)."""
    steps, out = cfg.train.muon_ns_steps, []
    for _, shapes in worst_owned(cfg, matrices):
        for r, c in shapes:
            m, n = min(r, c), max(r, c)
            out += [(m, m, n, steps), (m, m, m, steps), (m, n, m, steps)]
    return out


def is_muon(cfg: Config) -> bool:
    return cfg.train.optimizer == "muon"
