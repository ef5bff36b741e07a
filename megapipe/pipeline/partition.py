"""Pipeline partitioning: model blocks -> global stages -> (rank, chunk).

A GPT of L layers is L+2 blocks (models/gpt.py): 0 the embedding (E), 1..L the transformer
layers (t), L+1 the final norm + LM head + loss (L). A partition is one contiguous, non-empty
block range per global stage, stages 0..pp·vpp−1 in pipeline order; `Placement` (actions.py)
says which (rank, local chunk) holds each stage. `parallel.balance` picks the split:

  uniform  layers spread evenly, earlier stages take the extra layer; E on the first stage,
           the head on the last.
  llama3   E and the head each count as one layer and the L+2 blocks are spread evenly, the
           remainder going to middle stages: the first and last stages hold one layer fewer
           (Llama 3, Dubey et al. 2024, §3.3.2; 126 layers on 16 stages is 7 | 8 ×14 | 7).
  cost     PipeDream's dynamic programme (Narayanan et al. 2019, §3.1) minimising the slowest
           stage over per-block costs: FLOPs by default, or measured by `profile_block_costs`.
  layout   explicit, e.g. "E,t,t|t,t,t|t,t,L" or "E,t*2|t*3|t*2,L": stages split by |.

Every rank must compute the same partition: FLOP costs are deterministic, profiled ones are not
(measure once, share the list).
"""

from __future__ import annotations

import itertools
import re
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from megapipe.config import Config, ConfigError
from megapipe.metrics import matmul_params
from megapipe.pipeline.actions import Placement

STRATEGIES = ("uniform", "llama3", "cost")
_LAYOUT_CHARS = set("EtL*0123456789 ,|")
_TOKEN_RE = re.compile(r"^(E|t|L)(?:\*(\d+))?$")
_SHOW_RUN = 4  # describe/format: up to this many layers are written out t,t,t; more as t*N


def partition(
    cfg: Config, n_stages: int | None = None, costs: Sequence[float] | None = None
) -> list[range]:
    """One contiguous block range per global stage (default pp·vpp stages), covering 0..L+1."""
    p, n_layers = cfg.parallel, cfg.model.n_layers
    n_stages = p.pp * p.vpp if n_stages is None else n_stages
    _check_stage_count(n_stages, n_layers)
    if costs is not None and len(costs) != n_layers + 2:
        raise ValueError(f"costs has {len(costs)} entries; the model has {n_layers + 2} blocks")
    balance = p.balance.strip()
    if balance == "cost":
        return cost_balanced(block_costs_from_flops(cfg) if costs is None else costs, n_stages)
    if balance == "uniform":
        sizes = _uniform_sizes(n_layers, n_stages)
    elif balance == "llama3":
        sizes = _llama3_sizes(n_layers, n_stages)
    elif balance and (set(balance) <= _LAYOUT_CHARS or "," in balance or "|" in balance):
        sizes = parse_layout(balance, n_layers, n_stages)
    else:
        raise ConfigError(
            f"parallel.balance={balance!r} is not one of {', '.join(STRATEGIES)} "
            "or a layout like 'E,t,t|t,t,L'"
        )
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _check_stage_count(n_stages: int, n_layers: int) -> None:
    if n_stages < 1:
        raise ConfigError(f"parallel.pp·vpp = {n_stages} stages; need at least 1")
    if n_stages > n_layers + 2:
        raise ConfigError(
            f"parallel.pp·vpp = {n_stages} stages but the model has only "
            f"{n_layers} layers + embedding + head; lower pp/vpp or add layers"
        )


def _spread(n: int, parts: int) -> list[int]:
    """n items over `parts` as evenly as possible, the earlier parts taking the extra one."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def _uniform_sizes(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage: layers spread evenly, plus E on the first and the head on the last."""
    if n_stages == 1:
        return [n_layers + 2]
    sizes = _spread(n_layers, n_stages)
    sizes[0] += 1
    sizes[-1] += 1
    if 0 in sizes:  # fewer layers than middle stages: spread all blocks, one or more a stage
        return _spread(n_layers + 2, n_stages)
    return sizes


