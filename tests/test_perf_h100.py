"""The performance model on published H100/H200 runs (benchmarks/validation/h100_validation.py),
the runtimes that ran them (perf/software.py: megatron_core, torchtitan) and the mechanisms they
add.

- The published rows, each projected with its code base's runtime on its cluster: mean absolute
  error of tokens/s per GPU ≤ 8%, max ≤ 15%, leave-one-out (the H100 e_max refitted without
  the row, validation/h100_fit.py); the fit is reproducible from the profile's value and moves only
  e_max; Table 1 (A100) still meets its target.
- Megatron-Core's runtime: its facts as stated (bf16 weights and p2p, fp32 grad reduction,
  46 B optimizer, buckets of max(40M, 1M·dp) parameters, only the first stage's first chunk
  bucketed), untouched by resolved(); TE's tp overlap hides what its GEMM covers and no more;
  p2p overlap only under interleaving.
- The selective recompute policies of torchtitan (per-op) and MaxText (save_dot_except_mlpwi)
  rerun more than the attention core and less than the whole layer.
- Megapipe's runtime beside it: the attribution's terms add up to the difference.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.validation import h100_fit, published
from benchmarks.validation import h100_validation as h100
from benchmarks.validation import table1 as t1
from benchmarks.validation.cli import main as validation_main
from megapipe.config import load_config
from megapipe.perf.cluster import load_cluster
from megapipe.perf.fp8_costs import cast_bytes
from megapipe.perf.model import project
from megapipe.perf.software import (
    MEGAPIPE,
    MEGATRON_2021,
    MEGATRON_CORE,
    RUNTIMES,
    TORCHTITAN,
    bucket_bytes,
    resolved,
)


@pytest.fixture(scope="module")
def results():
    return h100.compare()


@pytest.fixture(scope="module")
def loo(results):
    return h100.leave_one_out(results)


def test_published_rows_within_target(results, loo):
    """Issue 34's target on the fitted rows (every priced row but FIT_LEFT_OUT's), leave-one-out:
    each row projected with the e_max fitted on the others."""
    fitted = h100.fitted(loo)
    assert len(fitted) >= 6 and len({r.row.runtime for r in fitted}) >= 2
    mean, worst = h100.errors(fitted)
    table = h100.markdown(results, loo)
    assert mean <= h100.TARGET_MEAN, table
    assert worst <= h100.TARGET_MAX, table


def test_leave_one_out_refits_without_the_row(results, loo):
    """A fitted row's leave-one-out projection differs from its in-sample one (its fold's
    e_max is not the profile's); a row outside the fit keeps its own."""
    for r, k in zip(results, loo):
        if r.row.source in h100.FIT_LEFT_OUT:
            assert k is r
        else:
            assert k.projected != r.projected
    assert {r.row.source for r in results} - {r.row.source for r in h100.fitted(results)} == set(
        h100.FIT_LEFT_OUT
    )


def test_fit_is_reproducible_and_moves_only_e_max(results):
    """Refitting from the profile's values lands on them (the YAML carries the fit) and keeps
    κ and μ at their kernel measurements."""
    profile = h100_fit.constants(load_cluster("h100"))
    cal = h100.refit(results)
    assert cal.gemm == pytest.approx(profile.gemm, abs=0.002)
    assert (cal.knee, cal.memory) == pytest.approx((profile.knee, profile.memory), rel=1e-9)
    assert load_cluster("h200").gemm_efficiency == profile.gemm  # same silicon (h200.yaml)
    # the fit is below the best-shape kernel figure, as Table 1's is on A100s (h100.yaml)
    assert 0.85 < profile.gemm / 0.801 < 0.95


def test_table1_still_within_its_target():
    """The H100 fit leaves the A100 constants and Table 1 where they were (≤ 5% / 10%)."""
    mean, worst = t1.errors(t1.compare())
    assert mean <= t1.TARGET_MEAN and worst <= t1.TARGET_MAX


def test_megatron_core_rows_within_the_held_out_target(results):
    """Issue 34's target for Megatron-Core's H100 runs: ≤ 10% mean, ≤ 20% max."""
    core = [r for r in results if r.row.runtime == "megatron_core"]
    assert len(core) >= 6
    mean, worst = h100.errors(core)
    assert mean <= 0.10 and worst <= 0.20, h100.markdown(core)


def test_fp8_rows_held_out_within_target():
    """Issue 49's target on the published H100 FP8 runs (≤ 10% mean, ≤ 20% max), which no
    constant saw: their data file is not among the fitted sources."""
    fp8 = h100.compare_fp8()
    assert len(fp8) >= 12 and {r.row.precision for r in fp8} == {"fp8"}
    assert not set(published.FP8_SOURCES) & set(published.H100_SOURCES)
    assert all(published.measured(r.row).config.train.fp8 == "tensorwise" for r in fp8)
    mean, worst = h100.errors(fp8)
    assert mean <= h100.FP8_TARGET_MEAN and worst <= h100.FP8_TARGET_MAX, h100.fp8_markdown(fp8)


