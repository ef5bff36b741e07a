"""Resume on any mesh: a checkpoint written under one mesh continues under another and trains
the same model as the one-process run that never stopped (losses to relative 1e-5, dropout 0).

Every pair saves after step 2 of 4 under its first mesh and resumes under the second. Saves run
grouped by world size (one fixture), then resumes (pairs ordered by world size), so each gloo
world spawns about once. A world of 1 runs in the pytest process.
"""

import os

import pytest

from tests.parity import LOW_LR, tiny_config

COMMON = [
    "train.steps=4",
    "train.warmup=1",
    "log.progress=false",
    "model.dropout=0.0",
    "model.n_layers=4",
    LOW_LR,  # ring attention's merge reorders float32 sums (tests/parity.py)
]
LLAMA_KV1 = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
LLAMA_KV1 += ["model.n_kv_heads=1"]
MOE = ["model.n_experts=4", "model.top_k=2"]


def mesh(dp=1, tp=1, pp=1, cp=1, **more) -> tuple[int, list[str]]:
    """(world size, overrides) of a mesh; `more` as key=value under parallel."""
    out = [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}"]
    return dp * tp * pp * cp, out + [f"parallel.{k}={v}" for k, v in more.items()]


SP = {"sequence_parallel": "true"}
MUON = [*LLAMA_KV1[:3], "model.n_kv_heads=2", "train.optimizer=muon"]
PAIRS = {  # id -> (saved under, resumed under, model overrides)
    "dp2-to-1": (mesh(dp=2), mesh(), []),
    "1-to-tp2-sp": (mesh(), mesh(tp=2, **SP), []),
    "tp2-to-pp2-zb_v": (mesh(tp=2), mesh(pp=2, vpp=2, schedule="zb_v", microbatches=2), []),
    "pp2-v_min-to-tp2": (mesh(pp=2, vpp=2, schedule="v_min", microbatches=4), mesh(tp=2), []),
    "dp2-to-pp2-v_half": (mesh(dp=2), mesh(pp=2, vpp=2, schedule="v_half", microbatches=4), []),
    "pp4-1f1b-to-dp2-tp2": (mesh(pp=4, microbatches=4), mesh(dp=2, tp=2), []),
    "pp2-dualpipe-to-dp2": (mesh(pp=2, vpp=2, schedule="dualpipe", microbatches=4), mesh(dp=2), []),
    "pp2-dualpipe_v-to-tp2": (
        mesh(pp=2, vpp=2, schedule="dualpipe_v", microbatches=4),
        mesh(tp=2),
        [],
    ),
    # HSDP both ways (parallel.dp_shard): into shard groups of 2 with replicas, and from them
    # (each shard's moments written once, by its first replica; the experts' too) into plain dp
    "dp2-cp2-to-hsdp-dp4-shard2-zero2": (mesh(dp=2, cp=2), mesh(dp=4, zero=2, dp_shard=2), []),
    "hsdp-zero1-dp4-shard2-ep2-to-zero0-dp2-ep2": (
        mesh(dp=4, zero=1, dp_shard=2, ep=2),
        mesh(dp=2, ep=2),
        MOE,
    ),
    "interleaved-vpp2-to-vpp1": (
        mesh(pp=2, vpp=2, schedule="interleaved_1f1b", microbatches=2),
        mesh(pp=2, microbatches=2),
        [],
    ),
    "llama-gqa-tp2-kv-replicated-to-tp1": (mesh(tp=2), mesh(), LLAMA_KV1),
    "tp2-zero0-to-dp2-tp2-zero1": (mesh(tp=2), mesh(dp=2, tp=2, zero=1, **SP), []),
    # Muon's momentum buffers, tp shards of fused q | k | v, resumed whole on other stages
    "muon-llama-tp2-to-dp2-pp2": (mesh(tp=2), mesh(dp=2, pp=2, microbatches=2), MUON),
    # under ZeRO each buffer is whole on its owner (train/muon_zero.py): written as one block,
    # read by another deal of owners (HSDP: in each shard group), or whole on one process
    "muon-zero1-dp2-to-hsdp-zero3-dp4-shard2": (
        mesh(dp=2, zero=1),
        mesh(dp=4, zero=3, dp_shard=2),
        MUON,
    ),
    "muon-zero1-dp2-to-1": (mesh(dp=2, zero=1), mesh(), MUON),
}


def save_case(overrides: list[str], run_dir: str) -> None:
    import train

    train.run(tiny_config([*overrides, "train.stop_at_step=2"], run_dir))


def resume_case(overrides: list[str], run_dir: str) -> list[float]:
    """The losses of the steps after the checkpoint, and whether the load resharded."""
    import train

    return [r["loss"] for r in train.run(tiny_config(overrides, run_dir))]


