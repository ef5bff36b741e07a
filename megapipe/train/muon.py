"""Muon for the hidden matrices, AdamW for the rest (train.optimizer=muon).

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al.
2025, "Muon is Scalable for LLM Training", the Moonlight report) keeps a momentum buffer per
matrix and steps by the Newton-Schulz orthogonalisation of its Nesterov update, with torch
2.13's `torch.optim.Muon` arithmetic (its orthogonalisation and learning-rate adjustment,
through megapipe/_torch_compat.py). Which parameters get which, as both papers recommend:

- Muon: every 2-D weight of a transformer layer (attention qkv and proj, the MLP's fc1 / fc2,
  a MoE router and its shared experts' matrices), weight decay `train.weight_decay`;
- AdamW (train/optim.py's, its decay groups): the embedding tables and the output head
  (`embed.*`, `head.*`), norm gains, biases and the stacked 3-D expert weights.

A fused parameter holds several logical matrices (q | k | v of `qkv`, gate | up of a SwiGLU
`fc1`: its ShardSpec's segments). Each is orthogonalised on its own, with its own adjusted
learning rate, on one process as on any mesh, so that parity holds.

Under tp a shard is never a whole matrix: every tp rank all-gathers the Nesterov update of a
sharded matrix over tp, orthogonalises each whole logical matrix and keeps the rows of its own
shard (the momentum buffer stays a shard, like the weight, so checkpoints store it under the
weight's logical name and shape and load it under any mesh). Gathering costs one all-gather
of the update per matrix and tp-fold redundant Newton-Schulz FLOPs, but no second round trip
to scatter the result, which owning each matrix on one tp rank would need. Under dp (zero=0)
the summed grads are the same on every replica, and so are their updates. ZeRO levels 1-3 cut
matrices into flat ranges: there each matrix is owned whole by one rank (train/muon_zero.py),
which runs this arithmetic (`nesterov_update`, `orthogonalised`) for it.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megapipe._torch_compat import muon_adjusted_lr, muon_orthogonalize
from megapipe.config import TrainConfig
from megapipe.parallel.data.optimizer_interface import WholeState
from megapipe.parallel.tensor.layers import sharded_params
from megapipe.parallel.tensor.sharding import Piece, ShardSpec, TPInfo, unshard

ADAMW_PREFIXES = ("embed.", "head.")  # the embedding tables and the output head: AdamW's


@dataclass(frozen=True)
class MatrixLayout:
    """Where the logical matrices of one 2-D parameter lie: its logical `shape`, its tp `spec`
    (segments along `spec.dim`: the fused matrices) and this rank's `tp` place."""

    shape: tuple[int, ...]
    spec: ShardSpec
    tp: TPInfo

    @property
    def dim(self) -> int:
        return self.spec.dim if self.spec.dim is not None else 0

    def matrices(self) -> list[tuple[int, int, Piece]]:
        """(logical start, rows along `dim`, this rank's piece) per logical matrix."""
        if self.spec.dim is None:  # replicated: one matrix, held whole
            return [(0, self.shape[0], Piece(0, 0, self.shape[0], True))]
        pieces = self.spec.pieces(self.tp.size, self.tp.rank)
        starts = [sum(self.spec.segments[:i]) for i in range(len(self.spec.segments))]
        return list(zip(starts, self.spec.segments, pieces, strict=True))

    def logical_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (rows, cols) of each logical matrix, whole (what Newton-Schulz runs on)."""
        out = []
        for _, rows, _ in self.matrices():
            shape = list(self.shape)
            shape[self.dim] = rows
            out.append((shape[0], shape[1]))
        return tuple(out)

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The logical tensor of `local` (this rank's shard): all-gathered over tp."""
        if self.spec.dim is None or self.tp.size == 1:
            return local
        shards = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(shards, local.contiguous(), group=self.tp.group)
        return unshard(self.spec, shards, self.shape)


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose step orthogonalises each logical matrix of a (tp-sharded, fused)
    parameter whole: each group's `layouts` (MatrixLayout) runs parallel to its `params`."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "megapipe steps without a closure"
        for group in self.param_groups:
            for param, layout in zip(group["params"], group["layouts"], strict=True):
                if param.grad is not None:
                    self._step_one(param, layout, group)

    def _step_one(self, param: torch.Tensor, layout: MatrixLayout, group: dict) -> None:
        """torch's _single_tensor_muon for one parameter, per logical matrix."""
        update = self.nesterov_update(param, param.grad, group)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        for piece, mine, adjusted in orthogonalised(update, layout, group):
            param.narrow(layout.dim, piece.local_lo, piece.length).add_(mine, alpha=-adjusted)

    def nesterov_update(self, param: torch.Tensor, grad: torch.Tensor, group: dict):
        """`param`'s momentum buffer takes `grad` in; returns the (Nesterov) update."""
        momentum = group["momentum"]
        buf = self.param_state(param)["momentum_buffer"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def param_state(self, param: torch.Tensor) -> dict:
        """The momentum buffer of `param` (zeros if absent, so a load has a target): float32,
        or float64 for float64 weights (the tests' exact twin)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            dtype = torch.promote_types(param.dtype, torch.float32)
            state["momentum_buffer"] = torch.zeros_like(param, dtype=dtype)
        return state


def orthogonalised(update: torch.Tensor, layout: MatrixLayout, group: dict):
    """(this rank's piece, its rows of the orthogonalised matrix, the adjusted lr) for each
    logical matrix of `update` (this rank's shard of a parameter's Nesterov update: gathered
    over tp first, a collective)."""
    full, dim = layout.whole(update), layout.dim
    for start, rows, piece in layout.matrices():
        matrix = full.narrow(dim, start, rows)
        ortho = muon_orthogonalize(
            matrix, group["ns_coefficients"], group["ns_steps"], group["eps"]
        )
        adjusted = muon_adjusted_lr(group["lr"], group["adjust_lr_fn"], matrix.shape)
        yield piece, ortho.narrow(dim, piece.global_lo - start, piece.length), adjusted


class MuonAdamW(WholeState):
    """Muon over the hidden matrices beside AdamW over the rest, one optimizer to the loop
    and the checkpoints (parallel/data/optimizer_interface.py's members: whole state per
    parameter, no main weights of its own)."""

    def __init__(self, muon: Muon, adamw) -> None:
        self.muon, self.adamw = muon, adamw
        self._muon_params = {p for g in muon.param_groups for p in g["params"]}

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @property
    def state(self) -> ChainMap:
        """Per-parameter state of both (reads: a parameter is in one of them only)."""
        return ChainMap(self.muon.state, self.adamw.state)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def param_state(self, param: nn.Parameter) -> dict:
        """Muon's momentum buffer, or AdamW's step and moments, of `param`."""
        inner = self.muon if param in self._muon_params else self.adamw
        return inner.param_state(param)

    def full_weights(self, write_back: bool = False):
        return self.adamw.full_weights(write_back)


def muon_groups(
    model: nn.Module, weight_decay: float
) -> tuple[dict, list[tuple[str, nn.Parameter]]]:
    """(Muon's group over the hidden matrices of `model` (a GPT or a pipeline rank's chunks),
    with their layouts; the (name, parameter) pairs left to AdamW)."""
    chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
    hidden, layouts, rest = [], [], []
    for chunk in chunks:
        for name, param, shape, spec, tp in sharded_params(chunk):
            if not param.requires_grad:
                continue
            if param.ndim == 2 and not name.startswith(ADAMW_PREFIXES):
                hidden.append(param)
                layouts.append(MatrixLayout(tuple(shape), spec, tp))
            else:
                rest.append((name, param))
    group = {"params": hidden, "layouts": layouts, "weight_decay": weight_decay, "muon": True}
    return group, rest


def make_muon(groups: list[dict], cfg: TrainConfig, make_adamw) -> MuonAdamW:
    """Muon over the groups marked `muon`, `make_adamw` over the others (the same groups after
    parallel/precision.MainParamOptimizer swapped in float32 main params)."""
    mine = [g for g in groups if g.get("muon")]
    muon = Muon(
        mine,
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        nesterov=True,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
    )
    return MuonAdamW(muon, make_adamw([g for g in groups if not g.get("muon")]))
