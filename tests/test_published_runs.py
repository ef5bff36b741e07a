"""The published H100/H200 runs (benchmarks/validation/published.py, data/*.csv): every row
loads into a valid config of the published model's size on the published GPU count."""

from dataclasses import replace

import pytest

from benchmarks.validation.published import (
    DATA,
    H100_SOURCES,
    load_all,
    load_rows,
    measured,
    row_config,
)
from megapipe.config.checks import validate
from megapipe.perf.cluster import cluster_names
from megapipe.train.meta_memory import model_params

ROWS = load_all()


def test_sources_are_files_with_their_source_in_the_header():
    for name in H100_SOURCES:
        head = [line for line in (DATA / name).read_text().splitlines() if line.startswith("#")]
        assert head, f"{name} has no header comment"
        assert any(("github.com" in h or "arXiv" in h) for h in head), name


def test_enough_rows_from_enough_code_bases():
    assert len(ROWS) >= 6
    assert {"megatron_core", "torchtitan"} <= {r.runtime for r in ROWS}
    assert {r.gpu for r in ROWS} <= {"h100", "h200"}
    assert len({r.label for r in ROWS}) == len(ROWS), "labels must be unique"


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_row_is_a_valid_config_of_the_published_model_and_mesh(row):
    cfg = row_config(row)
    validate(cfg)
    p = cfg.parallel
    assert p.tp * p.pp * p.cp * p.dp == row.gpus
    assert p.dp * p.microbatches * row.mbs == row.gbs == cfg.train.global_batch
    assert row.gpus % row.gpus_per_node == 0 or row.gpus < row.gpus_per_node
    assert row.gpu in cluster_names()
    params = model_params(cfg)
    assert abs(params / (row.params_b * 1e9) - 1) < 0.03, f"{params / 1e9:.2f}B"


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_measured_figures_agree_with_the_source(row):
    m = measured(row)
    assert m.tokens_per_s_per_gpu > 0 and m.model_tflops_per_gpu > 0
    if row.tokens_per_s_per_gpu is None:  # derived from the published TFLOP/s
        assert m.model_tflops_per_gpu == pytest.approx(row.tflops_per_gpu)
    # the NVIDIA tables count FLOPs as megapipe does (6N + 12·L·d·s) except Nemotron's, which
    # leaves out GQA: both figures published, they agree on the other rows
    both = row.tokens_per_s_per_gpu is not None and row.tflops_per_gpu is not None
    if both and not row.model.startswith("Nemotron"):
        assert m.model_tflops_per_gpu == pytest.approx(row.tflops_per_gpu, rel=0.02)


def test_load_rows_takes_a_path_or_a_name_and_names_a_missing_column(tmp_path):
    name = H100_SOURCES[0]
    assert load_rows(DATA / name) == load_rows(name)
    text = (DATA / name).read_text().replace(",mfu,", ",", 1)  # the header loses a column
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    with pytest.raises(ValueError, match="lacks column"):
        load_rows(bad)


def test_moe_file_rows_are_complete_and_their_mesh_covers_the_gpus():
    """data/moe_published_runs.csv as a CSV (validation/published_moe loads it)."""
    import csv

    text = (DATA / "moe_published_runs.csv").read_text().splitlines()
    header = [line for line in text if line.startswith("#")]
    rows = list(csv.DictReader(line for line in text if not line.startswith("#")))
    tags = {r["source"] for r in rows}
    assert all(any(f"[{t}]" in h for h in header) for t in tags), "each source tag in the header"
    assert len(rows) >= 2
    for r in rows:
        assert None not in r and all(r[k] is not None for k in r), r["label"]
        mesh = int(r["tp"]) * int(r["pp"]) * int(r["cp"]) * int(r["dp"])
        assert mesh == int(r["gpus"]), r["label"]
        assert int(r["n_experts"]) > 0 and 0 < int(r["top_k"]) <= int(r["n_experts"])
        assert r["tokens_per_s_per_gpu"] or r["tflops_per_gpu"], r["label"]


NVIDIA = ["nvidia_dgxc_benchmarking_h100_bf16.csv", "nvidia_dgxc_benchmarking_v25.04_h100_bf16.csv",
          "nvidia_dgxc_benchmarking_h100_fp8.csv"]  # fmt: skip


def test_nvidia_recipes_reduce_grads_in_bf16_and_a_file_without_the_column_in_float32(tmp_path):
    """NeMo's recipes set grad_sync_dtype=bf16 / grad_reduce_in_fp32=False (the files' headers):
    their rows reduce-scatter bf16 grads (parallel.grad_reduce_dtype); a file without the
    grad_reduce column ran float32, and a value megapipe cannot price is one line."""
    for name in NVIDIA:
        for row in load_rows(name):
            assert row.grad_reduce == "bf16", row.label
            assert row_config(row).parallel.grad_reduce_dtype == "bfloat16"
    titan = load_rows("torchtitan_h100_bf16.csv")[0]
    assert titan.grad_reduce == "float32"
    assert row_config(titan).parallel.grad_reduce_dtype == "float32"
    odd = replace(titan, grad_reduce="fp16")
    with pytest.raises(ValueError, match="grad_reduce fp16; one of float32, bf16"):
        row_config(odd)
