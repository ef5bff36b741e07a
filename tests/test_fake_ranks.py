"""`train.py --fake-ranks=SPEC`: ranks of any world built and run in this process on fake tensors
under the fake backend (megapipe/train/fake_ranks.py), no spawned processes.

The JSON contract of design.md, every pipeline send met by its receive, the FLOPs the code does
against the config's arithmetic, a 4,096-rank world's edge ranks built and stepped, and one-line
errors for a bad SPEC.
"""

from __future__ import annotations

import json

import pytest
import torch

import train
from megapipe._torch_compat import fake_tensor_mode
from megapipe.config import ConfigError, load_config
from megapipe.config.flops import flops_per_token, matmul_params
from megapipe.distributed.fake_world import ranks_of
from megapipe.distributed.mesh import MeshSizes, coords
from megapipe.train.checkpoint_plan import tiling_problems
from megapipe.train.fake_ranks import AXIS_KEYS, CommOp, Measure, fake_ranks, match_p2p

TINY = "configs/tiny.yaml"
ENTRY = {"rank", "coords", "peak_bytes", "plan_peak_bytes", "flops", "plan_flops",
         "comm_bytes", "plan_comm_bytes", "seconds", "save_bytes", "save_file"}  # fmt: skip
BIG = MeshSizes(pp=8, dp=64, cp=1, tp=8)


def test_specs_name_the_ranks():
    assert ranks_of("3,1,3", BIG) == [1, 3]
    assert len(ranks_of("all", MeshSizes(2, 2, 1, 2))) == 8
    edges = ranks_of("edges", BIG)
    assert len(edges) == 8 and edges[0] == 0 and edges[-1] == BIG.world - 1
    assert {tuple(coords(r, BIG).values()) for r in edges} == {
        (p, d, 0, t) for p in (0, 7) for d in (0, 63) for t in (0, 7)
    }
    pipe = ranks_of("pipeline:9", BIG)  # the 9th (dp, cp, tp): dp 1, tp 1
    assert [coords(r, BIG) for r in pipe] == [
        {"pp": p, "dp": 1, "cp": 0, "tp": 1} for p in range(8)
    ]


@pytest.mark.parametrize("spec", ["evens", "pipeline:512", "pipeline:x", "4096", "1,-2"])
def test_bad_specs_are_one_line(spec):
    with pytest.raises(ConfigError) as err:
        ranks_of(spec, BIG)
    assert "\n" not in str(err.value) and "fake-ranks" in str(err.value)


def test_p2p_matching_finds_a_size_mismatch():
    ops = {0: [CommOp("send", "pp", 64, peer=1)], 1: [CommOp("recv_", "pp", 64, peer=0)]}
    assert match_p2p(ops) == (1, 0)
    ops[1][0].nbytes = 32
    assert match_p2p(ops) == (0, 2)
    ops[0].append(CommOp("send", "pp", 64, peer=2))  # rank 2 not run: not counted
    assert match_p2p(ops) == (0, 2)


def test_pipeline_json_contract_and_p2p(capsys, tmp_path):
    """train.py --json for a whole pipeline of dp2 · tp2 · pp2 under zero=1."""
    argv = ["--config", TINY, "--fake-ranks=pipeline:0", "--json", f"--run.dir={tmp_path}",
            "--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=1",
            "--parallel.microbatches=2"]  # fmt: skip
    assert train.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"world", "ranks", "p2p_matched", "p2p_unmatched", "save_tiling"}
    assert out["save_tiling"] is None  # not every rank ran: the save plans are not all there
    # the stage's hardware FLOPs (config/flops.hardware_flops_per_token): both are exact counts
    assert [r["flops"] for r in out["ranks"]] == [r["plan_flops"] for r in out["ranks"]]
    assert out["world"] == 8 and [r["rank"] for r in out["ranks"]] == [0, 4]
    assert out["p2p_matched"] > 0 and out["p2p_unmatched"] == 0
    for r in out["ranks"]:
        assert set(r) >= ENTRY
        assert set(r["comm_bytes"]) >= set(AXIS_KEYS)
        assert r["comm_bytes"]["dp"] > 0 and r["comm_bytes"]["tp"] > 0
        assert r["comm_bytes"]["pp"] > 0 and r["peak_bytes"] > 0 and r["plan_peak_bytes"] > 0
        assert_bytes_are_the_plans(r)
    # both stages' peaks, the first's at its first backward after the warm-up (the backward's
    # working set: config/memory_backward.py)
    for r in out["ranks"]:
        assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05


