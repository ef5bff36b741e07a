"""train.optimizer=muon (train/muon.py, train/muon_zero.py): torch's Muon arithmetic on each
logical matrix, the split of parameters between Muon and AdamW, its checkpoint names, its config
errors, and its terms in the memory and FLOP models (config/muon_terms.py). The distributed
parity cases live in test_parity_tp_dp.py, test_parity_pp.py and test_reshard.py."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ConfigError
from megapipe.parallel.tensor.sharding import NO_TP, ShardSpec
from megapipe.train.muon import MatrixLayout, Muon
from tests.parity import tiny_config

HYPER = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}


def _steps(optimizer, params, grads) -> None:
    for g in grads:
        for p, gp in zip(params, g, strict=True):
            p.grad = gp.clone()
        optimizer.step()


def _grads(shape, n=3, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def test_one_matrix_steps_bitwise_as_torch_muon():
    w0 = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    ours, theirs = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    layout = MatrixLayout((24, 16), ShardSpec(dim=1, segments=(16,)), NO_TP)
    grads = _grads((24, 16))
    _steps(Muon([{"params": [ours], "layouts": [layout]}], **HYPER), [ours], [[g] for g in grads])
    _steps(torch.optim.Muon([theirs], **HYPER), [theirs], [[g] for g in grads])
    assert torch.equal(ours, theirs)


def test_fused_matrices_are_orthogonalised_apart():
    """q | k | v of one fused weight step as three torch Muon matrices (their own adjusted lr)."""
    rows = (16, 8, 8)
    w0 = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    fused = w0.clone().requires_grad_()
    parts = [p.clone().requires_grad_() for p in w0.split(rows)]
    layout = MatrixLayout((32, 16), ShardSpec(dim=0, segments=rows, unit=8), NO_TP)
    grads = _grads((32, 16))
    _steps(Muon([{"params": [fused], "layouts": [layout]}], **HYPER), [fused], [[g] for g in grads])
    _steps(torch.optim.Muon(parts, **HYPER), parts, [list(g.split(rows)) for g in grads])
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in parts]))
    whole = w0.clone().requires_grad_()  # the planted mistake: q | k | v as one matrix
    _steps(torch.optim.Muon([whole], **HYPER), [whole], [[g] for g in grads])
    assert not torch.allclose(whole, fused, rtol=1e-3)


def _job(tmp_path, *extra):
    from megapipe.train.parallelize import parallelize

    cfg = tiny_config(["model.arch=llama", "model.tie_embeddings=false", *extra], str(tmp_path))
    job = parallelize(cfg, None)
    return job, job.optimizer()


def test_hidden_matrices_get_muon_and_the_rest_adamw(tmp_path):
    from megapipe.train.checkpoint import training_tensors

    job, opt = _job(tmp_path, "train.optimizer=muon")
    names = {id(p): n for n, p in job.model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    want = {f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj")}
    want |= {f"layers.{i}.mlp.{m}.weight" for i in range(2) for m in ("fc1", "fc2")}
    assert muon == want
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert adamw == set(names.values()) - want
    keys = training_tensors(job.model, opt)
    assert "optim.layers.0.attn.qkv.weight.momentum_buffer" in keys
    assert "optim.layers.0.attn.qkv.weight.exp_avg" not in keys
    assert "optim.embed.tok.weight.exp_avg_sq" in keys


def test_adamw_stays_the_default(tmp_path):
    from megapipe.train.optim import AdamW

    _, opt = _job(tmp_path)
    assert isinstance(opt, AdamW)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["train.optimizer=lion"], "train.optimizer"),
        (["train.muon_adjust_lr_fn=none"], "train.muon_adjust_lr_fn"),
    ],
)
def test_muon_config_errors_are_one_line(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_config(["train.optimizer=muon", *extra], str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_muon_takes_every_zero_level(tmp_path, zero):
    """Each matrix owned whole by one rank (train/muon_zero.py): no level is refused."""
    cfg = tiny_config(["train.optimizer=muon", "parallel.dp=2", f"parallel.zero={zero}"], "x")
    assert cfg.parallel.zero == zero


def test_bf16_weights_keep_the_momentum_under_its_name(tmp_path):
    """bf16 weights: Muon steps the float32 main params; the checkpoint names are the same
    before the first step (what a load reads into) as after it (what a save writes)."""
    from megapipe.data.loader import build_data
    from megapipe.train.checkpoint import training_tensors

    bf16 = ("train.dtype=bfloat16", "train.params_dtype=bfloat16")
    job, opt = _job(tmp_path, "train.optimizer=muon", *bf16)
    before = set(training_tensors(job.model, opt))
    data = build_data(job.cfg.data, job.cfg.model, job.cfg.train.seed)
    job.train_step(opt, data.batch(0, job.cfg.train.global_batch), 0)
    assert set(training_tensors(job.model, opt)) == before
    assert "optim.layers.1.mlp.fc2.weight.momentum_buffer" in before
    assert "optim.layers.1.mlp.fc2.weight.exp_avg" not in before


def _state_bytes(states) -> int:
    """Bytes of the optimizer's state tensors (the step counts, 0-d, left out)."""
    return sum(t.numel() * t.element_size() for st in states for t in st.values() if t.dim())


