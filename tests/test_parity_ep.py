"""Parity: expert parallelism (parallel.ep, parallel/expert/) trains the mixture-of-experts tiny
model as one process does (per-step loss, grad norm and final logical weights, relative 1e-5),
dropless and with a capacity factor, alone and with tp, pp (1F1B and ZB-H1's deferred weight
grads), cp and zero=1, 2 and 3 (expert shards over the expert-replica group, float32 and bf16
weights, clipping active in the `clip` cases), and HSDP (parallel.dp_shard: the experts' shards
over a block's expert replicas, all-reduced across the blocks). Experts are gathered over the ep
group to compare them whole."""

import pytest
import torch

from tests import test_parity_cp, test_parity_moe, test_parity_pp
from tests.parity import mesh_params, train_case
from tests.test_parity_pp import pp
from tests.test_parity_tp_dp import reference
from tests.util import assert_rel_close, assert_state_close

MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_aux_coef=0.01", "model.moe_z_coef=0.001"]
CAP = ["model.moe_capacity_factor=1.0"]  # some rows dropped (tests/test_moe.py)
LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
MB2 = ["parallel.microbatches=2"]
EP2, EP4 = ["parallel.ep=2"], ["parallel.ep=4"]
ZERO = ["parallel.zero=1"]
Z2, Z3 = ["parallel.zero=2"], ["parallel.zero=3"]
Z2MB = [*Z2, "parallel.grad_reduce=microbatch"]
CLIP = ["train.grad_clip=0.05"]  # the tiny model's grad norm is ~1: every step clips
SP = ["parallel.sequence_parallel=true"]
SHARED, FULL = ["model.moe_shared_experts=1"], ["recompute.mode=full"]
HSDP = ["parallel.dp_shard=2"]  # dp 4: two shard groups of 2, replicas of each other

PLAIN = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("dp2-ep2", 2, 1, [*MOE, *EP2, *MB2]),
        ("dp2-ep2-capacity-llama", 2, 1, [*MOE, *CAP, *LLAMA, *EP2]),
    ],
    4: [
        ("dp4-ep2", 4, 1, [*MOE, *EP2]),
        ("dp4-ep4-capacity", 4, 1, [*MOE, *CAP, *EP4]),
        ("dp2-ep2-tp2", 2, 2, [*MOE, *EP2, *MB2]),
        ("dp2-ep2-tp2-sp-capacity", 2, 2, [*MOE, *CAP, *EP2, "parallel.sequence_parallel=true"]),
        ("dp4-ep2-zero1", 4, 1, [*MOE, *EP2, *ZERO, *MB2]),
    ],
}
ZERO23 = {  # expert shards over the expert replicas (dp/ep · cp ranks), dense over dp · cp
    2: [
        ("dp2-ep2-zero2-clip", 2, 1, [*MOE, *EP2, *Z2, *MB2, *CLIP]),
        ("dp2-ep2-zero3-capacity-llama", 2, 1, [*MOE, *CAP, *LLAMA, *EP2, *Z3, *MB2]),
        ("dp2-ep2-zero3-shared-full", 2, 1, [*MOE, *EP2, *Z3, *MB2, *SHARED, *FULL]),
    ],
    4: [
        ("dp4-ep2-zero2", 4, 1, [*MOE, *EP2, *Z2, *MB2]),
        ("dp4-ep2-zero3-clip", 4, 1, [*MOE, *EP2, *Z3, *MB2, *CLIP]),
        ("dp4-ep4-zero3-capacity", 4, 1, [*MOE, *CAP, *EP4, *Z3]),
        ("dp2-ep2-tp2-sp-zero2-clip", 2, 2, [*MOE, *EP2, *Z2, *SP, *CLIP]),
        ("dp2-ep2-tp2-sp-zero3", 2, 2, [*MOE, *EP2, *Z3, *SP, *MB2]),
    ],
}
CONTEXT = {
    4: [
        ("dp2-ep2-cp2", 2, 1, [*MOE, *EP2, "parallel.cp=2"]),
        ("dp2-ep2-cp2-zero1-capacity", 2, 1, [*MOE, *CAP, *EP2, *ZERO, "parallel.cp=2"]),
        ("dp2-ep2-cp2-zero2-capacity", 2, 1, [*MOE, *CAP, *EP2, *Z2, "parallel.cp=2"]),
    ],
    8: [  # HSDP: experts shard over a block's cp ranks (S/ep · cp = 2), two replicas of each
        ("hsdp-dp4-ep2-cp2-zero3-clip", 4, 1, [*MOE, *EP2, *HSDP, *Z3, *CLIP, "parallel.cp=2"]),
    ],
}
PIPELINE = {
    4: [
        ("dp2-ep2-pp2-1f1b", 2, 1, [*MOE, *EP2, *pp("1f1b", 2, 2)]),
        ("dp2-ep2-pp2-zb_h1-capacity", 2, 1, [*MOE, *CAP, *EP2, *pp("zb_h1", 2, 2)]),
        ("dp2-ep2-pp2-1f1b-zero1", 2, 1, [*MOE, *EP2, *ZERO, *pp("1f1b", 2, 2)]),
        ("dp2-ep2-pp2-1f1b-zero2-clip", 2, 1, [*MOE, *EP2, *Z2, *CLIP, *pp("1f1b", 2, 2)]),
        ("dp2-ep2-pp2-zb_h1-zero2", 2, 1, [*MOE, *EP2, *Z2, *pp("zb_h1", 2, 4)]),
        ("dp2-ep2-pp2-zb_h1-zero2-mb", 2, 1, [*MOE, *EP2, *Z2MB, *pp("zb_h1", 2, 4)]),
        ("dp2-ep2-pp2-1f1b-zero3", 2, 1, [*MOE, *EP2, *Z3, *pp("1f1b", 2, 2)]),
        ("dp2-ep2-pp2-zb_h1-zero3-cap", 2, 1, [*MOE, *CAP, *EP2, *Z3, *pp("zb_h1", 2, 4)]),
        ("dp2-ep2-pp2-zb_v-zero3-clip", 2, 1, [*MOE, *EP2, *Z3, *CLIP, *pp("zb_v", 2, 2, 2)]),
        ("dp2-ep2-pp2-interleaved-z2", 2, 1, [*MOE, *EP2, *Z2, *pp("interleaved_1f1b", 2, 2, 2)]),
    ],
}