def assert_bytes_are_the_plans(r: dict) -> None:
    """Bytes per axis within 2% of the performance model's (config/comm_bytes.py): each axis
    that either side names."""
    for axis in AXIS_KEYS:
        measured, plan = r["comm_bytes"][axis], r["plan_comm_bytes"][axis]
        assert abs(measured - plan) <= 0.02 * max(measured, plan), (r["rank"], axis)


@pytest.mark.parametrize(
    ("extra", "peak"),
    [
        (["--parallel.zero=3"], True),
        (["--parallel.zero=1", "--parallel.schedule=zb_h1"], True),
        (["--parallel.zero=3", "--train.fp8=rowwise"], False),
        (["--parallel.zero=1", "--train.dtype=bfloat16", "--train.params_dtype=bfloat16"], False),
        (
            [
                "--parallel.zero=1",
                "--train.dtype=bfloat16",
                "--train.params_dtype=bfloat16",
                "--train.fp8=rowwise",
                "--train.fp8_params=true",
            ],
            True,
        ),  # fmt: skip
    ],
    ids=["zero3", "zb_h1", "zero3_fp8", "bf16_weights", "fp8_params"],
)
def test_last_stage_is_the_models(tmp_path, extra, peak):
    """dp2 · tp2 · pp2, the last stage (rank 4): zero=3's gathers per block (the embedding's
    once a microbatch) and the tied table's sharded grads, and Zero Bubble's B/W split: FLOPs
    exact, bytes per axis within 2%; zero=3's and zb_h1's peaks within 5% of the dry run's
    (zb_h1's at the second B in the head, the first's W queued and B's grads made).
    Under train.fp8 zero=3 gathers the FP8 weights' 1-byte casts and all-reduces their amax
    vectors once a step (parallel/data/zero3_fp8.py), as zero=1 does after its step under
    train.fp8_params (parallel/data/fp8_params.py): dp's bytes equal the plan's exactly
    (config/fp8_weights.py); tp's too, with the linears' own amax all-reduces
    (config/fp8_amax.py)."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=2", "--parallel.tp=2",
                             "--parallel.pp=2", "--parallel.microbatches=2", *extra])  # fmt: skip
    (r,) = fake_ranks(cfg, "4")["ranks"]
    assert r["flops"] == r["plan_flops"]
    if "--train.fp8=rowwise" in extra:
        for axis in ("dp", "tp"):
            assert r["comm_bytes"][axis] == r["plan_comm_bytes"][axis], axis
    assert_bytes_are_the_plans(r)
    if peak:
        assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05


@pytest.mark.parametrize(
    ("schedule", "microbatches"),
    [
        ("zb_h1", 2),
        ("zb_h1", 4),
        ("zb_h2", 2),
        ("zb_h2", 4),
        ("zb_v", 4),
        ("zb_auto", 4),
        ("v_half", 4),
    ],  # fmt: skip
)
def test_zero_bubble_peaks_are_the_plans(tmp_path, schedule, microbatches):
    """dp2 · tp2 · pp2 under a B/W split, the first and last stage: the peak within 5% of the
    dry run's, which holds W's queued operands beside the backward's working set
    (config/memory_backward.py), the grads B makes before the first W
    (memory_plan.RankMemory.grads_in_b), and a runtime that queues only the operands' values
    (parallel/autograd/weight_grad.py). zb_v, zb_auto and v_half are built for unit costs,
    in the run and the plan (fake_ranks.unit_costs: fake tensors have no time to profile)."""
    vpp = 2 if schedule in ("zb_v", "v_half") else 1
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=2", "--parallel.tp=2",
                             "--parallel.pp=2", "--parallel.zero=1", f"--parallel.vpp={vpp}",
                             f"--parallel.microbatches={microbatches}",
                             f"--parallel.schedule={schedule}"])  # fmt: skip
    assert cfg.parallel.schedule_costs == "profile"  # the default, which fake ranks resolve
    out = fake_ranks(cfg, "0,4")
    assert out["p2p_unmatched"] == 0
    for r in out["ranks"]:
        assert r["stepped"] and r["flops"] == r["plan_flops"], r["rank"]
        assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05, (r["rank"], r)


def test_full_recompute_replays_the_dropout_stream_on_fake_tensors(tmp_path):
    """tp's dropout RNG tracker (parallel/tensor/random.replayable) replays its state for the
    recompute without a tensor op, which fake tensors would turn into a state torch cannot
    set: a tp rank under full recompute with dropout steps like one without."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.tp=2", "--model.dropout=0.1",
                             "--recompute.mode=full"])  # fmt: skip
    (r,) = fake_ranks(cfg, "1")["ranks"]
    assert r["stepped"] and r["comm_bytes"]["tp"] == r["plan_comm_bytes"]["tp"]


