"""The published MoE runs (benchmarks/validation/data/moe_published_runs.csv) as configs and
their projection with Megatron-Core's runtime (validation/published_moe.py): issue 38's target,
each validated row's tokens/s per GPU within 15%, with no constant fitted on these rows."""

import dataclasses

import pytest

from benchmarks.validation import published_moe as pm


def test_rows_load_with_their_sources():
    rows = pm.load_rows()
    assert len(rows) == 9 and all(r.source for r in rows)
    grok = next(r for r in rows if r.label == "dgxc-grok1-314b-h100-512")
    assert (grok.n_experts, grok.top_k, grok.tp, grok.pp, grok.cp, grok.ep) == (8, 2, 4, 8, 2, 8)


def test_rows_not_priced_say_why():
    why = {r.label: pm.why_not(r) for r in pm.load_rows()}
    assert "fp8" in why["deepseek-v3-h800-2048"] and "fp8" in why["mbridge-qwen3-30b-a3b-h100-16"]
    assert "not published" in why["mcore-mixtral-8x7b-468"]
    assert "head_dim" in why["mbridge-gptoss120b-h100-64"]
    assert [r.label for r in pm.validated()] == [
        "dgxc-grok1-314b-h100-512",
        "dgxc-grok1-314b-h100-2048",
        "dgxc-llama4-maverick-h100-512",
    ]
    with pytest.raises(ValueError, match="fp8"):
        pm.row_config(next(r for r in pm.load_rows() if r.precision == "fp8"))


def _row(label):
    return next(r for r in pm.load_rows() if r.label == label)


def test_row_config_is_the_published_run():
    row = pm.validated()[0]
    cfg = pm.row_config(row)
    m, p = cfg.model, cfg.parallel
    assert (m.n_layers, m.d_model, m.n_experts, m.top_k, m.moe_ffn) == (64, 6144, 8, 2, 32768)
    assert m.moe_capacity_factor == 1.0 and p.sequence_parallel and p.ep == 8
    assert cfg.derived.world_size == row.gpus and cfg.derived.tokens_per_step == 1024 * 8192
    rt = pm.runtime_of(row)
    assert rt.name == "megatron_core" and rt.moe_expert_tp and not rt.moe_grouped_gemm
    assert rt.grad_bytes == 2 and rt.attention_kernel == "flash"
    assert not p.tp_overlap  # grok1_314b.yaml: ub_tp_comm_overlap: false


def test_llama4_row_is_its_recipe():
    # dgxc-benchmarking v25.05 llama4: 512 H100, TP 4, EP 128 = DP, ETP 4, GBS 1024, seq 8192
    row = _row("dgxc-llama4-maverick-h100-512")
    cfg = pm.row_config(row)
    m, p = cfg.model, cfg.parallel
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff) == (48, 5120, 40, 8, 16384)
    assert (m.n_experts, m.top_k, m.moe_ffn, m.moe_every, m.moe_shared_experts) == (
        128,
        1,
        8192,
        2,
        1,
    )
    assert (p.tp, p.pp, p.dp, p.ep, p.microbatches) == (4, 1, 128, 128, 8)
    assert p.tp_overlap and p.sequence_parallel and m.moe_capacity_factor == 1.0
    assert cfg.derived.world_size == 512 and cfg.derived.tokens_per_step == 1024 * 8192
    rt = pm.runtime_of(row)
    assert rt.moe_grouped_gemm and rt.moe_expert_tp and rt.grad_bytes == 2
    assert rt.attention_kernel == "cudnn"  # TE's default on Hopper: the recipe sets none
    # the published step and throughput agree: 1024 · 8192 / 4.426 s over 512 GPUs
    assert row.tokens_per_s_per_gpu == pytest.approx(1024 * 8192 / 4.426 / 512, rel=1e-3)


@pytest.fixture(scope="module")
def results():
    return pm.compare()


def test_validated_rows_within_15_percent(results):
    # Grok-1 314B on 512 and 2048 H100s (NVIDIA dgxc-benchmarking v24.11.1): +3.8%, +5.1%
    # when written; each row is held to the target on its own
    assert len(results) >= 2
    for r in results:
        assert abs(r.error) <= pm.TARGET, (r.row.label, r.measured, r.projected)
    assert all(r.projection.breakdown["ep_comm_s"] > 0 for r in results)


def test_two_published_models_within_target(results):
    # issue 38: "at least two published MoE training throughputs ... within 15%"
    models = pm.models_within(results)
    assert len(models) >= pm.MODELS_TARGET
    assert {"Grok-1 314B", "Llama 4 Maverick 400B"} <= set(models)


def test_projection_moves_without_its_mechanisms(results, monkeypatch):
    """The Llama 4 row's projection rests on priced mechanisms, each of which moves it: the
    all-to-alls (EP 128 over 64 nodes: without them it leaves the target), the shared
    expert beside them (moe_shared_expert_overlap), the recipe's tp overlap, expert tp."""
    from megapipe.perf import costs_moe
    from megapipe.perf.cluster import load_cluster
    from megapipe.perf.model import project

    got = next(r for r in results if r.row.label == "dgxc-llama4-maverick-h100-512")
    cfg, rt, cluster = pm.row_config(got.row), pm.runtime_of(got.row), load_cluster("h100", 8)

    def error(c, runtime=rt):
        step = project(c, cluster, runtime, memory=False).step_time_s
        return c.derived.tokens_per_step / step / got.row.gpus / got.measured - 1

    assert error(cfg) == pytest.approx(got.error, abs=1e-9)
    no_overlap = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, tp_overlap=False)
    )
    assert error(no_overlap) < got.error - 0.05
    whole = dataclasses.replace(rt, moe_expert_tp=False)  # experts whole: no etp collectives
    assert error(cfg, whole) > got.error
    inline = dataclasses.replace(rt, moe_shared_expert_overlap=False)
    assert error(cfg, inline) < got.error - 0.05
    monkeypatch.setattr(costs_moe, "all_to_all_time", lambda *a: 0.0)
    free = error(cfg)
    assert free > got.error + 0.1 and abs(free) > pm.TARGET


def test_markdown_lists_every_row(results):
    text = pm.markdown(results)
    for row in pm.load_rows():
        assert row.label in text
    assert "published models with every row within 15%: 2" in text
