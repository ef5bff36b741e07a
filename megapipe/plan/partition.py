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
           stage over per-block costs (config.pipeline_split gives FLOPs, pipeline.stages measures).
  layout   explicit, e.g. "E,t,t|t,t,t|t,t,L" or "E,t*2|t*3|t*2,L": stages split by |.

Pure arithmetic: ints in, ranges out, ValueError (naming the config key to fix) out. Every rank
must compute the same partition: FLOP costs are deterministic, profiled ones are not (measure
once, share the list).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence

STRATEGIES = ("uniform", "llama3", "cost")
_LAYOUT_CHARS = set("EtL*0123456789 ,|")
_TOKEN_RE = re.compile(r"^(E|t|L)(?:\*(\d+))?$")
_SHOW_RUN = 4  # describe/format: up to this many layers are written out t,t,t; more as t*N


def partition(
    n_layers: int, n_stages: int, balance: str, costs: Sequence[float] | None = None
) -> list[range]:
    """One contiguous block range per global stage, covering blocks 0..n_layers+1.

    `costs` (one per block) drive the `cost` balance, which needs them."""
    check_stage_count(n_stages, n_layers)
    if costs is not None and len(costs) != n_layers + 2:
        raise ValueError(f"costs has {len(costs)} entries; the model has {n_layers + 2} blocks")
    balance = balance.strip()
    if balance == "cost":
        if costs is None:
            raise ValueError("the cost balance needs one cost per block")
        return cost_balanced(costs, n_stages)
    if balance == "uniform":
        sizes = _uniform_sizes(n_layers, n_stages)
    elif balance == "llama3":
        sizes = _llama3_sizes(n_layers, n_stages)
    elif balance and (set(balance) <= _LAYOUT_CHARS or "," in balance or "|" in balance):
        sizes = parse_layout(balance, n_layers, n_stages)
    else:
        raise ValueError(
            f"parallel.balance={balance!r} is not one of {', '.join(STRATEGIES)} "
            "or a layout like 'E,t,t|t,t,L'"
        )
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_stage_count(n_stages: int, n_layers: int) -> None:
    if n_stages < 1:
        raise ValueError(f"parallel.pp·vpp = {n_stages} stages; need at least 1")
    if n_stages > n_layers + 2:
        raise ValueError(
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


def parse_layout(layout: str, n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage of an explicit layout such as 'E,t,t|t,t,t|t,t,L' (t*3 is t,t,t)."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"parallel.balance layout {layout!r}: {problem}")

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


def _parse_stage(text: str, stage: int, bad: Callable[[str], ValueError]) -> list[str]:
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
    return "|".join(stage_text(blocks, head) for blocks in stages)


def stage_text(blocks: range, head: int) -> str:
    n_t = sum(1 for b in blocks if 0 < b < head)
    layers = ["t"] * n_t if n_t <= _SHOW_RUN else [f"t*{n_t}"]
    return ",".join((["E"] if 0 in blocks else []) + layers + (["L"] if head in blocks else []))
