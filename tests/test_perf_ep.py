"""The performance model under expert parallelism (perf/comm.py, perf/costs.py): the all-to-all
price, the ep groups against distributed/mesh.py's, their link inside and across nodes, and a
MoE layer's dispatch + combine in F and B of the projection."""

import dataclasses

import pytest

from megapipe.config import load_config
from megapipe.distributed.mesh import MeshSizes, ep_group_ranks
from megapipe.perf import MEGAPIPE, load_cluster, project
from megapipe.perf.cluster import Link
from megapipe.perf.comm import all_to_all_time, ep_groups, ep_link, group_link
from megapipe.perf.cost_terms import CALIBRATION, shapes
from megapipe.perf.costs import CostModel
from tests.conftest import TINY

MOE = ["model.n_experts=8", "model.top_k=2", "model.d_model=1024", "model.n_heads=16"]
MOE += ["model.seq_len=1024", "model.n_layers=4", "train.global_batch=64", "model.vocab_size=512"]


def test_all_to_all_sends_all_but_its_own_share():
    link = Link("x", 100e9, 1e-5)
    assert all_to_all_time(1e9, 1, link) == 0.0
    assert all_to_all_time(1e9, 4, link) == pytest.approx(3 * 1e-5 + 0.75 * 1e9 / 100e9)


@pytest.mark.parametrize("pp,dp,cp,tp,ep", [(1, 4, 1, 2, 2), (2, 8, 2, 1, 4), (1, 8, 1, 1, 8)])
def test_ep_groups_are_the_mesh_ones(pp, dp, cp, tp, ep):
    shape = (pp, dp, cp, tp)
    mesh = ep_group_ranks(MeshSizes(pp, dp, cp, tp, ep=ep))
    assert sorted(map(sorted, ep_groups(shape, ep))) == sorted(map(sorted, mesh))


def test_ep_link_inside_and_across_nodes():
    h100 = load_cluster("h100")  # 8 GPUs per node
    assert ep_link(h100, (1, 8, 1, 1), 8).bandwidth == h100.nvlink.bandwidth
    across = ep_link(h100, (1, 2, 1, 8), 2)  # dp ranks 8 apart: different nodes
    assert across.bandwidth < h100.nvlink.bandwidth
    assert across.bandwidth == pytest.approx(h100.network(1).bandwidth)


def test_all_to_all_leaves_the_node_through_each_members_own_nic():
    """Llama 4 Maverick's mesh (dgxc-benchmarking v25.05): tp 4, ep 128 over dp 128, so two
    members of each ep group per node. A ring of such a group would get two NICs (group_link);
    each all-to-all member sends its own 126/128 of its rows off the node through one."""
    h100 = load_cluster("h100")
    shape = (1, 128, 1, 4)
    link = ep_link(h100, shape, 128)
    nbytes = 2048 * 5120 * 2  # one rank's rows: 8192 / tp tokens of d 5120 in bf16
    off_node = 126 / 128 * nbytes / h100.network(1).bandwidth
    assert all_to_all_time(nbytes, 128, link) == pytest.approx(127 * link.latency + off_node)
    ring = group_link(h100, shape, ("dp",))
    assert ring.bandwidth == pytest.approx(2 * h100.network(1).bandwidth)
    assert link.bandwidth < 0.6 * ring.bandwidth


def _cfg(*extra):
    return load_config(TINY, [*MOE, *extra])


def test_moe_layer_pays_dispatch_and_combine_both_ways():
    h100 = load_cluster("h100")
    dense = CostModel(_cfg("parallel.dp=8"), h100, MEGAPIPE, CALIBRATION)
    cfg = _cfg("parallel.dp=8", "parallel.ep=8")
    ep = CostModel(cfg, h100, MEGAPIPE, CALIBRATION)
    layer = ep.layer("none", None, moe=True)
    rows = cfg.derived.micro_batch_size * cfg.model.seq_len * cfg.model.top_k
    one = all_to_all_time(rows * cfg.model.d_model * ep.c, 8, ep.ep_link)
    assert layer.F.ep == pytest.approx(2 * one) and layer.B.ep == pytest.approx(2 * one)
    assert layer.W.ep == 0 and dense.layer("none", None, moe=True).F.ep == 0
    assert ep.layer("full", None, moe=True).B.ep == pytest.approx(4 * one)  # F again
    assert ep.layer("none", None, moe=False).F.ep == 0


