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
        ("dp2-pp2-dualpipe-clip", 2, 1, [*ZERO, *pp("dualpipe", 2, 4, 2), *CLIP]),
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
        (
            ["parallel.zero=2", "parallel.dp=2", *pp("dualpipe", 2, 4, 2)],
            r"parallel.zero=2 with parallel.schedule=dualpipe: .*set parallel.zero=0 or 1",
        ),
        (
            ["parallel.zero=3", *pp("seq1f1b", 2, 2), "parallel.seq_segments=2"],
            r"parallel.zero=3 with parallel.schedule=seq1f1b: .*set parallel.zero<=2",
        ),
        (
            ["parallel.zero=3", "train.compile=true"],
            r"parallel.zero=3 with train.compile=true: .*set train.compile=false",
        ),
        (
            [
                "parallel.zero=2",
                "parallel.dp=2",
                *pp("1f1b", 2, 2),
                "parallel.post_validation=true",
            ],
            r"parallel.post_validation=true with parallel.zero=2 is not supported",
        ),
    ],
)
def test_refused_zero_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)


COMMON = ["train.steps=4", "train.warmup=1", "log.progress=false", "model.dropout=0.0"]
CHECKPOINT_MESHES = {
    "dp2-tp2-sp-v97": ["parallel.dp=2", "parallel.tp=2", *SP, "model.vocab_size=97"],
    "dp2-pp2-1f1b-tied": ["parallel.dp=2", *pp("1f1b", 2, 2)],
    "dp2-tp2-gqa-kv": ["parallel.dp=2", "parallel.tp=2", *GQA2, "model.n_kv_heads=1"],
}


def cross_resume_case(overrides: list[str], root: str, first: int, then: int) -> dict:
    """4 steps straight at zero=`then`; and 2 steps at zero=`first`, a checkpoint, 2 more at
    zero=`then` resumed from it. The per-step losses of both."""
    import train

    def run(zero, where, *extra):
        cfg = tiny_config([*overrides, f"parallel.zero={zero}", *extra], f"{root}/{where}")
        return [r["loss"] for r in train.run(cfg)]

    full = run(then, "full", "checkpoint.resume=none")
    split = run(first, "split", "train.stop_at_step=2") + run(then, "split")
    return {"full": full, "split": split}


@pytest.mark.parametrize("name", list(CHECKPOINT_MESHES))
@pytest.mark.parametrize("first,then", [(1, 1), (1, 0), (0, 1)])
def test_zero_checkpoints_cross_load(gloo_pool, tmp_path, name, first, then):
    """A zero=1 checkpoint resumes a zero=0 run of the same mesh and the reverse, with the
    losses of an uninterrupted run; zero=1 to zero=1 bit for bit. (The two settings sum
    gradients in different orders, so across them the bar is relative 1e-6.)"""
    overrides = [*COMMON, *CHECKPOINT_MESHES[name]]
    (got, *_) = gloo_pool(4).run(cross_resume_case, overrides, str(tmp_path), first, then)
    if first == then:
        assert got["split"] == got["full"]
    for step, (a, b) in enumerate(zip(got["split"], got["full"])):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: resumed {a} != straight {b}"


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 6), (1, 9), (3, 2, 4), (2, 3, 1, 2)])
def test_flat_range_as_rectangles_covers_it_once(shape):
    """Every flat range of a row-major tensor is covered, once and in order, by its blocks."""
    import math

    import torch

    from megapipe.train.checkpoint_zero import flat_blocks

    n = math.prod(shape)
    whole = torch.arange(n).view(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            seen = []
            for offsets, sizes, start in flat_blocks(shape, lo, hi):
                block = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert start == len(seen)
                seen += block.flatten().tolist()
            assert seen == list(range(lo, hi)), (lo, hi)


def test_zero1_without_replicas_runs_as_zero0(tmp_path):
    """dp·cp = 1 leaves nothing to shard: zero=1 builds the plain optimizer and trains the
    same steps as zero=0 (docs/parallelism.md, "Memory")."""
    import torch

    from megapipe.parallel.data.zero import ShardedOptimizer
    from megapipe.train.parallelize import parallelize

    runs = {z: train_case([f"parallel.zero={z}", "train.grad_clip=0.05"], 2) for z in (0, 1)}
    assert runs[1]["losses"] == runs[0]["losses"]
    for name, value in runs[0]["weights"].items():
        assert torch.equal(runs[1]["weights"][name], value), name
    job = parallelize(tiny_config(["parallel.zero=1"], str(tmp_path)), None)
    assert not isinstance(job.optimizer(), ShardedOptimizer)