MLA = ["--model.arch=deepseek_v3", "--model.q_lora_rank=16", "--model.tie_embeddings=false"]
MOE_SHARED = ["--model.n_experts=4", "--model.top_k=2", "--model.moe_shared_experts=1"]


@pytest.mark.parametrize(
    ("extra", "axes"),
    [
        ([*MLA, "--train.fp8=tensorwise"], ("tp",)),
        ([*MOE_SHARED, "--train.fp8=tensorwise", "--parallel.cp=2"], ("tp", "cp")),
        ([*MOE_SHARED, "--train.fp8=rowwise", "--parallel.dp=2", "--parallel.ep=2"], ("tp",)),
    ],
    ids=["mla", "moe_cp", "moe_ep_rowwise"],
)
def test_fp8_amax_all_reduces_are_the_plans(tmp_path, extra, axes):
    """train.fp8's amax all-reduces (config/fp8_amax.py) under tp2 + SP: the bytes FP8 adds
    on each axis are the plan's exactly. deepseek_v3's latent attention (tensorwise: the
    weights cast each microbatch, every operand over tp), whose down projections see each
    rank's sequence chunk and share their tokens' amaxes over tp; the routed experts, whose
    parts share x's, g's and the weight grad's amaxes over the token groups (tp under SP, cp)
    and, rowwise, the weight grad's per-feature rows; under ep each (expert, source) part
    casts apart. (Without SP: test_last_stage's zero3_fp8 case, tp exact.)"""

    def axis_bytes(*over):
        over = ["--parallel.tp=2", "--parallel.sequence_parallel=true", *over]
        (r,) = fake_ranks(load_config(TINY, [f"--run.dir={tmp_path}", *over]), "0")["ranks"]
        return {a: (r["comm_bytes"][a], r["plan_comm_bytes"][a]) for a in axes}

    fp8 = axis_bytes(*extra)
    none = axis_bytes(*(o for o in extra if not o.startswith("--train.fp8")))
    for axis in axes:
        (measured, plan), (measured_none, plan_none) = fp8[axis], none[axis]
        assert measured - measured_none == plan - plan_none > 0, axis