def test_shared_experts_overlap_the_all_to_alls_where_the_runtime_does():
    """Megatron-Core's --moe-shared-expert-overlap: the shared expert's GEMMs on a side stream
    beside dispatch and combine; each direction hides at most its all-to-alls."""
    h100 = load_cluster("h100")
    cfg = _cfg("parallel.dp=8", "parallel.ep=8", "model.moe_shared_experts=1")
    inline = CostModel(cfg, h100, MEGAPIPE, CALIBRATION)
    side = CostModel(cfg, h100, dataclasses.replace(MEGAPIPE, moe_shared_expert_overlap=True),
                     CALIBRATION)  # fmt: skip
    a, b = inline.layer("none", None, moe=True), side.layer("none", None, moe=True)
    x, dev, c = shapes(cfg, None), inline.dev, inline.c
    m, n, k = inline.gemm_shapes(x, True)[-1]  # the shared expert's fc2
    assert (m, k) == (x.n, cfg.derived.d_ff)
    shared_f = sum(dev.gemm(m, n, k, 1, c) for m, n, k in inline.gemm_shapes(x, True)[-2:])
    assert b.F.ep == pytest.approx(max(0.0, a.F.ep - shared_f))
    assert 0 <= b.B.ep < a.B.ep and b.F.compute == a.F.compute and b.W == a.W
    no_shared = _cfg("parallel.dp=8", "parallel.ep=8")
    plain = CostModel(no_shared, h100, side.rt, CALIBRATION).layer("none", None, moe=True)
    assert (
        plain.F.ep
        == CostModel(no_shared, h100, MEGAPIPE, CALIBRATION).layer("none", None, moe=True).F.ep
    )


def test_projection_reports_the_all_to_all():
    h100 = load_cluster("h100")
    out = project(_cfg("parallel.dp=8", "parallel.ep=8"), h100, memory=False)
    none = project(_cfg("parallel.dp=8"), h100, memory=False)
    assert out.breakdown["ep_comm_s"] > 0 and none.breakdown["ep_comm_s"] == 0


def test_planner_space_holds_ep_for_a_mixture_of_experts():
    from megapipe.perf.space import candidates

    moe = {c.ep for c in candidates(_cfg(), 16, 8, {"parallel.tp": 1, "parallel.cp": 1})}
    assert moe == {1, 2, 4, 8}  # divisors of dp (up to 16) that divide 8 experts
    dense = load_config(TINY, [])
    assert {c.ep for c in candidates(dense, 16, 8)} == {1}