def check_parity(gloo_pool, world: int, dp: int, tp: int, extra: list[str]) -> None:
    """As tests/test_parity_tp_dp.check_parity, the reference without parallel.ep."""
    results = gloo_pool(world).run(train_case, [*extra, f"parallel.dp={dp}", f"parallel.tp={tp}"])
    ref = reference(tuple(o for o in extra if not o.startswith("parallel.ep=")))
    for rank, got in enumerate(results):
        assert got["dp_spread"] == 0.0, f"rank {rank}: dp replicas differ"
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} != {b}"
        norms = [torch.tensor(r["grad_norms"], dtype=torch.float64) for r in (got, ref)]
        assert_rel_close(*norms, name="grad norms")
        assert_state_close(got["weights"], ref["weights"], exact=ref["exact"])


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(PLAIN))
def test_expert_parallel_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(ZERO23))
def test_expert_parallel_zero23_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CONTEXT))
def test_expert_parallel_context_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    test_parity_cp.check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(PIPELINE))
def test_expert_parallel_pipeline_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    test_parity_pp.check_parity(gloo_pool, world, dp, tp, extra)


# The MoE suite's check (tests/test_parity_moe.py): also the step's load per expert, drops, aux
# and z losses equal to one process's, whatever ep; shared experts, full recompute, ZB-V, bf16.
MOE_EP = {
    2: [
        (
            "dp2-ep2-cap-shared-full",
            2,
            1,
            [*EP2, *CAP, *MB2, "model.moe_shared_experts=1", "recompute.mode=full"],
        ),  # fmt: skip
    ],
    4: [
        ("dp4-ep4-cap-llama", 4, 1, [*EP4, *CAP, *LLAMA]),
        ("dp2-ep2-pp2-zb_v-cap", 2, 1, [*EP2, *CAP, *test_parity_moe.pp("zb_v", 2, 2)]),
        ("dp2-ep2-pp2-interleaved", 2, 1, [*EP2, *test_parity_moe.pp("interleaved_1f1b", 2, 2)]),
        ("dp2-ep2-pp2-dualpipe-cap", 2, 1, [*EP2, *CAP, *test_parity_moe.pp("dualpipe", 4, 2)]),
    ],
}
BF16 = test_parity_moe.BF16
MOE_EP_BF16 = {
    2: [
        ("dp2-ep2-bf16-zero1", 2, 1, [*EP2, *BF16, *MB2, *ZERO]),
        ("dp2-ep2-bf16-zero2", 2, 1, [*EP2, *BF16, *MB2, *Z2]),
        ("dp2-ep2-bf16-zero3", 2, 1, [*EP2, *BF16, *MB2, *Z3]),
    ],
    4: [
        ("dp4-ep2-bf16-zero3", 4, 1, [*EP2, *BF16, *Z3]),
        ("dp2-ep2-pp2-zb_h1-bf16-zero2", 2, 1, [*EP2, *BF16, *Z2, *test_parity_moe.pp("zb_h1", 4)]),
    ],
}


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(MOE_EP))
def test_expert_parallel_figures_match_one_process(gloo_pool, world, dp, tp, extra):
    test_parity_moe.test_moe_mesh_trains_like_one_process(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(MOE_EP_BF16))
def test_expert_parallel_bf16_weights(gloo_pool, world, dp, tp, extra):
    test_parity_moe.test_moe_bf16_weights_train_like_one_process(gloo_pool, world, dp, tp, extra)


@pytest.mark.spawn
@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("ep", [1, 2])
def test_router_stays_float32_in_sharded_bf16_buckets(gloo_pool, zero, ep):
    """Under bf16 weights the router is a float32 weight among bf16 ones (at ep=1 in a bucket
    after bf16 experts): zero 1 and 2 gather a bucket holding it in float32, zero 3 keeps it in
    a bucket of its own, so after the steps it still holds values no bf16 can
    (parallel/data/zero.widest, zero3._pack)."""
    extra = [*MOE, *BF16, *MB2, f"parallel.zero={zero}", "parallel.dp=2", f"parallel.ep={ep}"]
    for got in gloo_pool(2).run(train_case, extra, 3, 1.0):  # 1 MB: buckets of mixed dtypes
        routers = [w for name, w in got["weights"].items() if "router" in name]
        assert routers and all(w.dtype == torch.float32 for w in routers)
        assert all((w != w.bfloat16().float()).any() for w in routers)
