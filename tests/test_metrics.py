import pytest
import torch

from megapipe.config.flops import flops_per_token, matmul_params
from megapipe.train.metrics import peak_tflops
from models.gpt import GPT


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
