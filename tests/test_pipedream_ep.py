"""Expert parallelism under PipeDream's asynchronous schedule (pipeline/pipedream.py, Narayanan et
al. SOSP'19 §3.3): pp2 × dp2 × ep2 trains as the same mesh at ep=1 does (per-step loss, grad
norm and final logical weights, relative 1e-5, float32), dropless and with a capacity factor,
under weight stashing and vertical sync, clipping active.

Two references: the ep=1 run on the same mesh, and tests/test_pipedream.py's one-process
simulation of the delayed-gradient rule (each stage's gradient at its delayed weights, clipped by
the stage's whole norm), which builds the stages whole and knows nothing of ep. At dp2 × ep2 each
expert has one replica: summing the expert grads over dp would add the other ep rank's experts'
grads into this rank's, and a norm over tp alone would leave the other rank's experts out of the
clip (and let the dp ranks clip the dense weights differently).
"""

import pytest
import torch

from tests import test_pipedream
from tests.parity import mesh_params, train_case
from tests.util import assert_rel_close, assert_state_close, rel_error

MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_aux_coef=0.01", "model.moe_z_coef=0.001"]
CAP = ["model.moe_capacity_factor=1.0"]  # some rows dropped (tests/test_moe.py)
CLIP = ["train.grad_clip=0.3"]  # below the per-update norms (~1.3-1.8 over both stages): clips
LLAMA = ["model.arch=llama", "model.d_ff=64"]
B12 = ["train.global_batch=12"]


def pd(m: int, sync: str) -> list[str]:
    return [
        "parallel.schedule=pipedream_async",
        "parallel.pp=2",
        f"parallel.microbatches={m}",
        f"parallel.weight_sync={sync}",
        "model.tie_embeddings=false",
    ]


CASES = {  # world -> [(id, dp, tp, overrides)]
    4: [
        ("pp2-dp2-stash-clip", 2, 1, [*MOE, *CLIP, *pd(4, "stash")]),
        ("pp2-dp2-vertical-capacity-clip", 2, 1, [*MOE, *CAP, *CLIP, *pd(4, "vertical")]),
        ("pp2-dp2-stash-capacity-llama", 2, 1, [*MOE, *CAP, *LLAMA, *pd(2, "stash")]),
    ],
}


def _logical(results: list[dict]) -> dict:
    """The union of the ranks' logical weights (each stage's, experts gathered over ep)."""
    union = {}
    for rank, got in enumerate(results):
        assert got["events"] == got["actions"], f"rank {rank}: ran out of schedule order"
        assert got["dp_spread"] == 0.0, f"rank {rank}: dp replicas differ"
        for name, value in got["weights"].items():
            assert name not in union or torch.equal(union[name], value), f"{name} copies differ"
            union[name] = value
    return union


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_pipedream_expert_parallel_trains_like_ep1(gloo_pool, world, dp, tp, extra):
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    ref = gloo_pool(world).run(train_case, [*extra, *mesh, "parallel.ep=1"])
    got = gloo_pool(world).run(train_case, [*extra, *mesh, "parallel.ep=2"])
    for rank, (a, b) in enumerate(zip(got, ref)):
        t = [torch.tensor(r["losses"], dtype=torch.float64) for r in (a, b)]
        assert_rel_close(*t, name=f"rank {rank} losses")
        n = [torch.tensor(r["grad_norms"], dtype=torch.float64) for r in (a, b)]
        assert_rel_close(*n, name=f"rank {rank} grad norms")
    weights, expected = _logical(got), _logical(ref)
    assert any("experts" in name for name in expected)
    assert_state_close(weights, expected)


# Against the one-process simulation: the experts' versions, reduction and norm must all be
# right to match it (ep=1 at world 2, MoE with a capacity factor; ep=2 at world 4).
SIMULATED = {
    2: [("pp2-stash-m4-capacity", 1, 1, [*MOE, *CAP, *test_pipedream.pd(2, 4)])],
    4: [
        ("pp2-dp2-ep2-stash-m3-clip", 2, 1, [*MOE, *CLIP, *B12, *test_pipedream.pd(2, 3)]),
        (
            "pp2-dp2-ep2-vertical-m3-capacity",
            2,
            1,
            [*MOE, *CAP, *B12, *test_pipedream.pd(2, 3, "vertical")],
        ),
    ],
}


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(SIMULATED))
def test_pipedream_moe_matches_delayed_gradient_simulation(gloo_pool, world, dp, tp, extra):
    ep = ["parallel.ep=2"] if dp > 1 else []
    results, weights = test_pipedream._run(gloo_pool, world, dp, tp, [*extra, *ep])
    ref = test_pipedream.simulate(tuple(extra), dp)
    for rank, got in enumerate(results):
        t = [torch.tensor(r["losses"], dtype=torch.float64) for r in (got, ref)]
        assert_rel_close(*t, name=f"rank {rank} losses")
        n = [torch.tensor(r["grad_norms"], dtype=torch.float64) for r in (got, ref)]
        assert_rel_close(*n, name=f"rank {rank} grad norms")
    assert_state_close(weights, ref["weights"])
    # teeth: the same rule without the delay (what ignoring the versions would give)
    undelayed = test_pipedream.simulate(tuple(extra), dp, delayed=False)["weights"]
    assert max(rel_error(weights[k], undelayed[k]) for k in weights) > 1e-3