def test_memory_plan_counts_muons_state_as_the_optimizer_holds_it(tmp_path):
    """config/muon_terms.py against a real optimizer's tensors (made by its own `param_state`,
    as a step or a checkpoint load makes them): one momentum buffer per Muon matrix, AdamW's
    two moments for the rest; and the owned-whole layout under ZeRO (dp=2): AdamW's moments
    halved, the worst owner's momentum whole."""
    from megapipe.config.muon_terms import deal, muon_optimizer_bytes
    from megapipe.train.meta_memory import memory_plan

    job, opt = _job(tmp_path, "train.optimizer=muon")
    for p in job.model.parameters():
        opt.param_state(p)
    real = _state_bytes(opt.muon.state.values()) + _state_bytes(opt.adamw.state.values())
    assert memory_plan(job.cfg, "cpu").rank(0, 0).optimizer == real
    sizes = [p.numel() for g in opt.muon.param_groups for p in g["params"]]
    rest = sum(p.numel() for p in job.model.parameters()) - sum(sizes)
    owners = deal(sizes, 2)
    worst = max(sum(n for n, o in zip(sizes, owners) if o == r) for r in range(2))
    zero1 = tiny_config(["train.optimizer=muon", "parallel.dp=2", "parallel.zero=1"], "x")
    matrices = [(n, ((1, n),)) for n in sizes]
    got = muon_optimizer_bytes(rest + sum(sizes), matrices, zero1)
    assert got == 8 * -(-rest // 2) + 4 * worst
    assert 4 * sum(sizes) / 2 <= 4 * worst < 4 * sum(sizes)  # dealt, not replicated


def test_deal_balances_owners_by_elements_the_same_everywhere():
    from megapipe.config.muon_terms import deal, most_owned

    assert deal([4, 8, 4, 2], 2) == [1, 0, 1, 0]  # 8 first to rank 0, 4 and 4 to rank 1
    assert most_owned([4, 8, 4, 2], 2) == 10
    assert most_owned([4, 8, 4, 2], 1) == 18 and deal([], 3) == []


def test_flop_model_prices_newton_schulz_as_the_step_runs_it(tmp_path):
    """config/muon_terms.muon_step_flops (5 iterations of 3 matmuls per logical matrix) equals
    the matmul FLOPs torch counts in a real Muon step (q | k | v, gate | up apart)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megapipe.config.muon_terms import muon_step_flops
    from megapipe.train.meta_memory import muon_matrices

    job, opt = _job(tmp_path, "train.optimizer=muon")
    for g in opt.muon.param_groups:
        for p in g["params"]:
            p.grad = torch.randn_like(p)
    with FlopCounterMode(display=False) as counter:
        opt.muon.step()
    blocks = range(0, job.cfg.model.n_layers + 2)
    assert muon_step_flops(muon_matrices(job.cfg, blocks, 0), job.cfg) == counter.get_total_flops()


def test_projection_adds_newton_schulz_to_the_optimizer_step():
    """perf/muon_costs.py: the busiest rank's Newton-Schulz GEMMs join the optimizer step,
    fewer per rank once ZeRO deals the matrices to owners."""
    from megapipe.perf import load_cluster, project
    from megapipe.perf.muon_costs import newton_schulz_seconds

    cluster, base = load_cluster("h100"), ["model.arch=llama", "model.tie_embeddings=false"]
    adamw = project(tiny_config(base, "x"), cluster, memory=False)
    muon_cfg = tiny_config([*base, "train.optimizer=muon"], "x")
    muon = project(muon_cfg, cluster, memory=False)
    dev = type("Dev", (), {"gemm": staticmethod(lambda m, n, k, b, e: 2.0 * m * n * k * b)})
    blocks = [range(0, muon_cfg.model.n_layers + 2)]
    assert muon.breakdown["optimizer_s"] > adamw.breakdown["optimizer_s"]
    flops = newton_schulz_seconds(muon_cfg, dev, blocks)
    dealt = tiny_config([*base, "train.optimizer=muon", "parallel.dp=2", "parallel.zero=1"], "x")
    assert 0 < newton_schulz_seconds(dealt, dev, blocks) < flops


@pytest.mark.parametrize("dp,zero", [(1, 0), (4, 0), (4, 1), (8, 3)])
def test_owner_exchanges_are_priced_at_the_bytes_they_send(tmp_path, dp, zero):
    """perf/muon_costs.exchange_seconds: on a link of 1 B/s and no latency, the seconds are the
    bytes a rank sends in the owners' two all-to-alls (train/muon_zero.py): of its 1/n of each
    hidden matrix's elements (counted on the built model), the (n - 1)/n others own, in
    float32, twice; nothing without ZeRO."""
    from megapipe.perf.muon_costs import exchange_seconds

    job, opt = _job(tmp_path, "train.optimizer=muon")
    elements = sum(p.numel() for g in opt.muon.param_groups for p in g["params"])
    extra = ["train.optimizer=muon", f"parallel.dp={dp}", f"parallel.zero={zero}"]
    cfg = tiny_config(["model.arch=llama", "model.tie_embeddings=false", *extra], str(tmp_path))
    link = type("Link", (), {"latency": 0.0, "bandwidth": 1.0})
    n = dp if zero else 1
    sent = 2 * 4 * elements / n * (n - 1) / n
    blocks = [range(0, cfg.model.n_layers + 2)]
    assert exchange_seconds(cfg, link, blocks) == pytest.approx(sent, rel=1e-12)