RING = ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.tp_overlap=true"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--train.fp8=tensorwise"],
        ["--train.fp8=rowwise", "--recompute.mode=full"],
        MLA,
        [*MLA, "--train.fp8=tensorwise"],
        ["--model.arch=llama", *MOE_SHARED, "--train.fp8=tensorwise"],
    ],
    ids=["fp8_tensorwise", "fp8_rowwise_full", "mla", "mla_fp8", "shared_experts_fp8"],
)
def test_tp_ring_bytes_are_the_plans(tmp_path, extra):
    """The tp ring's bytes (parallel/tensor/overlap.py, fp8_overlap.py) are the plan's exactly:
    its sends, each column linear's kept shard gathered again in backward (under tensorwise
    FP8 as its one-byte payloads: config/tp_widths.regathered), and latent attention's rope
    key, which enters its column region through SP's plain all-gather, not the ring."""
    over = [f"--run.dir={tmp_path}", *RING, *extra]
    (r,) = fake_ranks(load_config(TINY, over), "0")["ranks"]
    assert r["comm_bytes"]["tp"] == r["plan_comm_bytes"]["tp"] > 0


MTP = ["--model.mtp_layers=1", "--model.tie_embeddings=false"]
PP2 = ["--parallel.pp=2", "--parallel.dp=2", "--parallel.microbatches=2"]


@pytest.mark.parametrize(
    ("rank", "extra"),
    [("0", ["--train.fp8=tensorwise"]), ("4", [*PP2, "--train.fp8=rowwise"])],
    ids=["tensorwise", "pp2_last_stage_rowwise"],
)
def test_mtp_fp8_linears_are_the_plans(tmp_path, rank, extra):
    """Multi-token prediction's depths (models/mtp.py, beside the head: the last stage) under
    train.fp8 and tp2 + SP: each depth's projection (whole on every tp rank, its amaxes shared
    over tp's sequence chunks) and its block's linears all-reduce their amaxes as a layer's
    do (config/fp8_amax.block_amax_ops): tp's bytes are the plan's exactly; the peak within 5%
    of the dry run's."""
    over = [f"--run.dir={tmp_path}", "--parallel.tp=2", "--parallel.sequence_parallel=true"]
    cfg = load_config(TINY, [*over, *MTP, *extra])
    (r,) = fake_ranks(cfg, rank)["ranks"]
    assert r["comm_bytes"]["tp"] == r["plan_comm_bytes"]["tp"]
    assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05


WIDE = ["--model.d_model=256", "--parallel.microbatches=4", "--train.global_batch=16"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_weight_casts_kept_over_a_step_are_the_plans(tmp_path, recipe):
    """The FP8 linears' weight casts kept from a step's first forward to its last backward
    (parallel/fp8_weight_cache.py), tp2 + SP, d_model 256 and 4 microbatches: 1 byte per
    weight element (2 under rowwise), 5% (10%) of the rank's peak, in the dry run
    (config/fp8_weights.step_cast_bytes): the peak within 5% of the plan's; each weight's amax
    all-reduced once a step (rowwise: W's and Wᵀ's), tp's bytes the plan's exactly."""
    over = [f"--run.dir={tmp_path}", "--parallel.tp=2", "--parallel.sequence_parallel=true"]
    cfg = load_config(TINY, [*over, *WIDE, f"--train.fp8={recipe}"])
    (r,) = fake_ranks(cfg, "0")["ranks"]
    assert r["comm_bytes"]["tp"] == r["plan_comm_bytes"]["tp"]
    assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05


def test_zero3_rank_holds_its_shard_and_a_few_blocks_of_grads(tmp_path):
    """ZeRO-3 reducing every microbatch (dp4, 8 layers, 2 microbatches, rank 3: the last
    shard): the most grad bytes the rank holds at any moment stay within the dry run's grads
    (its float32 shard plus the two largest consecutive blocks' full grads), under the
    whole model's float32 grads, and its peak is the plan's within 5%."""
    from megapipe.train.dry_run import as_json

    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=4", "--parallel.zero=3",
                             "--parallel.grad_reduce=microbatch", "--model.n_layers=8",
                             "--parallel.microbatches=2"])  # fmt: skip
    (r,) = fake_ranks(cfg, "3")["ranks"]
    plan = as_json(cfg, "cpu")["ranks"][0]
    model_grads = 4 * plan["params"]
    assert 0 < r["most_by_kind"]["grads"] <= plan["grads_bytes"] < model_grads
    assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05


