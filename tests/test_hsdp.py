"""HSDP (parallel.dp_shard) in the config and the models, no process group: its one-line errors,
the state bytes over the shard group (config/states.py), the two-level reduction's bytes and
time (config/comm_bytes.py, perf/data_parallel.py) and the planner's choices (perf/space.py).
Parity with one process is tests/test_zero23.py's (with experts, test_parity_ep.py's); resuming
across S, tests/test_reshard.py's; the code's bytes against the plan's,
tests/test_fake_ranks.py's; the groups, test_mesh.py's."""

from __future__ import annotations

import pytest

from megapipe.config import ConfigError, load_config
from megapipe.config.comm_bytes import rank_comm_bytes
from megapipe.config.states import expert_replicas, replicas, shard_copies, state_layout
from megapipe.distributed.mesh import MeshSizes
from megapipe.perf import load_cluster
from megapipe.perf.comm import hsdp_groups
from megapipe.perf.data_parallel import dp_plan
from megapipe.perf.software import RUNTIMES
from megapipe.perf.space import ZEROS, candidates, dp_shards
from tests.conftest import TINY

DP8 = ["parallel.dp=8", "parallel.zero=3", "train.global_batch=8"]


def cfg_of(tmp_path, *overrides: str):
    return load_config(TINY, [f"run.dir={tmp_path}", *overrides])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["parallel.dp=4", "parallel.zero=1", "parallel.dp_shard=3"], "does not divide"),
        (["parallel.dp=4", "parallel.dp_shard=2"], r"parallel.zero=0: .*parallel.zero>=1"),
        (
            [
                "parallel.dp=4",
                "parallel.zero=1",
                "parallel.dp_shard=2",
                "parallel.ep=4",
                "model.n_experts=4",
            ],  # fmt: skip
            "multiple of ep",
        ),
    ],
)
def test_refused_dp_shard_is_one_line(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        cfg_of(tmp_path, *overrides)
    assert "\n" not in str(err.value) and "parallel.dp_shard" in str(err.value)


def test_dp_shard_equal_to_dp_is_plain_zero(tmp_path):
    """0 and dp are one mesh (a checkpoint's resume sees no change) and one layout."""
    a, b = (cfg_of(tmp_path, *DP8, f"parallel.dp_shard={s}") for s in (0, 8))
    assert MeshSizes.of(a) == MeshSizes.of(b) and MeshSizes.of(a).dp_shard == 0
    assert state_layout(a) == state_layout(b) and shard_copies(a) == 1


def test_state_is_sharded_over_the_shard_group(tmp_path):
    """d = dp_shard · cp, not dp · cp; the routed experts' dp_shard/ep · cp."""
    cfg = cfg_of(tmp_path, *DP8, "parallel.dp_shard=2", "parallel.cp=2")
    assert replicas(cfg) == 4 and shard_copies(cfg) == 4 and state_layout(cfg).d == 4
    moe = cfg_of(tmp_path, *DP8, "parallel.dp_shard=4", "parallel.ep=2", "model.n_experts=4")
    assert expert_replicas(moe) == 2 and state_layout(moe).weight_shards == 4


def test_dp_bytes_are_the_two_level_reduction(tmp_path):
    """zero=1 of P parameters: a reduce-scatter of 4P over the shard group, the all-reduce of
    its 4P/S shard over the dp/S replicas, the gather of the 4P weights' 1/S shard."""
    base = ["parallel.dp=8", "parallel.zero=1", "train.global_batch=8"]
    plain, hsdp = cfg_of(tmp_path, *base), cfg_of(tmp_path, *base, "parallel.dp_shard=2")
    params = 1000

    def dp_bytes(cfg):
        return rank_comm_bytes(cfg, 0, 0, lambda blocks, tp: params)["dp"]

    loss = 8.0 + 4.0  # the step's float64 loss and float32 grad-norm sum, over dp (the world)
    assert dp_bytes(hsdp) == pytest.approx(loss + 4 * params + 4 * params / 2 + 4 * params / 2)
    assert dp_bytes(plain) == pytest.approx(loss + 4 * params + 4 * params / 8)


def test_dp_bytes_follow_grad_reduce_dtype(tmp_path):
    """parallel.grad_reduce_dtype=bfloat16 sends 2 bytes a grad element in the reduce-scatter
    and the replicas' all-reduce (parallel/data/zero.py), the weights' gather unchanged."""
    base = ["parallel.dp=8", "parallel.zero=1", "train.global_batch=8", "parallel.dp_shard=2"]
    bf16 = cfg_of(tmp_path, *base, "parallel.grad_reduce_dtype=bfloat16")
    params = 1000
    got = rank_comm_bytes(bf16, 0, 0, lambda blocks, tp: params)["dp"]
    assert got == pytest.approx(8.0 + 4.0 + 2 * params + 2 * params / 2 + 4 * params / 2)


def test_priced_on_the_shard_and_replicate_links(tmp_path):
    """The shard groups (2 dp ranks, one node) and replicate groups (4, across nodes) the mesh
    makes; the reduction's time adds the shard's all-reduce on the slower link."""
    shard, _, across = hsdp_groups((1, 8, 1, 1), 2)
    assert shard[:2] == [[0, 1], [2, 3]] and across[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    cluster, rt = load_cluster("h100", 2), RUNTIMES["megapipe"]
    base = ["parallel.dp=8", "parallel.zero=1", "train.global_batch=8"]
    plain, hsdp = cfg_of(tmp_path, *base), cfg_of(tmp_path, *base, "parallel.dp_shard=2")
    times = [dp_plan(c, cluster, rt, (1, 8, 1, 1), [[1e9]], 4).total[0] for c in (plain, hsdp)]
    assert all(t > 0 for t in times) and times[0] != times[1]
    # in bf16 (parallel.grad_reduce_dtype) both levels carry 2-byte grads in the same buckets
    bf16 = cfg_of(tmp_path, *base, "parallel.dp_shard=2", "parallel.grad_reduce_dtype=bfloat16")
    narrow = dp_plan(hsdp, cluster, rt, (1, 8, 1, 1), [[1e9]], 2).total[0]
    got = dp_plan(bf16, cluster, rt, (1, 8, 1, 1), [[1e9]], 4).total[0]
    assert got == pytest.approx(narrow, rel=1e-12) and got < times[1]


def test_planner_keeps_grad_reduce_dtype_where_grads_are_sharded(tmp_path):
    """A candidate reduces in the config's parallel.grad_reduce_dtype under zero >= 1; zero=0
    (which all-reduces float32, config/checks_runtime.py) stays a valid candidate."""
    cfg = cfg_of(
        tmp_path, "parallel.dp=2", "parallel.zero=1", "parallel.grad_reduce_dtype=bfloat16"
    )
    space = candidates(cfg, 8, 8, {"parallel.tp": 1, "parallel.cp": 1, "parallel.pp": 1})
    made = {c.zero: c.config(cfg).parallel.grad_reduce_dtype for c in space}
    assert made == {0: "float32", **{z: "bfloat16" for z in ZEROS if z}}


def test_planner_tries_all_of_dp_and_one_node():
    assert dp_shards(16, 1, 2, 8, {}) == [0, 4]  # tp·cp 2: 4 dp ranks fill a node of 8
    assert dp_shards(16, 0, 2, 8, {}) == [0]  # nothing sharded at zero=0
    assert dp_shards(4, 1, 2, 8, {}) == [0]  # dp fits in the node: no replicas needed
    assert dp_shards(16, 1, 3, 8, {}) == [0]  # tp·cp does not tile the node
    assert dp_shards(16, 1, 1, 8, {"parallel.dp_shard": 2}) == [2]
