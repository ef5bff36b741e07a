"""Parity of the mixture-of-experts model (models/moe.py, ep=1: every rank holds every expert):
dp, tp (+ sequence parallelism), pp under 1F1B and Zero Bubble (deferred expert weight grads),
cp, ZeRO-1, full recompute and bf16 weights train like one process: per-step loss, grad norm and
final weights to relative 1e-5 (bf16: tests/test_parity_bf16.py's bounds), dropless and with a
capacity factor, and the step's MoE figures (load per expert, dropped rows, aux and z losses)
equal whatever the mesh: routing, drops and losses are functions of each sequence alone.

Cases are grouped by world size so each size spawns its gloo workers once.
"""

from functools import cache

import pytest
import torch

from tests.parity import LOW_LR, mesh_params, rank_microbatches
from tests.util import assert_rel_close, assert_state_close

MOE = ["model.n_experts=4", "model.top_k=2", "model.moe_ffn=48", "model.moe_z_coef=0.001"]
CAP = ["model.moe_capacity_factor=1.0"]  # ceil(1.0·16·2/4) = 8 rows per expert per sequence
SHARED = ["model.moe_shared_experts=1"]
LLAMA = ["model.arch=llama", "model.tie_embeddings=false", "model.d_ff=64"]
SP = ["parallel.sequence_parallel=true"]
MB2, MB4 = ["parallel.microbatches=2"], ["parallel.microbatches=4"]
BF16 = ["train.params_dtype=bfloat16", "train.dtype=bfloat16", LOW_LR]
# deepseek_v3 (docs/moe.md, "DeepSeek-V3"): latent attention with a query LoRA and v_head_dim !=
# the qk width (the ring pads v), sigmoid routing within 2 of 3 groups, a shared expert, a first
# dense layer, and the selection bias moving each step (its load summed over the mesh)
DSV3 = ["model.arch=deepseek_v3", "model.n_experts=6", "model.n_group=3", "model.topk_group=2",
        "model.first_k_dense_replace=1", "model.q_lora_rank=16", "model.kv_lora_rank=16",
        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=10",
        "model.routed_scaling_factor=2.5", "model.moe_bias_update_rate=0.01", *SHARED,
        "model.tie_embeddings=false", "model.d_ff=64"]  # fmt: skip
MTP2 = ["model.mtp_layers=2", "model.mtp_loss_coef=0.5"]  # two depths on the last stage


def pp(schedule: str, m: int, vpp: int = 1) -> list[str]:
    return [f"parallel.schedule={schedule}", "parallel.pp=2", f"parallel.microbatches={m}",
            f"parallel.vpp={vpp}"]  # fmt: skip


def seq(k: int, m: int) -> list[str]:
    """Seq1F1B over pp=2 with k segments of each sequence; its per-segment attention sums round
    differently, hence tests/parity.LOW_LR."""
    return [*pp("seq1f1b", m), f"parallel.seq_segments={k}", LOW_LR]