def test_hsdp_rank_is_the_models(tmp_path):
    """HSDP, dp4 in shard groups of 2 under zero=3 (parallel.dp_shard=2), rank 2: the first of
    the second group, a replica of rank 0's shards. Its dp bytes within 2% of the plan's: the
    reduce-scatters and per-block gathers over 2 ranks, the shards' all-reduce over the 2
    replicas; it writes nothing to a checkpoint (not dp 0; rank 0 writes the same moments)."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=4", "--parallel.zero=3",
                             "--parallel.dp_shard=2", "--parallel.microbatches=2"])  # fmt: skip
    (r,) = fake_ranks(cfg, "2")["ranks"]
    assert r["comm_bytes"]["dp"] > 0
    assert_bytes_are_the_plans(r)
    assert r["save_bytes"] == 0


def test_hsdp_grads_reduced_in_bf16_are_the_models(tmp_path):
    """HSDP at zero=2 (dp4 in shard groups of 2), rank 2, with the grads reduced in float32 and
    in bfloat16 (parallel.grad_reduce_dtype): dp bytes within 2% of the plan's, and bfloat16
    takes off exactly the bytes the plan takes off (half of the reduce-scatter's and of the
    replicas' all-reduce's; what the plan leaves out is the same in both)."""
    got = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(TINY, [f"--run.dir={tmp_path / dtype}", "--parallel.dp=4",
                                 "--parallel.zero=2", "--parallel.dp_shard=2",
                                 f"--parallel.grad_reduce_dtype={dtype}"])  # fmt: skip
        (got[dtype],) = fake_ranks(cfg, "2")["ranks"]
        assert_bytes_are_the_plans(got[dtype])
    measured, plan = ([got[d][k]["dp"] for d in got] for k in ("comm_bytes", "plan_comm_bytes"))
    assert measured[0] - measured[1] == plan[0] - plan[1] > 0


MOE = ["--model.arch=llama", "--model.n_experts=4", "--model.top_k=2"]  # Mixtral-style
MOE_CASES = {
    "dp2_ep2": ["--parallel.dp=2", "--parallel.ep=2"],
    "tp2": ["--parallel.tp=2"],
    "dp2_ep2_tp2_sp": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.tp=2",
                       "--parallel.sequence_parallel=true", "--parallel.zero=1"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_ranks_are_the_plans(tmp_path, case):
    """Routed experts on fake tensors (train/fake_values.py answers the dispatch's counts with
    the balanced routing the plan assumes): FLOPs exact (under tp without SP every tp rank runs
    the whole experts on all its tokens), bytes per axis within 2% (the ep all-to-alls of the
    rows, N/tp of them under SP; no MLP collectives beside whole experts; SP's all-reduce of
    the experts' grads over tp; nothing over a one-rank expert-replica group)."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", *MOE, *MOE_CASES[case]])
    (r,) = fake_ranks(cfg, "1")["ranks"]
    assert r["stepped"] and r["flops"] == r["plan_flops"]
    assert_bytes_are_the_plans(r)
    assert (r["comm_bytes"]["ep"] > 0) == (cfg.parallel.ep > 1)


MTP = ["--model.mtp_layers=1", "--model.tie_embeddings=false"]
EXACT_CASES = {  # id -> (rank, overrides, FLOPs compared too)
    "tp2_sp": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true"], True),
    # bf16 autocast on float32 weights: the norms' float32 outputs gathered (their grads summed)
    # as they are, the row outputs summed in bf16; latent attention's rope key in bf16
    "tp2_sp_mla_mtp": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true", *MLA, *MTP,
                             "--train.dtype=bfloat16"], False),
    "tp2_mla_no_q_lora": ("0", ["--parallel.tp=2", *MLA, "--model.q_lora_rank=0"], False),
    "tp2_sp_moe": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true", *MOE], True),
    "tp4_gqa_kv2": ("0", ["--parallel.tp=4", "--model.arch=llama", "--model.n_kv_heads=2"], True),
    "cp2_dp1_moe": ("0", ["--parallel.cp=2", *MOE], True),
    "cp2_dp2_mla": ("1", ["--parallel.cp=2", "--parallel.dp=2", *MLA], False),
    "cp2_dp2_mtp": ("1", ["--parallel.cp=2", "--parallel.dp=2", "--model.arch=llama", *MTP],
                    False),
    "pp2_mtp_last": ("1", ["--parallel.pp=2", "--parallel.microbatches=2", "--model.arch=llama",
                           *MTP], True),
    # full recompute reruns a layer's forward but a dense layer's MLP output sum (torch's
    # non-reentrant checkpoint stops after the last save): with and without SP, and MoE
    "tp2_sp_full": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                          "--recompute.mode=full"], True),
    "tp2_full_first": ("0", ["--parallel.tp=2", "--recompute.mode=full", "--recompute.layers=1",
                             "--train.dtype=bfloat16"], True),  # FLOPs: layer 0's forward again
    "selective_first": ("0", ["--recompute.mode=selective", "--recompute.layers=1"], True),
    "tp2_sp_moe_full": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true", *MOE,
                              "--recompute.mode=full"], True),
    # parallel.tp_overlap's ring: tp − 1 sends of a chunk per SP collective, the row linear's
    # rerun under full recompute (its sum runs before its saves), FP8's tensor amaxes over the
    # pieces' tp ranks; under bf16 autocast every piece cast before it is sent
    "tp4_sp_overlap": ("0", ["--parallel.tp=4", "--parallel.sequence_parallel=true",
                             "--parallel.tp_overlap=true", "--train.dtype=bfloat16"], True),
    # the grad norm's sum on the world's group, which is dp's without tp or pp: ZeRO, ep
    "dp2_zero1": ("0", ["--parallel.dp=2", "--parallel.zero=1"], True),
    "dp2_ep2_moe": ("0", ["--parallel.dp=2", "--parallel.ep=2", *MOE], True),
    # recompute.modules=mlp reruns norm2 and the MLP: under SP its input's gather (fc2's sum
    # comes after its saves) and its FLOPs (fc1 and fc2: fc2 saves after its matmul); under the
    # ring the row linear's sends too, and FP8's tensorwise amaxes of fc1 and fc2 again
    "tp2_sp_mlp_recompute": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                   "--recompute.mode=selective",
                                   "--recompute.modules=core_attn,mlp"], True),
    # bf16 autocast: the rerun gathers norm2's float32 output (the stream's dtype)
    "tp2_sp_bf16_mlp_recompute": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                        "--train.dtype=bfloat16", "--recompute.mode=selective",
                                        "--recompute.modules=mlp"], True),
    "tp2_sp_overlap_fp8_mlp_recompute": ("0", ["--parallel.tp=2",
                                               "--parallel.sequence_parallel=true",
                                               "--parallel.tp_overlap=true", "--model.arch=llama",
                                               "--train.fp8=tensorwise",
                                               "--recompute.mode=selective",
                                               "--recompute.modules=mlp"], True),
    "tp2_sp_overlap_fp8_full": ("0", ["--parallel.tp=2", "--parallel.sequence_parallel=true",
                                      "--parallel.tp_overlap=true", "--train.fp8=tensorwise",
                                      "--recompute.mode=full"], True),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_bytes_per_axis_are_the_plans_exactly(tmp_path, case):
    """Every axis's bytes equal the plan's to the byte: under SP the once-a-step tp sum of the
    grads tp ranks hold partial copies of (norm gains, row-linear biases, learned positions,
    latent attention's down projections, a MoE layer's router and experts; counted on the
    code's own modules: parallel/tensor/grad_sync.synced_elements), and without SP that of
    kv heads replicated over fewer than tp ranks; latent attention's three column inputs (the
    query latent, the kv latent, the rope key) gathered or their grads summed in place of the
    norm's output, and its keys and padded values around the cp ring; a MoE layer's
    routed-row counts summed over the ranks holding parts of a sequence; the MTP depths' tp
    ops (lookup, block, shared head), their cp rings and target gathers, and their table's
    copy swapped between the pipeline's ends; and with dp 1 the replica group's sums on cp,
    whose group it is; under full recompute the forward's ops again but a dense layer's last
    (the row linear's sum comes after its saves, where the checkpoint stops; with dropout its
    mask is saved after it: test_full_recompute_replays_the_dropout_stream_on_fake_tensors;
    under tp_overlap the ring sums before the save); the tp ring's chunk sends.
    FLOPs exact too (kv heads copied over tp ranks run their projections on each:
    config/flops._kv_copies), but latent attention's on the CPU, where SDPA's math path
    takes its values unpadded (config/flops._attention_hardware_flops), and MTP's head under
    cp, whose rows with a target depend on the rank's zigzag places (the plan takes their
    mean)."""
    rank, extra, flops = EXACT_CASES[case]
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", *extra])
    (r,) = fake_ranks(cfg, rank)["ranks"]
    assert r["stepped"] and (not flops or r["flops"] == r["plan_flops"])
    for axis in AXIS_KEYS:
        assert r["comm_bytes"][axis] == r["plan_comm_bytes"][axis], axis


