"""Muon under ZeRO 1-3 (train.optimizer=muon, parallel.zero >= 1): each hidden matrix is owned
whole by one rank of the group that shards its bucket.

ZeRO cuts every bucket into one flat range per rank of its shard group (parallel/data/zero.py),
and Muon's step needs whole matrices (Newton-Schulz, train/muon.py). So every 2-D hidden matrix
has one owner among those ranks: the matrices are dealt largest first to the least-loaded rank
by element count (config/muon_terms.deal, which the memory model prices), alike on every rank.
Per step, after the reduction, the clip and the LR (train/step.py):

1. an all-to-all over the shard group brings each owner the reduced grad ranges of its matrices
   (the ranks' ranges, in rank order, tile each matrix), so it holds each one whole;
2. the owner keeps the matrix's momentum buffer whole and runs train/muon.py's arithmetic on
   it: Nesterov momentum, each logical matrix orthogonalised whole (under tp the owners of a
   matrix, one per tp rank, all-gather its update over tp: train/muon.py), the adjusted LR;
3. a second all-to-all returns to every rank the update of the ranges it holds, which it adds,
   after the weight decay, into the values the level steps (zero 1/2: the float32 weight range
   or its main param; zero 3: the weight's master shard or its main param); the level then
   rounds and gathers them as it does AdamW's (train/muon_zero.ZeroMuon.step).

AdamW's groups (embeddings, head, norms, biases) stay the level's inner optimizer.

Moonlight's Distributed Muon (Liu et al. 2025, "Muon is Scalable for LLM Training", §2.3)
keeps the momentum partitioned as ZeRO-1 keeps AdamW's moments, all-gathers the momentum-
updated grad partitions over dp so that every rank holds every full matrix, runs Newton-Schulz
on each and keeps its own partition of the result. Here one owner per matrix runs it, so a rank
orthogonalises about 1/R of the matrices instead of all of them, at the price of the second
exchange (the update back); and the momentum lives whole on its owner instead of in shards,
which a checkpoint writes as one block (train/checkpoint_zero.py).
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megapipe.config.muon_terms import deal
from megapipe.distributed import collectives as C
from megapipe.parallel.data.zero import Slot
from megapipe.parallel.precision import grad_of
from megapipe.train.muon import MatrixLayout, Muon, orthogonalised


@dataclass
class Owned:
    """One Muon matrix as its shard group sees it: the `ranges` [lo, hi) of its flat local
    tensor that each rank of the group holds, its `owner`, and this rank's `view` of the
    values the level steps (None where it holds none) with the reducer that has its grad."""

    param: nn.Parameter
    layout: MatrixLayout
    ranges: list[tuple[int, int]]
    owner: int
    view: torch.Tensor | None
    reducer: object

    def length(self, rank: int) -> int:
        lo, hi = self.ranges[rank]
        return hi - lo


@dataclass
class Exchange:
    """The matrices whose buckets one shard `group` splits: this rank is `index` of `size`."""

    group: object
    index: int
    size: int
    matrices: list[Owned]

    def owned_by(self, rank: int) -> list[Owned]:
        return [m for m in self.matrices if m.owner == rank]


def _ranges(bucket, param: nn.Parameter, size: int) -> list[tuple[int, int]]:
    """Each rank's [lo, hi) of `param`'s flat tensor: the bucket's padded flat space cut into
    `size` equal runs (ShardedGradReducer.shard_range), intersected with `param`'s place."""
    offset = 0
    for p in bucket.params:
        if p is param:
            break
        offset += p.numel()
    per, n = -(-bucket.numel // size), param.numel()
    out = []
    for r in range(size):
        lo, hi = max(offset, r * per), min(offset + n, (r + 1) * per)
        out.append((lo - offset, hi - offset) if lo < hi else (0, 0))
    return out


class OwnedMuon(Muon):
    """train/muon.Muon over the hidden matrices, each stepped by its owner (module docstring).
    `slot_of` is the level's {id(param): (Slot, view)} (ShardedOptimizer.slot_of); `shards`:
    the summed grads live as the reducers' shards (zero >= 2), not in the params' grads."""

    def __init__(self, groups: list[dict], reducers: list, slot_of: dict, shards: bool, **hyper):
        super().__init__(groups, **hyper)
        self.shards = shards
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self.device = first.device if first is not None else torch.device("cpu")
        by_group: dict[int, list] = {}
        for g in self.param_groups:
            for param, layout in zip(g["params"], g["layouts"], strict=True):
                reducer = next(r for r in reducers if id(param) in r.bucket_of)
                bucket = reducer.bucket_of[id(param)]
                group = reducer.group_of(bucket)
                by_group.setdefault(id(group), [group, []])[1].append((param, layout, reducer))
        self.exchanges = [
            self._exchange(group, items, slot_of) for group, items in by_group.values()
        ]
        self.owned = {id(m.param): m for x in self.exchanges for m in x.matrices}
        self.mine = {id(m.param) for x in self.exchanges for m in x.owned_by(x.index)}

    def _exchange(self, group, items: list, slot_of: dict) -> Exchange:
        size, index = dist.get_world_size(group), dist.get_rank(group)
        owners = deal([p.numel() for p, _, _ in items], size)
        matrices = []
        for (param, layout, reducer), owner in zip(items, owners):
            ranges = _ranges(reducer.bucket_of[id(param)], param, size)
            slot, view = slot_of.get(id(param), (None, None))
            assert slot is None or (slot.lo, slot.hi) == ranges[index], "a bucket moved"
            matrices.append(Owned(param, layout, ranges, owner, view, reducer))
        return Exchange(group, index, size, matrices)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "megapipe steps without a closure"
        (group,) = self.param_groups  # train/muon.muon_groups: one group
        for x in self.exchanges:
            whole = self._to_owners(x)
            updates = [self._update(m, whole[id(m.param)], group) for m in x.owned_by(x.index)]
            self._from_owners(x, updates, group)

    def _grad(self, m: Owned, index: int) -> torch.Tensor:
        """This rank's (`index` in the group) range of `m`'s summed grad (zeros: no grad)."""
        lo, hi = m.ranges[index]
        if hi == lo:
            return torch.zeros(0, device=self.device)
        grad = m.reducer.grad_piece(m.param) if self.shards else grad_of(m.param)
        if grad is None:
            return torch.zeros(hi - lo, dtype=m.view.dtype, device=m.view.device)
        return grad if self.shards else grad.reshape(-1)[lo:hi]

    def _to_owners(self, x: Exchange) -> dict[int, torch.Tensor]:
        """Step 1: {id(param): its whole local grad} for the matrices this rank owns."""
        mine = x.owned_by(x.index)
        send_sizes = [sum(m.length(x.index) for m in x.owned_by(r)) for r in range(x.size)]
        recv_sizes = [sum(m.length(r) for m in mine) for r in range(x.size)]
        send = [self._grad(m, x.index).float() for r in range(x.size) for m in x.owned_by(r)]
        send = [s for s in send if s.numel()]
        flat = torch.cat(send) if send else torch.zeros(0, device=self.device)
        got = flat.new_empty(sum(recv_sizes))
        C.count("all_to_all", flat)
        dist.all_to_all_single(got, flat, recv_sizes, send_sizes, group=x.group)
        pieces: dict[int, list] = {id(m.param): [] for m in mine}
        at = 0
        for r in range(x.size):
            for m in mine:
                pieces[id(m.param)].append(got[at : at + m.length(r)])
                at += m.length(r)
        return {id(m.param): torch.cat(pieces[id(m.param)]).view_as(m.param) for m in mine}

    def _update(self, m: Owned, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """Step 2, on the owner: −(adjusted lr) × the orthogonalised update, flat."""
        update = self.nesterov_update(m.param, grad, group)
        delta = torch.zeros_like(update)
        for piece, rows, adjusted in orthogonalised(update, m.layout, group):
            delta.narrow(m.layout.dim, piece.local_lo, piece.length).copy_(rows).mul_(-adjusted)
        return delta.view(-1)

    def _from_owners(self, x: Exchange, updates: list[torch.Tensor], group: dict) -> None:
        """Step 3: each rank's ranges of the updates it holds, added after the weight decay."""
        mine = x.owned_by(x.index)
        send_sizes = [sum(m.length(r) for m in mine) for r in range(x.size)]
        recv_sizes = [sum(m.length(x.index) for m in x.owned_by(r)) for r in range(x.size)]
        send = [u[slice(*m.ranges[r])] for r in range(x.size) for m, u in zip(mine, updates)]
        send = [s for s in send if s.numel()]
        flat = torch.cat(send) if send else torch.zeros(0, device=self.device)
        got = flat.new_empty(sum(recv_sizes))
        C.count("all_to_all", flat)
        dist.all_to_all_single(got, flat, recv_sizes, send_sizes, group=x.group)
        at, decay = 0, 1 - group["lr"] * group["weight_decay"]
        for r in range(x.size):
            for m in x.owned_by(r):
                n = m.length(x.index)
                if n:
                    m.view.mul_(decay).add_(got[at : at + n])
                at += n

    def owned_state(self, param: nn.Parameter) -> tuple[Slot, dict]:
        """(the range of `param` this rank keeps state for: whole on its owner, empty elsewhere;
        {"momentum_buffer": that state, flat}), for the checkpoints (train/checkpoint_zero.py)."""
        if id(param) not in self.mine:
            return Slot(param, 0, 0, 0), {"momentum_buffer": torch.zeros(0, device=self.device)}
        buf = self.param_state(param)["momentum_buffer"]
        return Slot(param, 0, param.numel(), 0), {"momentum_buffer": buf.view(-1)}

    def state_bytes(self) -> int:
        """Bytes of the momentum buffers this rank holds (its owned matrices')."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())


class ZeroMuon:
    """The level's distributed optimizer (AdamW over its shards of the other groups) beside
    OwnedMuon, one optimizer to the loop and the checkpoints (optimizer_interface.py)."""

    shards_state = True

    def __init__(self, sharded, muon: OwnedMuon) -> None:
        self.sharded, self.muon = sharded, muon
        self.stage_group = sharded.stage_group

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.sharded.param_groups]

    @property
    def state(self) -> ChainMap:
        return ChainMap(self.muon.state, self.sharded.state)

    def step(self) -> None:
        """Muon's matrices first: the level's step then rounds and gathers every range."""
        self.muon.step()
        self.sharded.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sharded.zero_grad(set_to_none)

    def owned_state(self, param: nn.Parameter):
        if id(param) in self.muon.owned:
            return self.muon.owned_state(param)
        return self.sharded.owned_state(param)

    def param_state(self, param: nn.Parameter) -> dict:
        return self.muon.param_state(param)

    @property
    def writes_shards(self) -> bool:
        return self.sharded.writes_shards

    def step_count(self) -> torch.Tensor:
        return self.sharded.step_count()

    def set_step_count(self, value: torch.Tensor) -> None:
        self.sharded.set_step_count(value)

    def main_weights(self) -> dict[int, torch.Tensor]:
        return self.sharded.main_weights()

    def load_targets(self) -> dict[int, torch.Tensor]:
        return self.sharded.load_targets()

    def restore_main(self, full: dict[int, torch.Tensor]) -> None:
        self.sharded.restore_main(full)

    def full_weights(self, write_back: bool = False):
        return self.sharded.full_weights(write_back)

    def state_bytes(self) -> int:
        return self.sharded.state_bytes() + self.muon.state_bytes()


def zero_muon(sharding, reducers: list, groups: list[dict], make_adamw, stage_group, cfg):
    """ZeroMuon over `groups` (train/muon.muon_groups' Muon group first, then AdamW's), or
    None where `sharding` shards nothing (no replicas: the plain Muon, train/muon.py)."""

    def adamw_only(shard_groups: list[dict]):
        rest = [g for g in shard_groups if not g.get("muon")]
        return make_adamw(rest or [{"params": [torch.zeros(0)]}])

    sharded = sharding.optimizer(reducers, groups, adamw_only, stage_group)
    if sharded is None:
        return None
    hyper = dict(momentum=cfg.muon_momentum, nesterov=True, ns_steps=cfg.muon_ns_steps)
    muon = OwnedMuon(
        [g for g in groups if g.get("muon")],
        sharded.reducers,
        sharded.slot_of,
        sharding.grads_as_shards,
        lr=cfg.lr,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
        **hyper,
    )
    return ZeroMuon(sharded, muon)