CASES = {  # world -> [(id, dp, tp, overrides)]
    2: [
        ("dp2", 2, 1, [*MB2, *SHARED]),
        ("dp2-cap-zero1", 2, 1, [*MB2, *CAP, "parallel.zero=1"]),
        ("tp2-llama-shared", 1, 2, [*LLAMA, *SHARED]),
        ("tp2-sp-cap", 1, 2, [*SP, *CAP, *SHARED]),
        ("tp2-sp-llama-cap-full", 1, 2, [*SP, *LLAMA, *CAP, "recompute.mode=full"]),
        ("pp2-1f1b-cap", 1, 1, [*pp("1f1b", 4), *CAP]),
        ("pp2-zb_h1-llama", 1, 1, [*pp("zb_h1", 4), *LLAMA, *SHARED]),
        ("pp2-zb_v-cap", 1, 1, [*pp("zb_v", 2, 2), *CAP]),
        ("pp2-interleaved-shared", 1, 1, [*pp("interleaved_1f1b", 4, 2), *SHARED]),
        ("pp2-dualpipe-cap", 1, 1, [*pp("dualpipe", 4, 2), *CAP]),
        ("cp2", 1, 1, ["parallel.cp=2", *SHARED]),
        ("cp2-llama-cap-full", 1, 1, ["parallel.cp=2", *LLAMA, *CAP, "recompute.mode=full"]),
        ("tp2-sp-dsv3-mtp", 1, 2, [*SP, *DSV3, *MTP2]),
        ("pp2-1f1b-dsv3-mtp", 1, 1, [*pp("1f1b", 4), *DSV3, *MTP2]),
        ("cp2-dsv3-mtp", 1, 1, ["parallel.cp=2", *DSV3, *MTP2]),
        ("dp2-ep2-dsv3-mtp", 2, 1, [*MB2, "parallel.ep=2", *DSV3, *MTP2]),
        ("cp2-a2a-dsv3-mtp", 1, 1, ["parallel.cp=2", "parallel.cp_comm=a2a", *DSV3, *MTP2]),
        ("dp2-zero3-dsv3-mtp", 2, 1, [*MB2, "parallel.zero=3", *DSV3, *MTP2]),
        ("pp2-zb_h1-dsv3-mtp", 1, 1, [*pp("zb_h1", 4), *DSV3, *MTP2]),
        ("pp2-interleaved-dsv3-mtp", 1, 1, [*pp("interleaved_1f1b", 4, 2), *DSV3, *MTP2]),
        ("pp2-zb_v-dsv3-mtp", 1, 1, [*pp("zb_v", 2, 2), *DSV3, *MTP2]),
        ("pp2-dualpipe-dsv3-mtp", 1, 1, [*pp("dualpipe", 4, 2), *DSV3, *MTP2]),
        ("tp2-sp-dsv3-mtp-full", 1, 2, [*SP, *DSV3, *MTP2, "recompute.mode=full"]),
        (
            "dp2-zero2-dsv3-mtp-selective",
            2,
            1,
            [*MB2, "parallel.zero=2", *DSV3, *MTP2, "recompute.mode=selective"],
        ),
    ],
    4: [
        ("dp2-tp2-sp-cap", 2, 2, [*SP, *CAP, *MB2]),
        ("cp2-tp2-sp-cap", 1, 2, ["parallel.cp=2", *SP, *CAP, *SHARED]),
        ("dp2-pp2-zb_h1-cap-zero1", 2, 1, [*pp("zb_h1", 2), *CAP, "parallel.zero=1"]),
        ("dp4-zero2-cap", 4, 1, [*MB2, *CAP, "parallel.zero=2"]),
        ("dp2-pp2-1f1b-zero3-shared", 2, 1, [*pp("1f1b", 2), *SHARED, "parallel.zero=3"]),
        ("dp4-zero3-llama", 4, 1, [*LLAMA, *CAP, "parallel.zero=3"]),
    ],
}
# Seq1F1B (parallel.seq_segments): the capacity reads the earlier segments' counts, the balance
# loss's f the whole sequence's; the reference is the unsegmented one process
SEGMENT_CASES = {
    2: [
        ("pp2-seq1f1b-2-cap", 1, 1, [*seq(2, 4), *CAP, *SHARED]),
        ("pp2-seq1f1b-3-dsv3-mtp", 1, 1, [*seq(3, 2), *DSV3, *MTP2]),
        ("pp2-seq1f1b-4-llama-cap-full", 1, 1, [*seq(4, 2), *LLAMA, *CAP, "recompute.mode=full"]),
    ],
    4: [
        ("tp2-sp-pp2-seq1f1b-2-cap", 1, 2, [*seq(2, 2), *SP, *CAP]),
        ("dp2-pp2-seq1f1b-3-cap-ep2", 2, 1, [*seq(3, 2), *CAP, "parallel.ep=2"]),
    ],
}
# bf16: dropless, since a split's bf16 round-off of the hidden states (~2^-8) can flip a token
# near a capacity or top-k boundary, after which the runs differ by that token's expert
BF16_CASES = {
    2: [
        ("dp2-zero1", 2, 1, [*BF16, *MB2, "parallel.zero=1"]),
        ("dp2", 2, 1, [*BF16, *MB2, *SHARED]),
        ("pp2-zb_h1", 1, 1, [*BF16, *pp("zb_h1", 4)]),
        ("dp2-zero1-dsv3-mtp", 2, 1, [*BF16, *MB2, "parallel.zero=1", *DSV3, *MTP2]),
    ]
}
LOSS_REL, WEIGHT_REL = 5e-5, 1.5e-2  # tests/test_parity_bf16.py's bounds (dp, zero=1, pp)


def moe_case(overrides: list[str], steps: int = 3) -> dict:
    """tests/parity.train_case with the step's MoE figures (train/moe_metrics.py) recorded."""
    import tempfile

    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.train.moe_metrics import moe_record
    from megapipe.train.parallelize import parallelize
    from tests.parity import _dp_spread, build_mesh, tiny_config

    cfg = tiny_config([*MOE, *overrides], tempfile.mkdtemp())
    mesh = build_mesh(cfg)
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, mesh, "cpu", 0.01)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    losses, norms, figures = [], [], []
    for step in range(steps):
        result = job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        figures.append(moe_record(cfg, job.model, mesh))
    weights = {}
    with job.full_weights():
        for chunk in job.engine.chunks:
            weights.update(gather_logical(chunk))
            for name, buf in chunk.named_buffers():  # deepseek_v3's selection biases
                if name.endswith("routing.bias"):
                    weights[name] = buf.clone()
    deferred = getattr(getattr(job.engine, "runtime", None), "deferred_matmuls", 0)
    return {
        "losses": losses, "grad_norms": norms, "weights": weights, "moe": figures,
        "dp_spread": _dp_spread(weights, mesh), "adam_reach": cfg.train.lr * steps,
        "deferred": deferred,
    }  # fmt: skip