@pytest.mark.parametrize("mode", ["none", "full"])
def test_ep_bytes_are_the_plans_exactly(tmp_path, mode):
    """A MoE layer's ep all-to-alls to the byte: forward the rows-per-expert counts, dispatch
    and combine, backward their transposes, and under full recompute the forward's again."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=2", "--parallel.ep=2", *MOE,
                             f"--recompute.mode={mode}"])  # fmt: skip
    (r,) = fake_ranks(cfg, "0")["ranks"]
    assert r["stepped"] and r["comm_bytes"]["ep"] == r["plan_comm_bytes"]["ep"] > 0


def test_balanced_answers_of_data_dependent_ops():
    """bincount's counts are the even shares (the remainder to the first bins) and `.tolist()`
    reads them, also through ops on them; a boolean mask keeps every element."""
    with fake_tensor_mode(), Measure():
        counts = torch.bincount(torch.zeros(10, dtype=torch.long), minlength=4)
        assert counts.tolist() == [3, 3, 2, 2]
        assert counts.view(2, 2).sum(1).tolist() == [6, 4]
        assert torch.repeat_interleave(counts).shape == (10,)
        rows = torch.zeros(6, 3)
        assert rows[rows[:, 0] > 1].shape == (6, 3)


def test_flops_are_the_config_arithmetic(tmp_path):
    """dp2 · tp2, no pipeline: each rank does 1/4 of 6N per token plus attention's matmuls,
    counted by FlopCounterMode as torch's flash kernels run them: 4·s·d per token and layer
    forward and 2.5 times that backward (the backward recomputes QKᵀ), so 14·L·d·s where the
    model FLOPs' PaLM count (config/flops.py) has 12: the measured attention is that much more."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=2", "--parallel.tp=2"])
    (r,) = fake_ranks(cfg, "3")["ranks"]
    m, tokens = cfg.model, cfg.derived.tokens_per_step
    code = (6 * matmul_params(cfg) + 14 * m.n_layers * m.d_model * m.seq_len) * tokens // 4
    assert r["flops"] == code
    assert r["plan_flops"] == code  # the plan is the hardware FLOPs the rank executes
    model = (6 * matmul_params(cfg) + 12 * m.n_layers * m.d_model * m.seq_len) * tokens
    assert flops_per_token(cfg) * tokens == model  # MFU's model FLOPs keep PaLM's 12