def test_memory_model_holds_e_over_ep_experts():
    from megapipe.train.meta_memory import chunk_params

    blocks = range(0, 6)
    one, four = (chunk_params(_cfg("parallel.dp=8", f"parallel.ep={ep}"), blocks, 0)
                 for ep in (1, 4))  # fmt: skip
    m, f = _cfg().model, _cfg().derived.d_ff
    expert = 2 * f * m.d_model + f + m.d_model  # gpt2: w_in, w_out and their biases
    assert one - four == m.n_layers * (m.n_experts - m.n_experts // 4) * expert


def test_expert_grads_reduce_over_the_expert_replicas():
    """dp 8, ep 4: the routed experts' grads ring over their 2 replicas, the rest over 8."""
    from megapipe.config.flops import held_expert_params
    from megapipe.perf.comm import expert_replica_groups, expert_replica_link, group_link, ring_time
    from megapipe.perf.data_parallel import dp_plan

    h100 = load_cluster("h100")
    assert sorted(map(sorted, expert_replica_groups((1, 8, 1, 2), 4)))[:2] == [[0, 8], [1, 9]]
    across = expert_replica_link(h100, (1, 8, 1, 2), 4)  # ranks 8 apart: one GPU per node
    assert across.bandwidth == h100.network(1).bandwidth
    shape = (1, 8, 1, 1)
    assert sorted(map(sorted, expert_replica_groups(shape, 4))) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cfg = _cfg("parallel.dp=8", "parallel.ep=4", "parallel.zero=1")
    blocks = range(0, cfg.model.n_layers + 2)
    experts = held_expert_params(cfg, blocks)
    f, d = cfg.derived.d_ff, cfg.model.d_model
    assert experts == cfg.model.n_layers * (8 // 4) * (2 * f * d + f + d)  # gpt2: with biases
    params = experts + 10_000_000
    one = dataclasses.replace(MEGAPIPE, dp_bucket_mb=0, dp_bucket_params=0)  # one buffer
    plan = dp_plan(cfg, h100, one, shape, [[params]], 4, [[experts]])
    dense = ring_time("reduce_scatter", 4 * 10_000_000, 8, group_link(h100, shape, ("dp", "cp")))
    routed = ring_time("reduce_scatter", 4 * experts, 2, expert_replica_link(h100, shape, 4))
    assert plan.total[0] == pytest.approx(dense + routed)
    whole = dp_plan(cfg, h100, one, shape, [[params]], 4).total[0]  # all over dp × cp
    assert plan.total[0] < whole  # one node: 1/2 of the expert bytes cross, not 7/8


def test_zero1_shards_expert_optimizer_state_over_the_expert_replicas():
    """zero=1 over dp 8 with ep 4: AdamW's state and the reduced shards of the routed experts
    are 1/2 per rank, the rest 1/8 (parallel/data/zero.py shards expert buckets over the
    expert replicas)."""
    from megapipe.config.flops import held_expert_params
    from megapipe.config.states import optimizer_bytes, reduction_bytes
    from megapipe.train.meta_memory import chunk_params, memory_plan

    cfg = _cfg("parallel.dp=8", "parallel.ep=4", "parallel.zero=1")
    blocks = range(0, cfg.model.n_layers + 2)
    n, e = chunk_params(cfg, blocks, 0), held_expert_params(cfg, blocks)
    assert 0 < e < n
    want = 8 * (-(-(n - e) // 8)) + 8 * (-(-e // 2))  # float32 weights: AdamW moments, 8 B
    assert optimizer_bytes(n, cfg, e) == want
    assert memory_plan(cfg, "cpu").rank(0).optimizer == want
    # the bf16 reduce-scatter's shards beside the kept float32 grads (under a float32 one the
    # grads are dropped as copied and the reduction peaks as the last bucket is copied,
    # before its shard exists: states.packing_bytes)
    cfg.parallel.grad_reduce_dtype = "bfloat16"
    assert reduction_bytes(n, cfg, e) - reduction_bytes(n, cfg) == pytest.approx(
        2 * (e / 2 - e / 8), rel=1e-6
    )


def test_local_experts_loop_unless_grouped():
    """8 experts over ep 2: 4 local experts, each a GEMM of a quarter of the rows (ours, and
    Megatron-Core without --moe-grouped-gemm), or one grouped GEMM of them all."""
    h100, cfg = load_cluster("h100"), _cfg("parallel.dp=2", "parallel.ep=2")
    loop = CostModel(cfg, h100, MEGAPIPE, CALIBRATION)
    grouped = CostModel(cfg, h100, dataclasses.replace(MEGAPIPE, moe_grouped_gemm=True),
                        CALIBRATION)  # fmt: skip
    x = shapes(cfg, None)
    assert loop._gemm_batches(5, True) == [1, 1, 1, 4, 4]
    assert grouped._gemm_batches(5, True) == [1] * 5 and loop._gemm_batches(4, False) == [1] * 4
    assert loop.gemm_shapes(x, True)[3][0] * 4 == grouped.gemm_shapes(x, True)[3][0]
    # the same FLOPs in smaller GEMMs: no faster
    assert (
        loop.layer("none", None, moe=True).F.compute
        >= grouped.layer("none", None, moe=True).F.compute
    )


def test_expert_tp_splits_experts_and_gathers_rows():
    """Megatron-Core <= 0.9 (moe_expert_tp): experts at width f/tp on the tp group's rows, with
    a tp all-gather and reduce-scatter of those rows each way."""
    from megapipe.perf.comm import ring_time

    h100 = load_cluster("h100")
    cfg = _cfg("parallel.dp=2", "parallel.ep=2", "parallel.tp=4", "parallel.sequence_parallel=true")
    whole = CostModel(cfg, h100, MEGAPIPE, CALIBRATION)
    split = CostModel(cfg, h100, dataclasses.replace(MEGAPIPE, moe_expert_tp=True), CALIBRATION)
    x = shapes(cfg, None)
    (_, wn, _), (sm, sn, _) = whole.gemm_shapes(x, True)[3], split.gemm_shapes(x, True)[3]
    assert sn * 4 == wn and sm == 4 * whole.gemm_shapes(x, True)[3][0]
    rows = whole._moe_tokens(x) * cfg.model.top_k * 4
    nbytes = rows * cfg.model.d_model * split.c
    link = split.tp_link
    want = ring_time("all_gather", nbytes, 4, link) + ring_time("reduce_scatter", nbytes, 4, link)
    assert split._expert_tp(x, True) == pytest.approx(want) and whole._expert_tp(x, True) == 0
    diff = split.layer("none", None, moe=True).F.tp - whole.layer("none", None, moe=True).F.tp
    assert diff == pytest.approx(want)


def test_zero3_gathers_experts_over_their_replicas():
    """zero=3 over dp 8 with ep 4: each microbatch's two weight all-gathers move the routed
    experts over their 2 replicas and the rest over dp 8 (parallel/data/zero3.py); beside them
    the first microbatch's reduction (zero=3 reduces every microbatch, the last one's is the
    step's `chunk`)."""
    from megapipe.config.flops import held_expert_params
    from megapipe.perf.comm import expert_replica_link, group_link, ring_time
    from megapipe.perf.data_parallel import dp_plan

    h100, shape = load_cluster("h100"), (1, 8, 1, 1)
    cfg = _cfg("parallel.dp=8", "parallel.ep=4", "parallel.zero=3", "parallel.microbatches=2")
    experts = held_expert_params(cfg, range(0, cfg.model.n_layers + 2))
    params = experts + 10_000_000
    plan = dp_plan(cfg, h100, MEGAPIPE, shape, [[params]], 4, [[experts]])
    pb = 4  # float32 weights
    dense = ring_time("all_gather", pb * 10_000_000, 8, group_link(h100, shape, ("dp", "cp")))
    routed = ring_time("all_gather", pb * experts, 2, expert_replica_link(h100, shape, 4))
    assert plan.per_microbatch[0] == pytest.approx(2 * 2 * (dense + routed) + plan.chunk[0][0])
    whole = dp_plan(cfg, h100, MEGAPIPE, shape, [[params]], 4).per_microbatch[0]
    assert plan.per_microbatch[0] < whole  # 1/2 of the expert bytes cross, not 7/8


def test_dry_run_names_the_expert_state_layout():
    """The dry run's MoE line gives the routed experts' ZeRO layout over their replicas."""
    from megapipe.train.dry_run import describe

    text = describe(_cfg("parallel.dp=8", "parallel.ep=4", "parallel.zero=3"))
    assert "1/4 held per rank; their states 16/d B/param, d=2 over the expert replicas" in text
    alone = describe(_cfg("parallel.dp=4", "parallel.ep=4", "parallel.zero=2"))
    assert "their states 16 B/param whole: one rank holds each expert" in alone
    assert "their states" not in describe(_cfg("parallel.dp=8", "parallel.ep=4"))