@cache
def reference(extra: tuple[str, ...]) -> dict:
    """One process, same model and microbatches (in the pytest process, no process group)."""
    keep = ("model.", "train.", "recompute.", "parallel.microbatches")
    return moe_case([x for x in extra if x.startswith(keep)])


def _same_figures(got: list[dict], ref: list[dict], rel: float) -> None:
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a["moe_load"] == b["moe_load"], f"step {step}: load {a} != {b}"
        assert a["moe_dropped"] == b["moe_dropped"], f"step {step}: dropped"
        for key in ("moe_aux", "moe_z"):
            assert abs(a[key] - b[key]) <= rel * abs(b[key]), f"step {step}: {key}"


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(CASES))
def test_moe_mesh_trains_like_one_process(gloo_pool, world, dp, tp, extra):
    mesh = [f"parallel.dp={dp}", f"parallel.tp={tp}"]
    results = gloo_pool(world).run(moe_case, [*extra, *mesh])
    ref = reference(tuple(extra))
    weights = {}
    for rank, got in enumerate(results):
        assert got["dp_spread"] == 0.0, f"rank {rank}: dp replicas differ"
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} != {b}"
        assert_rel_close(*map(_t, (got["grad_norms"], ref["grad_norms"])), name="grad norms")
        _same_figures(got["moe"], ref["moe"], 1e-5)
        weights.update(got["weights"])
    assert_state_close(weights, ref["weights"])
    if any("zb_" in x for x in extra):  # the stacked expert weight grads were deferred to W
        assert sum(got["deferred"] for got in results) > 0


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(SEGMENT_CASES))
def test_moe_seq1f1b_segments_train_like_one_process(gloo_pool, world, dp, tp, extra):
    """Capacity cases drop rows (so a routing that forgot the earlier segments would differ)."""
    test_moe_mesh_trains_like_one_process(gloo_pool, world, dp, tp, extra)
    dropped = [figures["moe_dropped"] for figures in reference(tuple(extra))["moe"]]
    assert all(dropped) if CAP[0] in extra else not any(dropped), dropped


@pytest.mark.spawn
@pytest.mark.parametrize("world,dp,tp,extra", mesh_params(BF16_CASES))
def test_moe_bf16_weights_train_like_one_process(gloo_pool, world, dp, tp, extra):
    results = gloo_pool(world).run(moe_case, [*extra, f"parallel.dp={dp}", f"parallel.tp={tp}"])
    # one process of dp × the microbatches: each makes one dp rank's bf16 grads
    # (tests/test_parity_bf16.py's module docstring)
    own = [x for x in extra if not x.startswith("parallel.microbatches=")]
    ref = reference((*own, rank_microbatches(extra, dp)))
    weights = {}
    for got in results:
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= LOSS_REL * abs(b), f"step {step}: loss {a} != {b}"
        weights.update(got["weights"])
    router = next(n for n in weights if n.endswith("mlp.router.weight"))  # the first MoE layer's
    assert weights[router].dtype == torch.float32
    assert weights[router.replace("router.weight", "experts.w_in")].dtype == torch.bfloat16
    assert_state_close(weights, ref["weights"], rel=WEIGHT_REL, reach=ref["adam_reach"])


RESHARD = {  # id -> (world, saved under, world, resumed under): MoE with a capacity factor
    "tp2-sp-to-pp2-zb_h1": (2, ["parallel.tp=2", *SP], 2, pp("zb_h1", 2)),
    "dp2-cp2-to-1": (4, ["parallel.dp=2", "parallel.cp=2"], 1, []),
    "zero1-dp4-to-zero3-dp2": (
        4,
        ["parallel.dp=4", "parallel.zero=1"],
        2,
        ["parallel.dp=2", "parallel.zero=3"],
    ),
}


@pytest.mark.spawn
@pytest.mark.parametrize("name", RESHARD)
def test_moe_checkpoint_resumes_on_another_mesh(gloo_pool, tmp_path, name):
    """Saved after step 2 of 4 under one mesh, resumed under another: the stacked experts load
    by logical name and steps 3-4 match the one-process run that never stopped."""
    from tests.test_reshard import COMMON, resume_case, save_case, uninterrupted

    model = [*MOE, *CAP, *SHARED]
    world, first, world_then, then = RESHARD[name]
    gloo_pool(world).run(save_case, [*COMMON, *model, *first], str(tmp_path))
    args = ([*COMMON, *model, *then], str(tmp_path))
    losses = gloo_pool(world_then).run(resume_case, *args)[0] if world_then > 1 else None
    losses = losses if losses is not None else resume_case(*args)
    expected = uninterrupted(tuple(model))[2:]
    assert len(losses) == len(expected) == 2
    for step, (a, b) in enumerate(zip(losses, expected), start=3):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: resumed {a} != uninterrupted {b}"


def _t(values):
    return torch.tensor(values, dtype=torch.float64)
