"""The distributed optimizer (parallel.zero=1, parallel/data/zero.py): under every mesh kind it
trains the same model as one process (loss, grad norm and final logical weights, relative 1e-5),
and each replica holds 1/(dp·cp) of the AdamW state.

The parity checks are those of the dp × tp, pipeline and context-parallel suites, run with
parallel.zero=1; gradient clipping is active in the `clip` cases (a small train.grad_clip).
"""

import pytest

from megapipe.config import ConfigError
from tests import test_parity_cp, test_parity_pp, test_parity_tp_dp
from tests.parity import mesh_params, tiny_config, train_case
from tests.test_parity_pp import pp

ZERO = ["parallel.zero=1"]
MB2 = ["parallel.microbatches=2"]
SP = ["parallel.sequence_parallel=true"]
CLIP = ["train.grad_clip=0.05"]  # the tiny model's grad norm is ~1: every step clips
B12 = ["train.global_batch=12"]
GQA2 = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64", "model.n_kv_heads=2"]

PLAIN = {  # world -> [(id, dp, tp, overrides)]: no pipeline, no cp
    2: [("dp2", 2, 1, [*ZERO, *MB2]), ("dp2-clip", 2, 1, [*ZERO, *MB2, *CLIP])],
    4: [
        ("dp4", 4, 1, [*ZERO, *MB2]),
        ("dp2-tp2-sp", 2, 2, [*ZERO, *SP, *MB2]),
        ("dp2-tp2-gqa-sp-clip", 2, 2, [*ZERO, *GQA2, *SP, *CLIP]),
    ],
}
PIPELINE = {
    4: [
        ("dp2-pp2-zb_v", 2, 1, [*ZERO, *pp("zb_v", 2, 2, 2)]),
        ("dp2-pp2-interleaved-clip", 2, 1, [*ZERO, *pp("interleaved_1f1b", 2, 2, 2), *CLIP]),
        ("dp2-pp2-zb_h2-m3", 2, 1, [*ZERO, *pp("zb_h2", 2, 3), *B12]),
    ],
    8: [("dp2-pp2-tp2-zb_v-gqa-sp", 2, 2, [*ZERO, *pp("zb_v", 2, 2, 2), *GQA2, *SP])],
}
CONTEXT = {
    4: [
        ("dp2-cp2", 2, 1, [*ZERO, "parallel.cp=2", *MB2]),
        ("cp2-pp2-1f1b-clip", 1, 1, [*ZERO, "parallel.cp=2", *pp("1f1b", 2, 2), *CLIP]),
    ],
}


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(PLAIN))
def test_zero1_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    test_parity_tp_dp.check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(PIPELINE))
def test_zero1_pipeline_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    test_parity_pp.check_parity(gloo_pool, world, dp, tp, extra)


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CONTEXT))
def test_zero1_context_parallel_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    test_parity_cp.check_parity(gloo_pool, world, dp, tp, extra)


SPLIT = {  # world -> [(id, dp, tp, overrides)]: R = dp·cp replicas share the state
    2: [("dp2", 2, 1, [])],
    4: [("dp4", 4, 1, []), ("dp2-cp2", 2, 1, ["parallel.cp=2"]), ("dp2-tp2", 2, 2, [])],
}


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(SPLIT))
def test_zero1_replica_holds_its_share_of_the_state(gloo_pool, world, dp, tp, extra):
    """Each replica's AdamW bytes are 1/R of the zero=0 bytes up to bucket padding: a bucket
    of n elements gives each of the R ranks at most ceil(n/R) of them, so a rank is off by less
    than 8 B (two float32 moments) per bucket; over the R replicas they add up exactly."""
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    zero0 = gloo_pool(world).run(train_case, [*extra, *mesh], 1)
    zero1 = gloo_pool(world).run(train_case, [*extra, *mesh, *ZERO], 1)
    replicas = world // tp
    for full, got in zip(zero0, zero1):
        assert abs(got["optim_bytes"] - full["optim_bytes"] / replicas) < 8 * got["buckets"]
    for tp_rank in range(tp):
        shares = [r["optim_bytes"] for r in zero1[tp_rank::tp]]
        assert sum(shares) == zero0[tp_rank]["optim_bytes"], shares


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            [*ZERO, "parallel.dp=2", *pp("pipedream_async", 2, 2), "model.tie_embeddings=false"],
            r"parallel.zero=1 with parallel.schedule=pipedream_async: .*set parallel.zero=0",
        ),
        (["parallel.zero=2"], r"parallel.zero"),
    ],
)
def test_refused_zero_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)