def _llama3_sizes(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage with E and the head counted as one layer each (Llama 3 §3.3.2).

    The remainder of (L+2)/stages goes to the middle stages, then (if one is left) to the first
    stage, never to the last: LM head + loss costs more than the embedding. With one or two
    stages there is no middle stage to take layers, so this is an even split of all blocks.
    """
    if n_stages <= 2:
        return _spread(n_layers + 2, n_stages)
    base, extra = divmod(n_layers + 2, n_stages)
    sizes = [base] * n_stages
    for stage in [*range(1, n_stages - 1), 0][:extra]:
        sizes[stage] += 1
    return sizes


def cost_balanced(costs: Sequence[float], n_stages: int) -> list[range]:
    """Split blocks into `n_stages` contiguous ranges minimising the costliest stage, exactly.

    PipeDream (Narayanan et al. 2019, §3.1) without replication: A(j, m), the slowest stage of
    the best split of blocks [0, j) into m stages, is min over i < j of max(A(i, m−1), T(i..j)).
    Its 2·C_i communication term is left out: every boundary sends the same (B, T, d) activation,
    so the term is one constant under the max. Ties on the slowest stage go to the smaller sum of
    squared stage costs (a heuristic second key: the first stays exact), which spreads the other
    stages evenly too. O(n_blocks² · n_stages).
    """
    n = len(costs)
    if not 1 <= n_stages <= n or min(costs) < 0:
        raise ValueError(f"cannot split {n} blocks into {n_stages} stages with costs {costs}")
    prefix = list(itertools.accumulate(costs, initial=0.0))
    best = [[(float("inf"), 0.0)] * (n + 1) for _ in range(n_stages + 1)]  # (slowest, Σ cost²)
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for m in range(1, n_stages + 1):
        for j in range(m, n - (n_stages - m) + 1):  # leave a block for each later stage
            for i in range(m - 1, j):
                stage = prefix[j] - prefix[i]
                value = (max(best[m - 1][i][0], stage), best[m - 1][i][1] + stage * stage)
                if value < best[m][j]:
                    best[m][j], cut[m][j] = value, i
    bounds = [n]
    for m in range(n_stages, 0, -1):
        bounds.append(cut[m][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def block_costs_from_flops(cfg: Config) -> list[float]:
    """Training FLOPs (forward + backward) per token of each block: [E, layer × L, head].

    A layer is 6·N_layer (matmuls, 2 forward + 4 backward) plus 12·d·T for attention scores and
    values (PaLM, Chowdhery et al. 2022, App. B), as in metrics.flops_per_token. The head is
    6·d·V plus softmax + cross entropy (~10 element ops per vocab entry over forward and backward)
    and its norm; the embedding is a lookup and its scatter-add backward, a few ops per channel:
    small but not zero. Element-wise ops are memory-bound, so FLOPs understate them; profile when
    the head or embedding matter.
    """
    m = cfg.model
    d, vocab = m.d_model, m.vocab_size
    layer = 6.0 * (matmul_params(cfg) - d * vocab) / m.n_layers + 12.0 * d * m.seq_len
    embed = 4.0 * d * (2 if m.arch == "gpt2" else 1)  # GPT-2 adds learned positions
    head = 6.0 * d * vocab + 10.0 * vocab + 10.0 * d
    return [embed] + [layer] * m.n_layers + [head]


def profile_block_costs(cfg: Config, n_iters: int = 3, batch: int = 1) -> list[float]:
    """Seconds of forward + backward per block for `batch` sequences on this host.

    PipeDream (§3.1) profiles T_l per layer over a short run. All transformer layers share one
    shape, so one is timed and its cost used for each: cheaper, and timing noise cannot make
    identical layers look unequal. Timings vary between runs: measure on one rank and pass the
    list to `partition(..., costs=)` on every rank.
    """
    from models.gpt import GPT  # models imports megapipe; keep this module importable alone

    m = cfg.model
    ids = torch.randint(m.vocab_size, (batch, m.seq_len))
    hidden = torch.randn(batch, m.seq_len, m.d_model, requires_grad=True)  # (B, T, d)

    def timed(block: int, forward: Callable[[torch.nn.Module], torch.Tensor]) -> float:
        module = GPT(m, blocks=range(block, block + 1), seed=cfg.train.seed)
        return _time_forward_backward(module, forward, n_iters)

    embed = timed(0, lambda mod: mod(ids))
    layer = timed(1, lambda mod: mod(hidden))
    head = timed(m.n_layers + 1, lambda mod: mod(hidden, targets=ids))
    return [embed] + [layer] * m.n_layers + [head]


def _time_forward_backward(module: torch.nn.Module, forward, n_iters: int) -> float:
    times = []
    for it in range(n_iters + 1):  # the first run warms up the allocator and kernels
        start = time.perf_counter()
        out = forward(module)
        out.backward(torch.ones_like(out))
        if it:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_layout(layout: str, n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage of an explicit layout such as 'E,t,t|t,t,t|t,t,L' (t*3 is t,t,t)."""

    def bad(problem: str) -> ConfigError:
        return ConfigError(f"parallel.balance layout {layout!r}: {problem}")

    parts = layout.split("|")
    if len(parts) != n_stages:
        raise bad(f"{len(parts)} stages but parallel.pp·vpp = {n_stages}")
    stages = [_parse_stage(part, s, bad) for s, part in enumerate(parts)]
    flat = [b for stage in stages for b in stage]
    if flat.count("E") != 1 or flat[0] != "E":
        raise bad("E (embedding) must appear once, as the first block of the first stage")
    if flat.count("L") != 1 or flat[-1] != "L":
        raise bad("L (LM head + loss) must appear once, as the last block of the last stage")
    n_t = len(flat) - 2
    if n_t != n_layers:
        what = "drops" if n_t < n_layers else "duplicates"
        raise bad(f"{what} layers: {n_t} t but model.n_layers = {n_layers}")
    return [len(stage) for stage in stages]


def _parse_stage(text: str, stage: int, bad: Callable[[str], ConfigError]) -> list[str]:
    tokens = [tok.strip() for tok in text.split(",")]
    if tokens == [""]:
        raise bad(f"stage {stage} is empty")
    blocks: list[str] = []
    for tok in tokens:
        match = _TOKEN_RE.match(tok)
        count = int(match.group(2) or 1) if match else 0
        if count < 1:
            raise bad(f"bad entry {tok!r} in stage {stage}; use E, t, t*N (N >= 1) or L")
        blocks += [match.group(1)] * count
    return blocks


def format_layout(stages: Sequence[range]) -> str:
    """The layout string of a partition (parse_layout's inverse), e.g. 'E,t,t|t*5|t,L'."""
    head = stages[-1].stop - 1
    return "|".join(_stage_text(blocks, head) for blocks in stages)


def _stage_text(blocks: range, head: int) -> str:
    n_t = sum(1 for b in blocks if 0 < b < head)
    layers = ["t"] * n_t if n_t <= _SHOW_RUN else [f"t*{n_t}"]
    return ",".join((["E"] if 0 in blocks else []) + layers + (["L"] if head in blocks else []))


def stage_of(rank: int, chunk: int, pp: int, vpp: int = 1, style: str = "loop") -> int:
    """Global stage held by local `chunk` of pp rank `rank` (see actions.Placement)."""
    return Placement(pp, vpp, style).stage(rank, chunk)


def stages_for_rank(rank: int, pp: int, vpp: int = 1, style: str = "loop") -> list[int]:
    """Global stages of pp rank `rank`, in local chunk order."""
    return [stage_of(rank, chunk, pp, vpp, style) for chunk in range(vpp)]


def rank_blocks(
    cfg: Config, rank: int, placement: Placement | None = None, costs: Sequence[float] | None = None
) -> list[range]:
    """Block ranges of each local chunk of pp rank `rank`: build chunk c with
    `GPT(cfg.model, blocks=ranges[c])`. The placement defaults to the configured schedule's."""
    placement = placement or _placement_of(cfg)
    stages = partition(cfg, placement.num_stages, costs)
    return [stages[placement.stage(rank, chunk)] for chunk in range(placement.vpp)]


def _placement_of(cfg: Config) -> Placement:
    from megapipe.pipeline.schedules import placement

    return placement(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.vpp)


def describe_partition(
    cfg: Config, costs: Sequence[float] | None = None, placement: Placement | None = None
) -> str:
    """For --dry-run: one line per stage with its (rank, chunk), blocks and share of the cost."""
    placement = placement or _placement_of(cfg)
    stages = partition(cfg, placement.num_stages, costs)
    costs = block_costs_from_flops(cfg) if costs is None else costs
    total, head = sum(costs), cfg.model.n_layers + 1
    shares = [sum(costs[b] for b in blocks) / total for blocks in stages]
    lines = [
        f"partition (parallel.balance={cfg.parallel.balance}): {len(stages)} stages, "
        f"slowest {max(shares) * len(stages):.2f}x the mean; layout {format_layout(stages)}"
    ]
    for stage, (blocks, share) in enumerate(zip(stages, shares)):
        rank, chunk = placement.locate(stage)
        text = _stage_text(blocks, head)
        lines.append(
            f"  stage {stage:>2} (rank {rank}, chunk {chunk}): {text:<14} "
            f"blocks {blocks.start:>3}-{blocks.stop - 1:<3} cost {share:6.1%}"
        )
    return "\n".join(lines)


def check_partition(cfg: Config) -> None:
    """Config check: ConfigError when pp·vpp stages cannot hold the blocks as balance asks."""
    if cfg.parallel.balance.strip() == "cost":  # the DP always succeeds once the count fits
        _check_stage_count(cfg.parallel.pp * cfg.parallel.vpp, cfg.model.n_layers)
    else:
        partition(cfg)