def test_one_rank_peak_is_the_dry_run_plan(tmp_path):
    """tiny on one rank: the live storages' peak is the dry run's (CPU kernels) within 5%. It was
    1.10× while the CPU's kept weight-grad buffers (parallel/autograd/kept_buffers.py), which a
    device does not hold, were counted from one step into the next; they are off in the run."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}"])
    (r,) = fake_ranks(cfg, "0")["ranks"]
    assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05


def test_a_4096_rank_world_builds_and_steps_at_its_edges(tmp_path):
    """dp64 · pp8 · tp8: the eight corner ranks build their groups, stages and buckets and take
    two steps. pp 0 and pp 7 of one pipeline are not neighbours, but they swap the tied
    embedding's grads (pipeline/tied.py): those sends must meet their receives."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=64", "--parallel.tp=8",
                             "--parallel.pp=8", "--model.n_layers=8", "--train.global_batch=128",
                             "--model.d_model=64", "--model.n_heads=8",
                             "--parallel.microbatches=2"])  # fmt: skip
    out = fake_ranks(cfg, "edges")
    assert out["world"] == 4096 and len(out["ranks"]) == 8
    assert out["p2p_matched"] > 0 and out["p2p_unmatched"] == 0
    for r in out["ranks"]:
        assert r["flops"] > 0 and r["comm_bytes"]["dp"] > 0 and r["comm_bytes"]["tp"] > 0