@pytest.mark.parametrize("after_norm", [False, True])
def test_delayed_scaling_casts_less_and_weights_once_a_step(after_norm):
    """Transformer Engine's delayed scaling (perf/fp8_costs.py) moves fewer bytes than
    megapipe's current scaling for every GEMM; both cast a weight once a step (megapipe's
    parallel/fp8_weight_cache.py), so more microbatches make F cheaper per microbatch; under
    current scaling the input grad reads W's cast transposed (a copy each microbatch), or
    casts Wᵀ once a step too (rowwise: `own_transpose`), or at every use (pipedream_async:
    1 microbatch and its own transpose)."""
    for m, n, k in [(4096, 6144, 4096), (16, 28672, 8192), (8192, 1024, 53248)]:
        now = cast_bytes(m, n, k, 2, "current", after_norm, 1)
        now_many = cast_bytes(m, n, k, 2, "current", after_norm, 64)
        one = cast_bytes(m, n, k, 2, "delayed", after_norm, 1)
        many = cast_bytes(m, n, k, 2, "delayed", after_norm, 64)
        assert sum(many) < sum(one) < sum(now) and sum(many) < sum(now_many) < sum(now)
        assert many[1:] == one[1:] and many[0] < one[0]  # only F holds the weight's cast
        assert now_many[1:] == now[1:] and now_many[0] < now[0]
        rowwise = cast_bytes(m, n, k, 2, "current", after_norm, 64, own_transpose=True)
        every_use = cast_bytes(m, n, k, 2, "current", after_norm, 1, own_transpose=True)
        assert rowwise[1] < every_use[1] and rowwise[0] == now_many[0]


def test_megatron_core_fp8_projection_faster_with_its_casts():
    """On a published FP8 row, Megatron-Core's runtime with current scaling's casts and amax
    ops projects a slower step than with its own delayed scaling's."""
    row = next(r for r in published.load_all(published.FP8_SOURCES) if r.tp > 1 and r.cp > 1)
    m = published.measured(row)
    cluster = load_cluster(m.cluster, row.gpus_per_node)
    rt = h100.runtime_of(row)
    assert rt.fp8_scaling == "delayed" and MEGAPIPE.fp8_scaling == "current"
    delayed = project(m.config, cluster, rt, memory=False)
    current = project(m.config, cluster, dataclasses.replace(rt, fp8_scaling="current"))
    assert delayed.step_time_s < current.step_time_s
    assert delayed.breakdown["tp_comm_s"] < current.breakdown["tp_comm_s"]


def test_each_row_runs_its_own_runtime_and_switches():
    for row in h100.rows():
        rt = h100.runtime_of(row)
        assert rt.name == row.runtime


def test_runtimes_are_registered_and_not_resolved_away():
    assert RUNTIMES["megatron_core"] is MEGATRON_CORE and RUNTIMES["torchtitan"] is TORCHTITAN
    for rt in (MEGATRON_CORE, TORCHTITAN, MEGATRON_2021):
        assert resolved(rt, "bfloat16", "bfloat16") == rt


def test_megatron_core_facts():
    rt = MEGATRON_CORE
    assert (rt.weight_cast_bytes, rt.grad_accum_bytes, rt.grad_bytes, rt.param_bytes) == (
        0.0,
        8.0,
        4,
        2,
    )
    assert rt.optimizer_bytes == 12 + 28 + 6  # norm and clip, fused Adam, write-back
    assert rt.attention_kernel == "cudnn" and rt.loss_bytes == (38.0, 14.0)
    assert rt.dp_overlap and rt.param_gather_overlap and rt.fused_elementwise
    assert rt.tp_comm_overlap  # --tp-comm-overlap, priced where parallel.tp_overlap asks
    assert bucket_bytes(rt, 8, 4) == 40e6 * 4 and bucket_bytes(rt, 512, 4) == 512e6 * 4
    # ours: 25 MB at small dp, 1M float32 grads per replica past it (tests/test_perf_runtime.py)
    assert bucket_bytes(MEGAPIPE, 2, 4) == 25 * 2**20
    assert bucket_bytes(MEGAPIPE, 512, 4) == 512e6 * 4


def _llama70b(overrides: list[str]) -> object:
    base = [
        "model.arch=llama",
        "model.n_layers=16",
        "model.d_model=8192",
        "model.n_heads=64",
        "model.n_kv_heads=8",
        "model.d_ff=28672",
        "model.vocab_size=32000",
        "model.seq_len=4096",
        "model.tie_embeddings=false",
        "parallel.tp=8",
        "parallel.sequence_parallel=true",
        "train.dtype=bfloat16",
        "train.params_dtype=bfloat16",
    ]
    return load_config(None, base + overrides)