def _on(pool_of, world: int, fn, *args) -> list:
    if world == 1:
        return [fn(*args)]
    return pool_of(world).run(fn, *args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{pair id: run dir holding its step-2 checkpoint}, saves grouped by world size."""
    from tests.parity import Pools

    pools, root, out = Pools(), tmp_path_factory.mktemp("reshard"), {}
    try:
        for name, ((world, first), _, model) in sorted(PAIRS.items(), key=lambda p: p[1][0][0]):
            out[name] = str(root / name)
            _on(pools, world, save_case, [*COMMON, *model, *first], out[name])
    finally:
        pools.close()
    return out


_uninterrupted = {}


def uninterrupted(model: tuple[str, ...]) -> list[float]:
    """The one-process run of all 4 steps."""
    import tempfile

    import train

    if model not in _uninterrupted:
        cfg = tiny_config([*COMMON, *model], tempfile.mkdtemp())
        _uninterrupted[model] = [r["loss"] for r in train.run(cfg)]
    return _uninterrupted[model]


ORDER = sorted(PAIRS, key=lambda name: PAIRS[name][1][0])  # resumes grouped by world size


@pytest.mark.spawn
@pytest.mark.parametrize("name", ORDER)
def test_resume_on_another_mesh_continues_the_one_process_run(gloo_pool, saved, name):
    _, (world, then), model = PAIRS[name]
    assert os.path.isdir(os.path.join(saved[name], "checkpoints"))
    (losses, *_) = _on(gloo_pool, world, resume_case, [*COMMON, *model, *then], saved[name])
    expected = uninterrupted(tuple(model))[2:]
    assert len(losses) == len(expected) == 2
    for step, (a, b) in enumerate(zip(losses, expected), start=3):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: resumed {a} != uninterrupted {b}"


@pytest.mark.parametrize(
    "change,key",
    [
        ("model.n_layers=3", "model.n_layers=2"),
        ("train.global_batch=16", "train.global_batch=8"),
        ("model.d_ff=96", "model.d_ff"),
    ],
)
def test_changed_model_or_batch_is_one_line_error(tmp_path, change, key):
    """What a resume cannot change is named in one line: the model, tokenizer, global batch."""
    import train
    from megapipe.train.checkpoint import CheckpointError

    base = ["train.steps=2", "log.progress=false"]
    train.run(tiny_config([*base, "train.stop_at_step=1"], str(tmp_path)))
    with pytest.raises(CheckpointError, match=key) as err:
        train.run(tiny_config([*base, change], str(tmp_path)))
    assert "\n" not in str(err.value) and "start a new run.dir" in str(err.value)


def read_case(overrides: list[str], run_dir: str) -> dict:
    """Load the newest checkpoint of `run_dir` under `overrides`: bytes this rank read, and
    the bytes of every saved chunk."""
    from megapipe.distributed.launch import init_distributed
    from megapipe.train import checkpoint
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(overrides, run_dir)
    job = parallelize(cfg, init_distributed(cfg))
    path = checkpoint.resume_path(cfg)
    meta = checkpoint.load(path, cfg, job.model, job.optimizer())
    files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    held = sum(3 * p.numel() * p.element_size() for p in job.model.parameters())
    return {
        "read": meta["bytes_read"],
        "held": held,
        "saved": sum(os.path.getsize(f"{path}/{f}") for f in files),
    }


@pytest.mark.spawn
def test_each_rank_reads_only_the_chunks_of_its_shard(tmp_path):
    """Saved under tp=4, a tp=4 rank reads its quarter of the sharded tensors (plus the small
    replicated norms and biases), and a dp=2 × tp=2 zero=1 rank the weights of its tp half and
    the moments of its dp half of those: no rank reads the whole checkpoint, as the old load of
    whole logical tensors did (it read 100%)."""
    from tests.parity import Pools

    common = ["train.steps=2", "log.progress=false", "model.vocab_size=1024"]
    common += ["model.d_model=128"]
    pools = Pools()
    try:
        pools(4).run(save_case, [*common, "parallel.tp=4"], str(tmp_path))
        same = pools(4).run(read_case, [*common, "parallel.tp=4"], str(tmp_path))
        other = pools(4).run(
            read_case, [*common, "parallel.dp=2", "parallel.tp=2", "parallel.zero=1"], str(tmp_path)
        )
    finally:
        pools.close()
    save_case(common, str(tmp_path / "whole"))  # one process: every tensor saved whole
    try:  # a tp=2 rank needs half of each matrix: it reads each saved tensor once (a fused
        # q|k|v matrix holds three of its blocks: read once, not three times), no more
        halves = pools(2).run(read_case, [*common, "parallel.tp=2"], str(tmp_path / "whole"))
    finally:
        pools.close()
    for got in halves:
        assert got["saved"] * 0.5 < got["read"] <= got["saved"], got
    saved = same[0]["saved"]  # (~1.5 kB of framing per saved chunk: measured 1/4 is 27%)
    for got in same:  # about what the rank holds: weights and both moments
        assert got["read"] < 0.3 * saved and got["read"] < 1.2 * got["held"], got
    for got in other:  # weights of its tp half, the moments of its dp half of those
        assert got["read"] < 0.45 * saved, got


def schedule_change_case(root: str) -> dict:
    """pp=2 1F1B for 4 steps straight; and 2 steps of 1F1B, a checkpoint, 2 of ZB-H1."""
    import train

    base = [*COMMON, "parallel.pp=2", "parallel.microbatches=2"]
    straight = train.run(tiny_config([*base, "parallel.schedule=1f1b"], f"{root}/straight"))
    train.run(tiny_config([*base, "parallel.schedule=1f1b", "train.stop_at_step=2"], f"{root}/s"))
    then = train.run(tiny_config([*base, "parallel.schedule=zb_h1"], f"{root}/s"))
    return {"straight": [r["loss"] for r in straight][2:], "resumed": [r["loss"] for r in then]}


@pytest.mark.spawn
def test_schedule_change_on_the_same_mesh_continues_bitwise(gloo_pool, tmp_path):
    """Same mesh, 1F1B -> ZB-H1: the RNG files are the mesh's own, and ZB-H1 accumulates each
    chunk's weight gradients over the microbatches in the same order as 1F1B (its W passes run
    in microbatch order), so the continued losses equal the uninterrupted 1F1B run bit for bit."""
    for got in gloo_pool(2).run(schedule_change_case, str(tmp_path)):
        assert got["resumed"] == got["straight"]
