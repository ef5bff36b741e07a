"""Aux-loss-free balancing (train/moe_balance.py, models/routing.py) on one process: the bias
step is rate · sign(mean load − load) of the step's load, the bias round-trips a checkpoint,
and the deepseek_v3 keys' one-line refusals. Mesh parity: tests/test_parity_moe.py's dsv3
cases."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ConfigError
from megapipe.data.loader import build_data
from megapipe.models.moe import MoE, routing_biases
from megapipe.train import checkpoint
from megapipe.train.moe_metrics import max_load, moe_record
from megapipe.train.parallelize import parallelize
from tests.parity import tiny_config

RATE = 0.01
DSV3 = ["model.arch=deepseek_v3", "model.n_experts=6", "model.n_group=3", "model.topk_group=2",
        "model.first_k_dense_replace=1", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
        "model.qk_rope_head_dim=4", "model.v_head_dim=8", f"model.moe_bias_update_rate={RATE}",
        "parallel.microbatches=2"]  # fmt: skip


def _biases(model) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf, _ in routing_biases(model)}


def test_the_bias_steps_by_the_sign_of_the_load_error_and_survives_a_checkpoint(tmp_path):
    cfg = tiny_config([*DSV3, f"checkpoint.dir={tmp_path}/ckpt"], str(tmp_path))
    torch.manual_seed(cfg.train.seed)
    job = parallelize(cfg, None)
    optimizer = job.optimizer()
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    expected = {name: torch.zeros_like(b) for name, b in _biases(job.model).items()}
    for step in range(2):
        job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step)
        loads = moe_record(cfg, job.model)["moe_load"]  # the step's rows per expert, per layer
        for name, load in zip(sorted(expected), loads, strict=True):
            load = torch.tensor(load, dtype=torch.float64)
            expected[name] += RATE * torch.sign(load.mean() - load).float()
    got = _biases(job.model)
    assert sorted(got) == ["layers.1.mlp.routing.bias"]
    assert all(b.abs().sum() > 0 for b in got.values())  # the loads were uneven: it moved
    for name in got:
        assert torch.equal(got[name], expected[name]), name
    path = checkpoint.save(cfg, 2, job.model, optimizer)
    fresh = parallelize(cfg, None)
    checkpoint.load(path, cfg, fresh.model, fresh.optimizer())
    assert all(torch.equal(got[n], b) for n, b in _biases(fresh.model).items())


@pytest.mark.parametrize("arch", [["model.arch=llama", "model.n_experts=6"], DSV3])
def test_max_load_is_the_routed_rows_max_over_their_mean(tmp_path, arch):
    """moe_max_load (train/moe_metrics.py) against the experts each routing chose, read off its
    forward: the softmax top-k (aux loss) and DeepSeek-V3's grouped sigmoid alike."""
    cfg = tiny_config([*arch, "parallel.microbatches=2", "model.top_k=2"], str(tmp_path))
    job = parallelize(cfg, None)
    layers = [m for m in job.model.modules() if isinstance(m, MoE)]
    chosen = {id(m.routing): torch.zeros(6, dtype=torch.float64) for m in layers}

    def tally(routing, args, out):  # out: (probs, top_i, gates); top_i (b·n, k)
        chosen[id(routing)] += torch.bincount(out[1].flatten(), minlength=6).double()

    for m in layers:
        m.routing.register_forward_hook(tally)
    data = build_data(cfg.data, cfg.model, cfg.train.seed)
    job.train_step(job.optimizer(), data.batch(0, cfg.train.global_batch), 0)
    record = moe_record(cfg, job.model)
    loads = torch.stack([chosen[id(m.routing)] for m in layers])  # (layers, E)
    assert record["moe_load"] == loads.long().tolist()
    ratio = max(float(row.max() / row.mean()) for row in loads)
    assert ratio > 1 and record["moe_max_load"] == pytest.approx(ratio, rel=1e-12)


def test_max_load_of_a_table_and_of_no_rows():
    load = torch.tensor([[2.0, 2.0, 2.0, 2.0], [1.0, 5.0, 1.0, 1.0]], dtype=torch.float64)
    assert max_load(load) == 5.0 / 2.0  # the second layer's expert 1: 5 rows, mean 2
    assert max_load(torch.zeros(2, 4, dtype=torch.float64)) == 0.0


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.n_group=4"], "model.n_group=4 must divide model.n_experts=6"),
        (["model.topk_group=4"], "model.topk_group=4 must be at most model.n_group=3"),
        (["model.n_group=3", "model.topk_group=1", "model.top_k=3"], "model.top_k=3 exceeds"),
        (["model.qk_rope_head_dim=5"], "model.qk_rope_head_dim=5 must be even"),
        (["model.arch=llama"], "model.moe_bias_update_rate > 0 needs model.arch=deepseek_v3"),
        (
            ["parallel.schedule=pipedream_async", "parallel.pp=2", "model.tie_embeddings=false"],
            "needs a flushing schedule: pipedream_async",
        ),
        (["parallel.cp=2", "model.v_head_dim=20"], "model.v_head_dim=20 > qk_nope_head_dim"),
        (["model.mtp_layers=1", "model.tie_embeddings=true"], "model.tie_embeddings=false"),
    ],
)
def test_bad_deepseek_config_is_one_line_error(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config([*DSV3, *overrides], str(tmp_path))
    assert "\n" not in str(err.value)