def test_ring_cp_rank_flops_and_peak_are_the_plans(tmp_path):
    """cp2 · dp2 under the ring: the rank's FLOPs are the plan's exactly (the zigzag ring runs
    (cp + 1)/2cp of its rows' causal attention, config/flops._ring_share) and its peak is the
    dry run's within 5%."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.cp=2", "--parallel.dp=2"])
    (r,) = fake_ranks(cfg, "1")["ranks"]
    assert r["flops"] == r["plan_flops"] and r["comm_bytes"]["cp"] > 0
    assert abs(r["peak_bytes"] / r["plan_peak_bytes"] - 1) <= 0.05
    assert_bytes_are_the_plans(r)


def _plan(*blocks, shape=(4, 6)):
    return {"tensors": {"w": {"shape": shape, "blocks": [(at, n, 0) for at, n in blocks]}}}


def test_tiling_finds_gaps_overlaps_and_disagreements():
    halves = {0: _plan(((0, 0), (2, 6))), 1: _plan(((2, 0), (2, 6)))}
    assert tiling_problems(halves) == []
    assert tiling_problems({**halves, 2: _plan(((0, 0), (2, 6)))}) == []  # a replica: DCP's dedup
    assert "cover 12 of 24" in tiling_problems({0: halves[0]})[0]
    assert "overlap" in tiling_problems({**halves, 2: _plan(((1, 0), (2, 6)))})[0]
    assert "leaves the shape" in tiling_problems({**halves, 2: _plan(((3, 0), (2, 6)))})[0]
    assert "different size" in tiling_problems({**halves, 2: _plan(((0, 0), (1, 6)))})[0]
    assert "shape" in tiling_problems({**halves, 2: _plan(shape=(4, 7))})[0]


def test_save_plans_of_every_rank_tile_every_tensor(tmp_path):
    """dp2 · tp2 under zero=1, every rank: the real save path's plan (train/checkpoint_plan.py)
    tiles each logical weight and moment exactly. dp 0 writes the weights, tp-sharded, and every
    replica its own flat range of the moments, so all four ranks write."""
    cfg = load_config(TINY, [f"--run.dir={tmp_path}", "--parallel.dp=2", "--parallel.tp=2",
                             "--parallel.zero=1"])  # fmt: skip
    out = fake_ranks(cfg, "all")
    assert out["save_tiling"] == []
    by_rank = {r["rank"]: r for r in out["ranks"]}
    assert all(r["save_bytes"] > 0 for r in out["ranks"])
    assert [by_rank[r]["save_file"] for r in range(4)] == [f"__{r}_0.distcp" for r in range(4)]
    # dp 1 writes moments only: less than dp 0, which writes the weights besides
    assert by_rank[2]["save_bytes"] < by_rank[0]["save_bytes"]
