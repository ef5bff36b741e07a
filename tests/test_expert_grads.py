"""Expert weights' grads under parallel.ep (parallel/data/reducer.py, zero.py): on a toy layer
(a dense weight, then experts reached through dispatch/combine) spread over a 4-rank gloo mesh,
the dense grad is summed over every dp × cp replica and each expert's over the ranks holding it,
so both equal the one-process grads; the global grad norm over every rank equals the
one-process norm, at zero=0 (whole grads, one replica counts) and zero=1 (owned shards)."""

from types import SimpleNamespace

import pytest
import torch

from megapipe.distributed.local_world import spawn
from megapipe.distributed.mesh import MeshSizes, ParallelMesh
from megapipe.parallel.data.levels import LEVELS
from megapipe.parallel.expert.dispatch import combine, dispatch
from megapipe.parallel.expert.sharding import NO_EP, EPInfo, ep_info, mark_experts
from megapipe.parallel.precision import grad_of
from megapipe.parallel.tensor.layers import ShardedModule
from megapipe.parallel.tensor.random import tp_info
from megapipe.parallel.tensor.sharding import NO_TP, REPLICATED
from megapipe.train.optim import global_grad_norm
from megapipe.train.replica import Replica

E, D, T, K = 8, 6, 6, 2  # experts, width, tokens per replica, choices per token
MESHES = {  # id -> (sizes, zero)
    "dp4-ep2": (MeshSizes(dp=4, ep=2), 0),
    "dp4-ep4": (MeshSizes(dp=4, ep=4), 0),
    "dp2-cp2-ep2": (MeshSizes(dp=2, cp=2, ep=2), 0),
    "dp2-tp2-ep2": (MeshSizes(dp=2, tp=2, ep=2), 0),
    "dp4-ep2-zero1": (MeshSizes(dp=4, ep=2), 1),
    "dp2-cp2-ep2-zero1": (MeshSizes(dp=2, cp=2, ep=2), 1),
}


class Toy(ShardedModule):
    """x W, then each row through its top-k experts (dispatch/combine), summed."""

    def __init__(self, ep: EPInfo = NO_EP, tp=NO_TP) -> None:
        super().__init__(tp)
        self.ep = ep
        self._add_param("w", (D, D), REPLICATED, tp)
        self._add_param("experts", (E // ep.size, D, D), REPLICATED, tp)
        mark_experts(ep, self.experts)
        g = torch.Generator().manual_seed(3)
        w, experts = torch.randn(D, D, generator=g), torch.randn(E, D, D, generator=g)
        with torch.no_grad():
            self.w.copy_(w / D**0.5)
            self.experts.copy_(experts[list(ep.local_experts(E))] / D**0.5)

    def forward(self, x, choice, cot):
        rows = (x @ self.w).repeat_interleave(K, dim=0)
        local, counts, plan = dispatch(rows, choice.flatten(), E, self.ep)
        outs = [r @ self.experts[i] for i, r in enumerate(local.split(counts.tolist()))]
        return (combine(torch.cat(outs), plan, self.ep).view(-1, K, D).sum(1) * cot).sum()


def batch(replicas: int):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(replicas * T, D, generator=g)
    choice = torch.rand(replicas * T, E, generator=g).argsort(dim=1)[:, :K]
    return x, choice, torch.randn(replicas * T, D, generator=g)


def _case(sizes: MeshSizes, zero: int) -> dict:
    mesh = ParallelMesh(sizes)
    c = mesh.coords
    model = Toy(ep_info(mesh), tp_info(mesh))
    sharding = LEVELS[zero]
    reducer = sharding.reducer(model, mesh, 1e-4, None, ())
    replica = c["dp"] * sizes.cp + c["cp"]  # the rows this dp × cp replica reads
    rows = slice(replica * T, (replica + 1) * T)
    x, choice, cot = (t[rows] for t in batch(sizes.dp * sizes.cp))
    model(x, choice, cot).backward()
    reducer.finish()
    engine = Replica(SimpleNamespace(), model, reducer, mesh, sharding)
    assert engine.norm_group is mesh.world_group  # ep ranks hold different experts
    norm = global_grad_norm(engine.grads_counted_once(), mesh.world_group)
    grads = {n: grad_of(p).clone() for n, p in model.named_parameters()}
    owned = [(n, s.lo, s.hi) for s in reducer.owned() for n, p in model.named_parameters()
             if p is s.param] if zero else None  # fmt: skip
    return {"norm": norm, "grads": grads, "owned": owned, "ep_rank": mesh.ep_rank}


def _all() -> dict:
    return {name: _case(sizes, zero) for name, (sizes, zero) in MESHES.items()}


@pytest.fixture(scope="module")
def results():
    return spawn(4, _all)


@pytest.mark.spawn
@pytest.mark.parametrize("name", list(MESHES))
def test_expert_grads_and_norm_match_one_process(results, name):
    sizes, zero = MESHES[name]
    one = Toy()
    one(*batch(sizes.dp * sizes.cp)).backward()
    want = {n: p.grad for n, p in one.named_parameters()}
    norm = torch.cat([g.flatten() for g in want.values()]).norm()
    for res in (r[name] for r in results):
        torch.testing.assert_close(res["norm"], norm, rtol=1e-5, atol=0)
        mine = list(EPInfo(sizes.ep, res["ep_rank"]).local_experts(E))
        local = {"w": want["w"], "experts": want["experts"][mine]}
        if not zero:
            for n, g in res["grads"].items():
                torch.testing.assert_close(g, local[n], rtol=1e-5, atol=1e-6)
            continue
        for n, lo, hi in res["owned"]:  # zero=1: the owned ranges hold the summed grads
            got, ref = res["grads"][n].flatten()[lo:hi], local[n].flatten()[lo:hi]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