def test_tp_overlap_hides_what_its_gemm_covers():
    cluster = load_cluster("h100")
    keys = ["parallel.dp=1", "parallel.microbatches=2", "train.global_batch=2"]
    plain = project(_llama70b(keys), cluster, MEGATRON_CORE, memory=False)
    over = project(_llama70b([*keys, "parallel.tp_overlap=true"]), cluster, MEGATRON_CORE,
                   memory=False)  # fmt: skip
    off = dataclasses.replace(MEGATRON_CORE, tp_comm_overlap=False)  # a runtime without it
    assert project(_llama70b([*keys, "parallel.tp_overlap=true"]), cluster, off,
                   memory=False).breakdown == plain.breakdown  # fmt: skip
    assert 0 < over.breakdown["tp_comm_s"] < plain.breakdown["tp_comm_s"] / 2
    # at least the last split of each pipelined reduce-scatter stays exposed (a quarter of
    # the two forward ones: 1/16 of the plain forward and backward collectives)
    assert over.breakdown["tp_comm_s"] >= plain.breakdown["tp_comm_s"] / 16 * 0.99
    # the 16 SMs TE keeps for the pipelined and bulk collectives slow the GEMMs beside them
    share = MEGATRON_CORE.tp_overlap_sm_share
    assert share > 0
    slower = over.breakdown["compute_s"] / plain.breakdown["compute_s"] - 1
    assert 0 < slower < share / (1 - share)


@pytest.mark.parametrize("vpp", [1, 2])
def test_p2p_overlap_only_under_interleaving(vpp):
    cluster = load_cluster("h100", 1)  # every stage on its own node: p2p over the network
    schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    cfg = _llama70b([
        "parallel.pp=4", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}",
        "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.microbatches=8",
        "train.global_batch=8",
    ])  # fmt: skip
    steps = [
        project(cfg, cluster, dataclasses.replace(MEGATRON_CORE, p2p_overlap=o), memory=False)
        for o in (False, True)
    ]
    if vpp == 1:
        assert steps[0].step_time_s == steps[1].step_time_s
    else:
        assert steps[1].step_time_s < steps[0].step_time_s


def test_attribution_adds_up_to_the_difference():
    beside = h100.beside_megapipe(h100.rows(("megatron_core",))[:1])
    (b,) = beside
    parts = h100.attribution(b)
    assert set(parts) == {*h100.TERMS, "LM head by chunks"}
    total = b.megapipe.step_time_s - b.megatron_core.step_time_s
    assert sum(parts.values()) == pytest.approx(total, rel=1e-9, abs=1e-12)
    assert b.ratio == pytest.approx(b.megatron_core.step_time_s / b.megapipe.step_time_s)


def test_cli_validate(capsys):
    assert validation_main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "| row | runtime |" in out and "leave-one-out |" in out and "mean |error|" in out
    assert "not fitted" in out and "published FP8 runs" in out
    assert validation_main(["validate", "--refit", "--no-loo"]) == 0
    out = capsys.readouterr().out
    assert "fitted again" in out and "leave-one-out |" not in out
    assert validation_main(["validate", "--parallel.tp=2"]) == 2


@pytest.mark.parametrize("runtime", [TORCHTITAN, RUNTIMES["maxtext"]], ids=lambda r: r.name)
def test_selective_policies_rerun_what_they_say(runtime):
    """torchtitan's per-op policy and MaxText's save_dot_except_mlpwi (recompute.modules
    core_attn,mlp) rerun more than the attention core and less than the whole layer; the
    attention policy reruns the core, and with recompute.modules core_attn,mlp also the MLP
    (both its GEMMs: more than MaxText's, which saves fc2's output)."""
    cluster = load_cluster("h100")
    base = ["parallel.dp=8", "parallel.microbatches=1", "train.global_batch=8", "parallel.tp=1",
            "parallel.sequence_parallel=false", "parallel.zero=3"]  # fmt: skip
    steps = {}
    for mode, modules in (("none", ""), ("selective", "core_attn"),
                          ("selective", "core_attn,mlp"), ("full", "")):  # fmt: skip
        cfg = _llama70b(
            [*base, f"recompute.mode={mode}", f"recompute.modules={modules or 'core_attn'}"]
        )
        for rt in (runtime, dataclasses.replace(runtime, selective_recompute="attention")):
            step = project(cfg, cluster, rt, memory=False).breakdown["compute_s"]
            steps[mode, modules, rt.selective_recompute] = step
    policy = runtime.selective_recompute
    own = steps["selective", "core_attn" if policy == "op" else "core_attn,mlp", policy]
    core = steps["selective", "core_attn", "attention"]
    mlp = steps["selective", "core_attn,mlp", "attention"]
    none, full = steps["none", "", "attention"], steps["full", "", "attention"]
    assert none < core < own < full and core < mlp < full
    if policy == "mlpwi":
        assert own < mlp
