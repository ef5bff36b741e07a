"""Seq1F1B (Sun et al. 2024): sequence segments with the K/V of earlier segments kept train the
same model as one full-sequence process (docs/architecture.md, Invariants).

Unit level (one process): a chunk run segment by segment, forwards 0..k−1 and backwards k−1..0
through `SegmentKV`, gives the full sequence's outputs, input grads and weight grads. Pipeline
level (spawned gloo pools, tests/test_parity_pp.check_parity): pp=2 and 4, k=2..4, m < p and m
not a multiple of p, gpt2 with a tied head and llama with GQA, mixed with dp=2 and tp=2 (± SP).
"""

import pytest
import torch

from megapipe.config import ConfigError
from megapipe.config.flops import matmul_params, segment_bounds
from megapipe.parallel.autograd.segment_kv import SegmentKV
from megapipe.plan.seq1f1b import segment_flops
from tests.parity import LOW_LR, mesh_params, tiny_config, train_case
from tests.test_parity_pp import (
    B12,
    GQA2,
    L4,
    LLAMA,
    SP,
    check_parity,
    pp,
    reference,
    union_of_ranks,
)
from tests.util import assert_rel_close, assert_state_close

# Segments only reorder float32 sums: outputs and grads agree to ~3e-7 (checked at GRAD_REL).
# The parity runs train at LOW_LR (tests/parity.py), so AdamW does not blow that round-off up
# past the 1e-5 bar on the final weights.
GRAD_REL = 1e-6


def seq(p: int, m: int, k: int) -> list[str]:
    return [*pp("seq1f1b", p, m), f"parallel.seq_segments={k}"]


def _model(overrides, tmp_path, blocks=None):
    from megapipe.models.gpt import GPT

    cfg = tiny_config(overrides, str(tmp_path))
    return GPT(cfg.model, blocks, seed=cfg.train.seed, recompute=cfg.recompute)


def _grads(model) -> dict:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [*LLAMA, "model.n_kv_heads=2"],
        ["recompute.mode=full"],
        [*LLAMA, "recompute.mode=selective"],
    ],
    ids=["gpt2", "llama-gqa", "gpt2-full-recompute", "llama-selective"],
)
@pytest.mark.parametrize(
    "bounds", [[(0, 8), (8, 16)], [(0, 5), (5, 7), (7, 16)]], ids=["k2", "k3-uneven"]
)
def test_segments_with_kept_kv_equal_full_causal_attention(tmp_path, overrides, bounds):
    """Layers only (a middle pipeline stage): outputs, input grads and weight grads."""
    torch.manual_seed(0)
    model = _model(overrides, tmp_path, blocks=range(1, 3))
    x = torch.randn(2, 16, 32, requires_grad=True)
    w = torch.randn(2, 16, 32)  # the output-grad
    full = model(x, positions=torch.arange(16))
    full.backward(w)
    ref_x, ref = x.grad, _grads(model)

    kv, leaves, outs = SegmentKV(), [], []
    for i, (s, e) in enumerate(bounds):  # forwards in segment order
        leaves.append(x.detach()[:, s:e].requires_grad_())
        outs.append(model(leaves[-1], positions=torch.arange(s, e), segment=kv.scope(i)))
    for i in reversed(range(len(bounds))):  # backwards in reverse (seq1f1b.py)
        s, e = bounds[i]
        kv.backward(i, outs[i], w[:, s:e])
    assert kv.empty, "every kept K/V is released by its segment's backward"
    out = torch.cat([o.detach() for o in outs], 1)
    assert_rel_close(out, full.detach(), GRAD_REL, "output")
    assert_rel_close(torch.cat([leaf.grad for leaf in leaves], 1), ref_x, GRAD_REL, "input grad")
    got = _grads(model)
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert_rel_close(got[name], ref[name], GRAD_REL, name)


@pytest.mark.parametrize("overrides", [[], [*LLAMA, "model.n_kv_heads=2"]], ids=["gpt2", "llama"])
def test_segmented_loss_and_grads_equal_full_sequence(tmp_path, overrides):
    """Whole model with embedding (learned or RoPE positions) and loss: summed per segment."""
    model = _model(overrides, tmp_path)
    ids, targets = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    full = model(ids, targets)
    full.backward()
    ref = _grads(model)
    kv, bounds, losses = SegmentKV(), [(0, 6), (6, 11), (11, 16)], []
    for i, (s, e) in enumerate(bounds):
        losses.append(
            model(ids[:, s:e], targets[:, s:e], positions=torch.arange(s, e), segment=kv.scope(i))
        )
    for i in reversed(range(3)):
        kv.backward(i, losses[i], None)
    assert_rel_close(sum(x.detach() for x in losses), full.detach(), GRAD_REL, "loss")
    got = _grads(model)
    for name in ref:
        assert_rel_close(got[name], ref[name], GRAD_REL, name)


