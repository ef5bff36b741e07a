"""Parity under parallel.tp_overlap (parallel/tensor/overlap.py): with the sequence-parallel
collectives decomposed into ring steps beside the linears' matmul chunks, every mesh trains like
one process: per-step loss, grad norm and final weights to relative 1e-5 in float32 (only the
order of the tp-way sums moves), and to the bf16 bound of tests/test_parity_bf16.py under bf16
weights (the main grads the overlapped linears fuse into, in B or in a deferred W).

Each rank returns the logical tensors of its chunks; the union over ranks is the whole model,
and copies held by several ranks must agree exactly. Cases are grouped by world size.
"""

from functools import cache

import pytest
import torch

from tests.parity import LOW_LR, mesh_params, reference_case, tiny_config, train_case
from tests.test_parity_bf16 import BF16, BF16_SPLIT_REL, LOSS_REL
from tests.util import PARITY_REL, assert_rel_close, assert_state_close

LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
GQA2 = [*LLAMA, "model.n_kv_heads=2"]
OV = ["parallel.sequence_parallel=true", "parallel.tp_overlap=true"]
FULL, SEL = ["recompute.mode=full"], ["recompute.mode=selective"]
MLP_REDO = ["recompute.mode=selective", "recompute.modules=core_attn,mlp"]  # norm2 + MLP rerun
MB2 = ["parallel.microbatches=2"]


def pp(schedule: str, m: int) -> list[str]:
    return [f"parallel.schedule={schedule}", "parallel.pp=2", f"parallel.microbatches={m}"]


CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("tp2-gpt2", 1, 2, OV),
        ("tp2-llama-gqa-full", 1, 2, [*OV, *GQA2, *FULL]),
        ("tp2-gpt2-selective-mb2", 1, 2, [*OV, *SEL, *MB2]),
        ("tp2-bf16", 1, 2, [*OV, *BF16]),
        ("tp2-llama-mlp-recompute-mb2", 1, 2, [*OV, *LLAMA, *MLP_REDO, *MB2]),
    ],
    4: [
        ("tp4-gpt2-full", 1, 4, [*OV, *FULL]),
        ("tp4-llama-gqa-selective", 1, 4, [*OV, *GQA2, *SEL]),
        ("dp2-tp2-llama", 2, 2, [*OV, *LLAMA, *MB2]),
        ("pp2-tp2-1f1b", 1, 2, [*OV, *pp("1f1b", 4)]),
        ("pp2-tp2-zb_h1-llama", 1, 2, [*OV, *pp("zb_h1", 4), *LLAMA]),
        # ring attention rounds differently: parity.LOW_LR, as tests/test_parity_cp.py
        ("cp2-tp2-gqa", 1, 2, [*OV, "parallel.cp=2", *GQA2, LOW_LR]),
        ("pp2-tp2-zb_h1-bf16", 1, 2, [*OV, *pp("zb_h1", 4), *BF16]),
        ("pp2-tp2-zb_h1-mlp-recompute", 1, 2, [*OV, *pp("zb_h1", 4), *MLP_REDO]),
        # Seq1F1B's segments: each linear sees a segment, split over tp (LOW_LR: per-segment
        # sums, as tests/test_parity_seq1f1b.py)
        ("pp2-tp2-seq1f1b", 1, 2, [*OV, *pp("seq1f1b", 2), "parallel.seq_segments=2", LOW_LR]),
    ],
}


@cache
def reference(extra: tuple[str, ...], dp: int) -> dict:
    """One process: the same model and data in dp·m microbatches of rows (the case's
    parallel.* keys dropped), so only the order of the sums differs."""
    keep = [o for o in extra if not o.startswith("parallel.")]
    m = [int(o.split("=")[1]) for o in extra if o.startswith("parallel.microbatches=")] or [1]
    overrides = [*keep, f"parallel.microbatches={dp * m[0]}"]
    # bf16 weights have their own bound (BF16_SPLIT_REL), no float32 round-off twins
    return (
        train_case(overrides)
        if "train.params_dtype=bfloat16" in keep
        else reference_case(overrides)
    )


def union_of_ranks(results: list[dict]) -> dict:
    out = {}
    for rank, got in enumerate(results):
        for name, value in got["weights"].items():
            if name in out:
                assert torch.equal(out[name], value), f"rank {rank}: copies of {name} differ"
            out[name] = value
    return out


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_overlapped_tp_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    bf16 = "train.params_dtype=bfloat16" in extra
    loss_rel = LOSS_REL if bf16 else 1e-5
    results = gloo_pool(world).run(train_case, [*extra, f"parallel.dp={dp}", f"parallel.tp={tp}"])
    ref = reference(tuple(extra), dp)
    for rank, got in enumerate(results):
        assert got["dp_spread"] == 0.0, f"rank {rank}: dp replicas differ"
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= loss_rel * abs(b), f"rank {rank} step {step}: loss {a} != {b}"
        if not bf16:
            norms = [torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"])]
            assert_rel_close(*norms, name="grad norms")
        if "events" in got:
            assert got["events"] == got["actions"], f"rank {rank}: ran out of schedule order"
    if any(o == "parallel.schedule=zb_h1" for o in extra):  # the overlapped linears' W deferred
        assert sum(got["deferred_matmuls"] for got in results) > 0
    rel = BF16_SPLIT_REL if bf16 else PARITY_REL
    exact = None if bf16 else ref["exact"]  # bf16: its own derived bound, BF16_SPLIT_REL
    assert_state_close(union_of_ranks(results), ref["weights"], rel, ref["adam_reach"], exact)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.tp_overlap=true", "parallel.tp=2"],
        ["parallel.tp_overlap=true", "parallel.sequence_parallel=true"],
    ],
    ids=["no-sp", "tp1"],
)
def test_tp_overlap_without_sp_and_tp_is_one_line_error(tmp_path, overrides):
    from megapipe.config import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.tp_overlap=true .* set ") as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)


BF16_AGAINST_PLAIN = {
    2: [("tp2-bf16", 1, 2, [*OV, *BF16])],
    4: [("pp2-tp2-zb_h1-bf16", 1, 2, [*OV, *pp("zb_h1", 4), *BF16])],
}


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(BF16_AGAINST_PLAIN))
def test_overlapped_bf16_weights_train_like_the_plain_sp_path(gloo_pool, world, dp, tp, extra):
    """bf16 weights against the same mesh without the overlap, to float32's bound instead of
    bf16's (measured: bit for bit at tp=2, where the ring's sum of two partials is the
    all-reduce's, and each chunk's rows are the same dot products): the main grads the
    overlapped linears fuse into, in B or in a deferred W, are the plain path's."""
    pool = gloo_pool(world)
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    on = pool.run(train_case, [*extra, *mesh])
    off = pool.run(train_case, [*extra, *mesh, "parallel.tp_overlap=false"])
    for a, b in zip(on, off, strict=True):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
    got, want = union_of_ranks(on), union_of_ranks(off)
    assert_state_close(
        {k: v.float() for k, v in got.items()}, {k: v.float() for k, v in want.items()}
    )
