import os

import pytest
import torch

from megapipe.config.flops import flops_per_token, matmul_params
from megapipe.models.gpt import GPT
from megapipe.train.metrics import MetricsLog, peak_tflops, read_metrics


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.arch=llama", "model.n_kv_heads=2", "model.tie_embeddings=false"]],
)
def test_matmul_params_counts_every_weight_matrix_and_the_head(tiny_cfg, overrides):
    cfg = tiny_cfg(*overrides)
    model = GPT(cfg.model, seed=0)
    in_layers = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith("layers.") and name.endswith("weight") and p.ndim == 2
    )
    head = cfg.model.vocab_size * cfg.model.d_model  # tied or not, the head is a matmul
    assert matmul_params(cfg) == in_layers + head


def test_flops_per_token_adds_attention_term(tiny_cfg):
    short, long = tiny_cfg("model.seq_len=16"), tiny_cfg("model.seq_len=32")
    m = short.model
    assert flops_per_token(short) == 6 * matmul_params(short) + 12 * m.n_layers * m.d_model * 16
    assert flops_per_token(long) - flops_per_token(short) == 12 * m.n_layers * m.d_model * 16


def test_peak_comes_from_config_or_is_unknown_on_cpu(tiny_cfg):
    assert peak_tflops(tiny_cfg(), torch.device("cpu")) is None
    assert peak_tflops(tiny_cfg("log.peak_tflops=2.5"), torch.device("cpu")) == 2.5


def test_mfu_reported_with_a_known_peak(tiny_cfg):
    import train

    records = train.run(tiny_cfg("log.peak_tflops=1.0", "train.steps=2"))
    assert all(r["mfu"] == pytest.approx(r["tflops"] / 1.0) for r in records)


def test_read_metrics_takes_the_last_record_of_each_step_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "loss": 3.0}\n'
        '{"step": 2, "loss": 2.5, "resumed_from": 1}\n{"step": 3, "lo'
    )  # a restart logged 2 again; the last line was cut by a kill
    assert read_metrics(str(path)) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.5, "resumed_from": 1},
        {"step": 3, "loss": 3.0},
    ]
    assert read_metrics(str(tmp_path / "none.jsonl")) == []


def test_a_resumed_log_drops_the_later_records_and_marks_its_first(tiny_cfg, monkeypatch):
    cfg = tiny_cfg()
    path = f"{cfg.run.dir}/metrics.jsonl"
    os.makedirs(cfg.run.dir)
    with open(path, "w") as f:
        f.write('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')  # killed after step 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    log = MetricsLog(cfg, start_step=2)
    log.log({"step": 3})
    log.log({"step": 4})
    log.close()
    lines = open(path).read().splitlines()
    assert lines == [
        '{"step": 1}',
        '{"step": 2}',
        '{"step": 3, "resumed_from": 2, "attempt": 1}',
        '{"step": 4}',
    ]