def test_segment_bounds_are_flop_balanced_and_tp_aligned(tmp_path):
    cfg = tiny_config([*seq(2, 2, 4), "model.seq_len=2048"], str(tmp_path))
    bounds = segment_bounds(cfg)
    assert bounds[0][0] == 0 and bounds[-1][1] == 2048 and len(bounds) == 4
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert sizes == sorted(sizes, reverse=True), "later segments attend to more keys: shorter"
    flops = segment_flops(sizes, matmul_params(cfg), 2, 32)
    assert max(flops) / min(flops) < 1.01
    cfg = tiny_config([*seq(2, 2, 3), "parallel.tp=2", *SP], str(tmp_path))
    assert all((e - s) % 2 == 0 for s, e in segment_bounds(cfg))
    assert segment_bounds(tiny_config(pp("1f1b", 2, 2), str(tmp_path))) == [(0, 16)]


# Qwen3 (QK-norm, head_dim 24) with layer 1 sliding over 5 keys: the window crosses segments
QWEN3 = ["model.arch=qwen3", "model.tie_embeddings=false", "model.d_ff=64", "model.head_dim=24"]
QWEN3_WINDOW = [*QWEN3, "model.sliding_window=5", "model.max_window_layers=1"]

CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("seq1f1b-k2-m2", 1, 1, seq(2, 2, 2)),
        ("seq1f1b-k4-m3-llama-gqa", 1, 1, [*seq(2, 3, 4), *B12, *GQA2]),
        ("seq1f1b-k3-m1-full-recompute", 1, 1, [*seq(2, 1, 3), "recompute.mode=full"]),
        ("seq1f1b-k4-m2-qwen3-window", 1, 1, [*seq(2, 2, 4), *QWEN3_WINDOW]),
    ],
    4: [
        ("pp4-seq1f1b-k2-m2", 1, 1, [*seq(4, 2, 2), *L4]),
        ("pp4-seq1f1b-k4-m6-llama", 1, 1, [*seq(4, 6, 4), *B12, *LLAMA, *L4]),
        ("dp2-pp2-seq1f1b-k2-m3", 2, 1, [*seq(2, 3, 2), *B12]),
        ("pp2-tp2-seq1f1b-k4-m2-gqa-sp", 1, 2, [*seq(2, 2, 4), *GQA2, *SP]),
        ("pp2-tp2-seq1f1b-k2-m3", 1, 2, [*seq(2, 3, 2), *B12]),
    ],
}
SLOW = {
    8: [
        ("dp2-pp2-tp2-seq1f1b-k2-gqa-sp", 2, 2, [*seq(2, 2, 2), *GQA2, *SP]),
        ("pp4-tp2-seq1f1b-k4-m3-llama", 1, 2, [*seq(4, 3, 4), *B12, *LLAMA, *L4]),
    ]
}


@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_seq1f1b_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    check_parity(gloo_pool, world, dp, tp, [*extra, LOW_LR])


@pytest.mark.slow
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(SLOW))
def test_seq1f1b_trains_like_one_process_8_ranks(gloo_pool, world, dp, tp, extra):
    check_parity(gloo_pool, world, dp, tp, [*extra, LOW_LR])


def split_backward(actions: list) -> list:
    """Zero Bubble's B/W split on a Seq1F1B list: BW -> B, the W of every segment of a
    microbatch after its last B (segment 0). The generator emits BW; the runtime runs both."""
    k, out = 1 + max(a.seg for a in actions), []
    for a in actions:
        out.append(a._replace(kind="B") if a.kind == "BW" else a)
        if a.kind == "BW" and a.seg == 0:
            out += [a._replace(kind="W", segment=s) for s in range(k)]
    return out


def split_train_case(overrides: list[str]) -> dict:
    """train_case (a pool worker) with the schedule's backwards split by `split_backward`."""
    from megapipe.pipeline import engine

    build = engine.schedule_of
    engine.schedule_of = lambda cfg: {r: split_backward(x) for r, x in build(cfg).items()}
    try:
        return train_case(overrides)
    finally:
        engine.schedule_of = build


def test_seq1f1b_with_split_backward_trains_like_one_process(gloo_pool):
    extra = [*seq(2, 3, 3), *B12, *LLAMA, LOW_LR]
    results = gloo_pool(2).run(split_train_case, [*extra, "parallel.dp=1", "parallel.tp=1"])
    ref = reference(tuple(extra), 1)
    assert all(got["events"] == got["actions"] for got in results)
    assert all(got["deferred_matmuls"] > 0 for got in results), "W actions did the matmuls"
    assert_rel_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), name="loss")
    weights = union_of_ranks(results)
    assert_state_close(weights, ref["weights"], reach=ref["adam_reach"], exact=ref["exact"])


@pytest.mark.parametrize(
    "overrides,match",
    [
        ([*pp("1f1b", 2, 2), "parallel.seq_segments=2"], "only used by parallel.schedule=seq1f1b"),
        (["parallel.schedule=seq1f1b", "parallel.seq_segments=2"], "with parallel.pp > 1"),
        (seq(2, 2, 17), r"seq_segments=17 needs model.seq_len=16 >= 17"),
        ([*seq(2, 2, 9), "parallel.tp=2", *SP], "seq_len=16 >= 18: 9 non-empty segments of a mul"),
        ([*seq(2, 2, 2), "parallel.cp=2"], "seq1f1b with parallel.cp=2"),
    ],
)
def test_bad_seq1f1b_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(overrides, str(tmp_path))
    assert "\n" not in str(err.value)
