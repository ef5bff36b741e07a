"""Token dispatch to experts and the combine back (the contract every MoE layer goes through).

`dispatch` takes one row per (token, choice) with the global expert id it was routed to and
returns the rows this rank's experts take, grouped by local expert in a fixed order, with the
count per local expert; `combine` returns expert outputs to the rows' original order on the rank
they came from. With one ep rank both are a stable sort and its inverse; with ep > 1 the rows
cross ranks by all-to-all (parallel/expert/all_to_all.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.parallel.expert.all_to_all import gather_rows, plan_exchange, scatter_rows
from megapipe.parallel.expert.sharding import EPInfo


@dataclass
class DispatchPlan:
    """What `combine` needs to undo a `dispatch`."""

    order: torch.Tensor  # the stable sort of the rows by expert id
    extra: object = None  # ep > 1: the all-to-all's layout (all_to_all.Layout)
    by_source: torch.Tensor | None = None  # ep > 1: (E/ep, ep) rows per local expert and source


def dispatch(
    rows: torch.Tensor, expert_of: torch.Tensor, n_experts: int, ep: EPInfo
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """(rows for this rank's experts grouped by local expert, count per local expert, plan)."""
    order = torch.argsort(expert_of, stable=True)
    counts = torch.bincount(expert_of, minlength=n_experts)
    if ep.size == 1:
        return rows[order], counts, DispatchPlan(order)
    ex, got = plan_exchange(counts, ep.size, ep.group)
    plan = DispatchPlan(order, ex, got.t())
    return scatter_rows(rows[order], ex, ep.group), got.sum(0), plan


def combine(out: torch.Tensor, plan: DispatchPlan, ep: EPInfo) -> torch.Tensor:
    """Expert outputs back in the order of the rows given to `dispatch`."""
    if ep.size > 1:
        out = gather_rows(out, plan.extra, ep.group)
    back = torch.empty_like(out)
    back[plan.order] = out
    return back
